"""hivemind's side of synchronous DiLoCo: the all-reduce of outer gradients, state sharing, progress records.

Built as OpenDiLoCo builds its ``DiLoCoGradAverager`` (a `DecentralizedAverager` whose averaged tensors
are the outer gradients, global − local), without its subclass of `hivemind.Optimizer`:

* `OuterAverager`: one buffer per parameter, averaged with equal weights in a butterfly all-reduce among
  the peers that found each other in the matchmaking window. The buffers are float64 (`EXACT_DTYPE`)
  unless the wire is compressed: hivemind hands each member ``average − own part`` and the member adds it
  back, which in float32 rounds differently on every peer (measured: the global models of two peers
  differed after the first round); in float64 the sum of float32 values is exact, so every member gets
  the same average and, cast to float32, the same global model, bit for bit. Before each round its
  group key bits are set to the round's epoch (`rounds.epoch_group_bits`), so peers of different epochs
  never meet; each member gathers ``{"epoch", "digest"}`` (its Θ and outer momentum; checked by
  `rounds.settle_round`). A member to which a reducer did not send its part of the average back
  (hivemind then keeps this member's own values for that part, logs "Averaging: received N% results"
  and reports success) fails the round instead (`rounds.partial_average`): applied, such an average
  leaves it on another global model than the members that got every part. It also
  serves this peer's global state (Θ, outer momentum, epoch, from the `state` callable, called on
  hivemind's state thread) to peers that call `load`, which downloads from the peer with the highest
  epoch (`state_sharing_priority`).
* `RoundTracker`: hivemind's `ProgressTracker` (each peer's epoch and samples since its last outer step,
  owner-signed DHT records) that also keeps the per-peer records it parsed (`peers`), which
  `rounds.decide_round` reads; hivemind itself only keeps their sums.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from torch import Tensor

from p2p_diloco.baseline.rounds import PeerProgress, epoch_group_bits, partial_average

log = logging.getLogger(__name__)

StateFn = Callable[[], tuple[dict[str, Any], list[Tensor]]]
EXACT_DTYPE = torch.float64


class OuterAverager(DecentralizedAverager):
    """The all-reduce of outer gradients and the state server of one peer (module docstring)."""

    def __init__(
        self, shapes: Sequence[torch.Size], dht: Any, *, state: StateFn, dtype: torch.dtype, **kwargs: Any
    ):
        self._state = state  # before the base class starts the thread that calls get_current_state
        buffers = [torch.zeros(shape, dtype=dtype) for shape in shapes]
        super().__init__(averaged_tensors=buffers, dht=dht, start=True, **kwargs)

    def get_current_state(self) -> tuple[dict[str, Any], list[Tensor], None]:
        metadata, tensors = self._state()
        return metadata, tensors, None

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[Tensor], group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        """hivemind's all-reduce (in the averager's process), failed if a part of the average never came
        back (module docstring): hivemind's runner counts such values in its `failed_size`."""
        await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        runner = self._running_groups[group_info.group_id if group_id is None else group_id].result()
        parts = runner.tensor_part_container
        reason = partial_average(parts.failed_size, parts.total_size)
        if reason is not None:
            raise AllreduceException(reason)

    def average(
        self, grads: Sequence[Tensor], *, epoch: int, digest: str, timeout: float
    ) -> tuple[list[object], list[Tensor]] | str:
        """All-reduce `grads` with the peers of `epoch`: (what each member gathered, the averaged
        gradients in float32), or the reason it failed."""
        try:
            self.set_group_bits(epoch_group_bits(epoch))
            with self.get_tensors() as buffers:
                for buffer, grad in zip(buffers, grads, strict=True):
                    buffer.copy_(grad)
            gathered = self.step(
                gather={"epoch": epoch, "digest": digest}, weight=1.0, timeout=timeout, allow_retries=False
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the round: decided again by the caller
            return f"{type(exc).__name__}: {exc}"
        if not gathered:
            return "no group"
        with self.get_tensors() as buffers:
            averaged = [buffer.to(torch.float32) for buffer in buffers]
        return list(gathered.values()), averaged

    def load(self, timeout: float) -> tuple[Any, list[Tensor]] | None:
        """The state of the peer with the highest epoch (metadata, tensors), or None."""
        try:
            result = self.load_state_from_peers(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - a timeout or a peer gone mid-download
            log.info("loading state from peers failed: %r", exc)
            return None
        if result is None:
            return None
        metadata, tensors = result
        return metadata, list(tensors)


class RoundTracker(ProgressTracker):
    """hivemind's progress tracker that keeps the parsed per-peer records in `peers`; `fetch_peers`
    reads them afresh (a round decides on records at most a DHT round trip old, not a refresh period)."""

    peers: tuple[PeerProgress, ...] = ()

    def _parse_swarm_progress_data(self, metadata: Any) -> Any:
        self.peers = _parse_records(metadata)
        return super()._parse_swarm_progress_data(metadata)

    def fetch_peers(self) -> tuple[PeerProgress, ...]:
        """The live records now (the last ones seen if the DHT does not answer)."""
        try:
            found = self.dht.get(self.training_progress_key, latest=True)
        except Exception as exc:  # noqa: BLE001 - a DHT hiccup: decide on the last records
            log.info("reading progress records failed: %r", exc)
            return self.peers
        self.peers = _parse_records(getattr(found, "value", None))
        return self.peers


def _parse_records(metadata: Any) -> tuple[PeerProgress, ...]:
    found = []
    if isinstance(metadata, dict):
        for record in metadata.values():
            value = getattr(record, "value", None)
            if value is None:
                continue
            try:
                p = LocalTrainingProgress.parse_obj(value)
            except Exception:  # noqa: BLE001 - a malformed record is ignored (hivemind's schema checks it)
                continue
            found.append(
                PeerProgress(p.peer_id, p.epoch, p.samples_accumulated, p.samples_per_second, p.time)
            )
    return tuple(found)
