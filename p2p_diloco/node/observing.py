"""What a `join` process does so the run can be seen as a whole: global evaluation, peer stats, log sinks.

`Observing` is built by `PeerNode` from `ObserveOptions` (``join --evaluate / --no-evaluate /
--eval-every / --eval-batches / --log-to``) and owns three jobs, none of them on the owner thread's
critical path:
- global evaluation (`node.evaluation`): every `EVAL_POLL_SECONDS` the owner thread asks its
  `GlobalEvaluator` whether one is due; a request goes to the training thread (a queue), which
  evaluates between steps (`after_step`) and posts the loss back to the owner thread; the history is
  read (and, after a point of ours, stored) on the DHT I/O thread and merged on the owner thread. Peers
  that log (``--log-to``) read it every `follow_seconds` and log its new points;
- `PeerStats` (`wire.observe`: start time, device, bytes in and out from the transport's counts) built
  on the owner thread and stored under `keys.stats_key` every `stats_seconds` on the I/O thread, for
  the dashboard's peer table;
- the log sinks: the peer's loss, tokens/s and merged tokens at every progress line (owner thread).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.net.traffic import TransportCounts
from p2p_diloco.node.evaluation import (
    HISTORY_TTL,
    EvalMode,
    EvalOptions,
    EvalRequest,
    EvalWorker,
    GlobalEvaluator,
    HistoryRead,
    read_histories,
)
from p2p_diloco.node.ledger import ContributionLedger
from p2p_diloco.node.logsinks import LogSpec, SafeSinks, open_sinks
from p2p_diloco.node.threads import ThreadedDriver
from p2p_diloco.node.training import TrainingView
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.wire.interfaces import Clock
from p2p_diloco.wire.keys import stats_key
from p2p_diloco.wire.observe import PeerStats

log = logging.getLogger(__name__)

EVAL_POLL_SECONDS = 0.25  # how often the owner thread asks whether an evaluation is due


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
        self.evaluator: GlobalEvaluator | None = None  # owner thread
        self.worker: EvalWorker | None = None  # training thread
        self.driver: ThreadedDriver | None = None
        self.started_at = clock.now()
        self.ledger: ContributionLedger | None = None
        self._requests: queue.SimpleQueue[EvalRequest] = queue.SimpleQueue()  # owner -> training thread

    def attach(
        self,
        driver: ThreadedDriver,
        peer: Peer,
        eval_data,  # noqa: ANN001 - the run's held-out split
        device: str,
        ledger: ContributionLedger | None,
        counts: Callable[[], TransportCounts | None],
        event: Callable[..., None],
    ) -> None:
        """Register the periodic jobs on `driver` (before `driver.start`)."""
        self.driver, self.ledger = driver, ledger
        opts = self.options.evaluation
        driver.every(self.options.stats_seconds, lambda: self._publish_stats(driver, device, counts))
        if opts.mode is EvalMode.NEVER and not self.sinks:
            return
        self.evaluator = GlobalEvaluator(
            self.manifest,
            opts,
            peer_id=self.peer_id,
            ledger=ledger,
            sinks=self.sinks,
            event=event,
            owner=driver.owner,
        )
        self.worker = EvalWorker(
            self.manifest, opts, lambda: build_model(self.manifest.model).to(device), eval_data
        )
        self._schedule_evaluation(driver, self.evaluator, peer)

    def _publish_stats(
        self, driver: ThreadedDriver, device: str, counts: Callable[[], TransportCounts | None]
    ) -> None:
        """On the owner thread: this peer's `PeerStats`, stored on the I/O thread (expires after 3
        periods)."""
        now, c = self.clock.now(), counts()
        sent, received = (c.bytes_sent, c.bytes_received) if c is not None else (0, 0)
        value = PeerStats(self.started_at, device[:32], sent, received).to_bytes()
        key = stats_key(self.manifest.run_id, self.manifest.manifest_hash)
        expiration = now + 3 * self.options.stats_seconds
        driver.run_io(lambda: driver.kv.store(key, self.peer_id, value, expiration), None)

    def _schedule_evaluation(self, driver: ThreadedDriver, evaluator: GlobalEvaluator, peer: Peer) -> None:
        """Follow the eval history while it matters to us and, unless never evaluating, ask if one is due."""
        opts = self.options.evaluation

        def frozen() -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
            # the replica's own tensors (never changed in place: they keep this version's values), no copy
            replica = peer.replica.frozen()
            params = {n: t for p in range(replica.num_fragments) for n, t in replica.params_view(p).items()}
            return params, replica.versions()

        def ask() -> None:  # owner thread
            request = evaluator.ask(
                self.clock.now(),
                versions=peer.replica.versions(),
                holds_lease=peer.sync is not None,
                term=peer.membership.term_seen,
                frozen=frozen,
            )
            if request is not None:
                self._requests.put(request)

        def follow() -> bool:  # owner thread: read the history while we log it or may evaluate
            return bool(self.sinks) or evaluator.wants_to_evaluate(self.clock.now(), peer.sync is not None)

        driver.every(
            opts.follow_seconds,
            lambda: driver.run_io(lambda: self._read(evaluator.absorb), None),
            when=follow,
        )
        if opts.mode is not EvalMode.NEVER:
            driver.every(EVAL_POLL_SECONDS, ask)

    def _read(self, then: Callable[[HistoryRead], None]) -> None:
        """On the I/O thread: read the eval history records, hand them to `then` on the owner thread."""
        assert self.driver is not None and self.evaluator is not None
        read = read_histories(self.driver.kv, self.evaluator.key, self.manifest, self.clock.now())
        self.driver.post_call(lambda: then(read))

    def after_step(self) -> None:
        """On the training thread: run the evaluation the owner thread asked for, if any."""
        if self.worker is None or self.driver is None:
            return
        try:
            request = self._requests.get_nowait()
        except queue.Empty:
            return
        try:
            loss: float | None = self.worker.evaluate(request)
        except Exception as exc:  # noqa: BLE001 - evaluation never stops training
            log.warning("global evaluation failed: %r", exc)
            loss = None
        self.driver.post_call(lambda: self._finished(request, loss))

    def _finished(self, request: EvalRequest, loss: float | None) -> None:
        """On the owner thread: record the point, then publish (merge what others published first)."""
        assert self.evaluator is not None and self.driver is not None
        if self.evaluator.finish(request, loss) is None:
            return
        driver, evaluator = self.driver, self.evaluator

        def read_then_store() -> None:  # I/O thread
            try:
                self._read(store)
            except Exception as exc:  # noqa: BLE001 - publish what we have
                log.info("eval history read failed: %r", exc)
                driver.post_call(lambda: store(None))

        def store(read: HistoryRead | None) -> None:  # owner thread; the store on the I/O thread
            if read is not None:
                evaluator.absorb(read)
            value, expiration = evaluator.record(), self.clock.now() + HISTORY_TTL
            driver.run_io(lambda: driver.kv.store(evaluator.key, self.peer_id, value, expiration), None)

        driver.run_io(read_then_store, None)

    def progress(self, view: TrainingView) -> None:
        """The peer's own numbers to the sinks (owner thread); merged tokens are this peer's in its ledger."""
        if not self.sinks:
            return
        mine = self.ledger.totals.get(self.peer_id) if self.ledger is not None else None
        merged = mine.tokens if mine is not None else 0
        values = {"peer/tokens_per_s": view.tokens_per_s, "peer/merged_tokens": float(merged)}
        if view.loss == view.loss:
            values["peer/loss"] = view.loss
        self.sinks.log(values, step=view.step, wall_time=self.clock.now())

    def close(self) -> None:
        self.sinks.close()
