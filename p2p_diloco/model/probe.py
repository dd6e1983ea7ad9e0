"""The loss measurement of the loss check and score (`protocol.loss_score`): what each delta of a round would
do to the global model's loss on a batch drawn for that round.

`LossProbe.measure(deltas, seed)` draws `[robust] score_batch` windows of the run's held-out data at random
positions from the round's seed (`protocol.loss_score.score_seed`) and a salt of its own (`draw_starts`: a
real peer's salt is secret, so no sender can know the batch in advance; in tests and the simulator it is
empty and the batch is deterministic given the round), evaluates the global model alone on them once, then
for each delta the global model with the delta taken as an outer step on its fragment,
``theta - step * delta`` with ``step = [robust] score_step x [diloco] outer_lr``, window by window, and
returns the mean per-window change of the loss with its standard error (`LossChange`). An honest delta
lowers the loss or leaves it about level; a delta that drags the model back toward its initial weights, or
anywhere else it should not go, raises it, whatever its norm and direction look like (as Templar's Gauntlet
scores peers). The synchronizer judges the changes (`swarm.synchronizer`, `loss_score.judge_round`).

The probe holds one extra copy of the model, reloaded from the replica when the global versions change.
Cost: one forward pass of `score_batch` windows for the round's base plus one per delta, and copying the
delta's fragment in and out (scripts/bench_loss_score.py measures it). On in public runs by default
(`RunManifest.loss_check_on`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.shards import TokenData
from p2p_diloco.protocol.loss_score import LossChange
from p2p_diloco.protocol.replica import GlobalReplica


def draw_starts(seed: bytes, salt: bytes, count: int, last_start: int) -> Tensor:
    """`count` window starts in [0, `last_start`], drawn from BLAKE2b(salt, seed): the same for the same
    arguments, unrelated for any other seed."""
    digest = hashlib.blake2b(seed, key=salt[:64], digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "big") >> 1)
    return torch.randint(0, last_start + 1, (count,), generator=gen)


class LossProbe:
    def __init__(
        self,
        model: nn.Module,
        eval_data: Tensor | TokenData,
        *,
        block_size: int,
        step: float,
        global_params: Callable[[], Mapping[str, Tensor]],
        global_version: Callable[[], Hashable],
        windows: int = 16,
        salt: bytes = b"",
    ):
        if len(eval_data) < block_size + 1:
            raise ConfigError(
                f"the loss check needs held-out data of at least block_size + 1 = {block_size + 1} tokens, "
                f"the run's has {len(eval_data)}: raise data.eval_fraction or turn [robust] loss_check off"
            )
        self.model = model.eval()  # its own copy: dropout off for good
        self.eval_data = eval_data
        self.block_size = block_size
        self.step = step  # the outer step a delta is tried at: [robust] score_step x [diloco] outer_lr
        self.global_params = global_params
        self.global_version = global_version
        self.windows = windows
        self.salt = salt
        self.params = dict(model.named_parameters())
        self._loaded: Hashable = None
        self.calls = 0  # deltas measured

    def batch(self, seed: bytes) -> Tensor:
        """The `windows` x (block_size + 1) token windows of `seed` (inputs and next-token targets)."""
        last_start = len(self.eval_data) - self.block_size - 1
        starts = draw_starts(seed, self.salt, self.windows, last_start)
        return self.eval_data[starts[:, None] + torch.arange(self.block_size + 1)].long()

    def _window_losses(self, windows: Tensor) -> Tensor:
        """Each window's mean next-token loss (float64)."""
        device = next(self.model.parameters()).device
        windows = windows.to(device)
        logits, _ = self.model(windows[:, :-1], None)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1), reduction="none"
        )
        return loss.view(len(windows), -1).mean(dim=1).double().cpu()

    def _load_global(self) -> None:
        version = self.global_version()
        if version != self._loaded:
            for name, value in self.global_params().items():
                self.params[name].copy_(value)
            self._loaded = version

    @torch.no_grad()
    def measure(self, deltas: Sequence[Mapping[str, Tensor]], seed: bytes) -> list[LossChange]:
        """Each of `deltas` taken alone as an outer step on the global model, measured on the batch of `seed`
        against the global model alone (`LossChange`); the model is left as it was."""
        if not deltas:
            return []
        self._load_global()
        windows = self.batch(seed)
        base = self._window_losses(windows)
        changes = []
        for delta in deltas:
            saved = {name: self.params[name].detach().clone() for name in delta}
            try:
                for name, d in delta.items():
                    param = self.params[name]
                    param.sub_(self.step * d.to(param.device, param.dtype))
                diff = self._window_losses(windows) - base
            finally:
                for name, value in saved.items():
                    self.params[name].copy_(value)
            n = len(diff)
            stderr = float(diff.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
            changes.append(LossChange(float(base.mean()), float(diff.mean()), stderr, n))
            self.calls += 1
        return changes

    def __call__(self, delta: Mapping[str, Tensor], seed: bytes = b"") -> float:
        """Relative change of the batch's loss (the batch of `seed`) if the global model took `delta` as an
        outer step."""
        return self.measure([delta], seed)[0].relative


def loss_probe_for(
    manifest: RunManifest, replica: GlobalReplica, eval_data: Tensor | TokenData, *, salt: bytes = b""
) -> LossProbe | None:
    """The manifest's loss check for a peer holding `replica`, or None when it is off; `salt`: the peer's
    secret for drawing batches (empty: batches follow from the rounds alone)."""
    if not manifest.loss_check_on:
        return None
    from p2p_diloco.model.gpt import build_model

    fragments = range(len(replica.versions()))
    return LossProbe(
        build_model(manifest.model),
        eval_data,
        block_size=manifest.model.block_size,
        step=manifest.robust.score_step * manifest.diloco.outer_lr,
        global_params=lambda: {n: t for p in fragments for n, t in replica.params_view(p).items()},
        global_version=replica.versions,
        windows=manifest.robust.score_batch,
        salt=salt,
    )
