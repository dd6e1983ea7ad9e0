"""What a `join` process does so the run can be seen as a whole: global evaluation, peer stats, log sinks.

`Observing` is built by `PeerNode` from `ObserveOptions` (``join --evaluate / --no-evaluate /
--eval-every / --eval-batches / --log-to``) and owns three jobs, none of them on the owner thread's
critical path:
- the `GlobalEvaluator` (`node.evaluation`): evaluates on the training thread between steps when this
  peer is the evaluator, publishes the history on the DHT I/O thread; peers that log (``--log-to``)
  read the history every `follow_seconds` on the I/O thread and log its new points;
- `PeerStats` (`wire.observe`: start time, device, bytes in and out) stored under `keys.stats_key`
  every `stats_seconds` on the I/O thread, for the dashboard's peer table;
- the log sinks: the peer's loss, tokens/s and merged tokens at every progress line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.node.evaluation import EvalMode, EvalOptions, GlobalEvaluator
from p2p_diloco.node.ledger import ContributionLedger
from p2p_diloco.node.logsinks import LogSpec, SafeSinks, open_sinks
from p2p_diloco.node.threads import ThreadedDriver
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.wire.interfaces import Clock
from p2p_diloco.wire.keys import stats_key
from p2p_diloco.wire.observe import PeerStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObserveOptions:
    """What a `join` process publishes and logs about the run besides training (module docstring)."""

    evaluation: EvalOptions = field(default_factory=EvalOptions)
    log_to: tuple[LogSpec, ...] = ()
    stats_seconds: float = 5.0  # how often the peer's stats record is written (it expires after 3x)


class Observing:
    """The observability jobs of one peer (module docstring): `attach` before the driver starts,
    `after_step` on the training thread, `progress` with each progress line, `close` at shutdown."""

    def __init__(self, options: ObserveOptions, manifest: RunManifest, peer_id: str, clock: Clock):
        self.options, self.manifest, self.peer_id, self.clock = options, manifest, peer_id, clock
        self.sinks: SafeSinks = open_sinks(options.log_to, manifest.run_id, peer_id)
        self.evaluator: GlobalEvaluator | None = None
        self.driver: ThreadedDriver | None = None
        self.started_at = clock.now()
        self.ledger: ContributionLedger | None = None

    def attach(
        self,
        driver: ThreadedDriver,
        peer: Peer,
        eval_data,  # noqa: ANN001 - the run's held-out split
        device: str,
        ledger: ContributionLedger | None,
        bytes_counter,  # noqa: ANN001 - node.bytes.ByteCounter
        event: Callable[..., None],
    ) -> None:
        """Register the periodic jobs on `driver` (before `driver.start`)."""
        self.driver, self.ledger = driver, ledger
        opts = self.options.evaluation

        def publish_stats() -> None:
            now = self.clock.now()
            stats = PeerStats(self.started_at, device[:32], bytes_counter.sent, bytes_counter.received)
            key = stats_key(self.manifest.run_id, self.manifest.manifest_hash)
            driver.kv.store(key, self.peer_id, stats.to_bytes(), now + 3 * self.options.stats_seconds)

        driver.every(self.options.stats_seconds, lambda: driver.run_io(publish_stats, None))
        if opts.mode is EvalMode.NEVER and not self.sinks:
            return

        def snapshot() -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
            # the replica's own tensors (never changed in place: they keep this version's values), no copy
            frozen = driver.call(peer.replica.frozen, timeout=10.0)
            params = {n: t for p in range(frozen.num_fragments) for n, t in frozen.params_view(p).items()}
            return params, frozen.versions()

        self.evaluator = GlobalEvaluator(
            self.manifest,
            opts,
            peer_id=self.peer_id,
            kv=driver.kv,
            clock=self.clock,
            make_model=lambda: build_model(self.manifest.model).to(device),
            eval_data=eval_data,
            versions=lambda: peer.replica.versions(),
            snapshot=snapshot,
            holds_lease=lambda: peer.sync is not None,
            term=lambda: peer.membership.term_seen,
            ledger=ledger,
            sinks=self.sinks,
            event=event,
        )
        evaluator = self.evaluator

        def follow() -> bool:  # read the history while it matters to us: we log it, or may evaluate
            return bool(self.sinks) or evaluator.wants_to_evaluate(self.clock.now())

        driver.every(opts.follow_seconds, lambda: driver.run_io(evaluator.refresh, None), when=follow)

    def after_step(self) -> None:
        """On the training thread: evaluate if due, then publish on the I/O thread."""
        if self.evaluator is None or self.driver is None:
            return
        try:
            point = self.evaluator.maybe_evaluate()
        except Exception as exc:  # noqa: BLE001 - evaluation never stops training
            log.warning("global evaluation failed: %r", exc)
            return
        if point is not None:
            self.driver.run_io(self.evaluator.publish, None)

    def progress(self, learner, tokens_per_s: float) -> None:  # noqa: ANN001 - swarm.learner.Learner
        """The peer's own numbers to the sinks; merged tokens are this peer's in its ledger."""
        if not self.sinks:
            return
        step, loss = learner.step, learner.last_loss
        mine = self.ledger.totals.get(self.peer_id) if self.ledger is not None else None
        merged = mine.tokens if mine is not None else 0
        values = {"peer/tokens_per_s": tokens_per_s, "peer/merged_tokens": float(merged)}
        if loss == loss:
            values["peer/loss"] = loss
        self.sinks.log(values, step=step, wall_time=self.clock.now())

    def close(self) -> None:
        self.sinks.close()
