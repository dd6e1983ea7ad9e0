"""The owner thread's reports of a `PeerNode`: heartbeat status fields, progress lines and events,
`NodeSnapshot`s, and the count of failed jobs.

`Upkeep` owns the node's reporting state: `Telemetry` (when this peer's work last reached the global
model), `GoodputCounters`, `tick_errors` and the last `NodeSnapshot`. All of it belongs to the peer's
owner thread (checked, `p2p_diloco.owner`), where every method here runs: the swarm tick, the progress
job, metrics scrapes (through `ThreadedDriver.call`) and the errors the driver reports (its I/O thread
posts them here). What it reads of the other threads is immutable: the training thread's `TrainingView`
and the transport's `TransportCounts`. The metrics thread reads `last_snapshot`, a frozen value
replaced whole, when the owner thread is too busy to answer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from p2p_diloco.net.traffic import TransportCounts
from p2p_diloco.node.events import GoodputCounters, own_threads
from p2p_diloco.node.guard import HandlerSlot
from p2p_diloco.node.ledger import ContributionLedger
from p2p_diloco.node.observing import Observing
from p2p_diloco.node.reporting import NodeSnapshot, ProgressDisplay, Telemetry
from p2p_diloco.node.threads import DeltaAccepts
from p2p_diloco.node.training import TrainingView
from p2p_diloco.owner import Owner
from p2p_diloco.swarm.peer import Peer


class Upkeep:
    """The reports of one node (module docstring): `bind` its parts once they exist, then the jobs."""

    def __init__(self, owner: Owner, event: Callable[..., None], display: ProgressDisplay):
        self.owner, self.event, self.display = owner, event, display
        self.telemetry = Telemetry(owner)
        self.counters = GoodputCounters(owner)
        self.tick_errors: Counter[str] = Counter()
        self.last_snapshot: NodeSnapshot | None = None
        self.peer: Peer | None = None
        self.view: Callable[[], TrainingView | None] = lambda: None
        self.counts: Callable[[], TransportCounts | None] = lambda: None
        self.guard: HandlerSlot | None = None
        self.accepts: DeltaAccepts | None = None
        self.ledger: ContributionLedger | None = None
        self.observing: Observing | None = None

    def bind(
        self,
        peer: Peer,
        *,
        view: Callable[[], TrainingView | None],
        counts: Callable[[], TransportCounts | None],
        guard: HandlerSlot,
        accepts: DeltaAccepts,
        ledger: ContributionLedger | None,
        observing: Observing | None,
    ) -> None:
        self.peer, self.view, self.counts, self.guard = peer, view, counts, guard
        self.accepts, self.ledger, self.observing = accepts, ledger, observing

    def heartbeat_fields(self, now: float, addresses: tuple[str, ...], ranks: int | None) -> dict[str, Any]:
        """The status fields of this peer's next heartbeat (`Peer.heartbeat`)."""
        assert self.peer is not None
        view = self.view() or TrainingView(training=False)
        fields = self.telemetry.heartbeat_fields(now, self.peer, view, self.guard, self.counts())
        fields["addresses"] = addresses[:16]
        fields["step"] = view.step
        fields["loss"] = view.loss if view.loss == view.loss else 0.0
        if ranks is not None:
            fields["ranks"] = ranks
        return fields

    def on_error(self, what: str, exc: BaseException) -> None:
        """A failed owner job or DHT call."""
        self.owner.check("tick_errors")
        self.tick_errors[type(exc).__name__] += 1
        self.event("tick_error", error=f"{what}: {type(exc).__name__}: {exc}")

    def progress(self) -> None:
        """The progress line (or live panel), the `progress` event and the sinks' numbers."""
        peer, view, counts = self.peer, self.view() or TrainingView(training=False), self.counts()
        assert peer is not None
        line = self.telemetry.progress_line(peer, view, self.guard, counts)
        snapshot = self.take_snapshot()
        fields = {
            **snapshot.event_fields(),
            "relay": peer.relay.stats.as_dict(),  # updates pushed, relayed, offered; hops (swarm.relay)
            **self.counters.fields(view, peer, counts),
        }  # the demo's counters win a name clash
        versions = list(peer.replica.versions())
        self.event(
            "progress", step=view.step, loss=view.loss, versions=versions, threads=own_threads(), **fields
        )
        self.display.show(snapshot, line)
        if self.observing is not None:  # to the --log-to sinks
            self.observing.progress(view)

    def take_snapshot(self) -> NodeSnapshot:
        assert self.peer is not None
        self.owner.check("the last snapshot")
        self.last_snapshot = self.telemetry.snapshot(
            self.peer,
            self.view(),
            self.guard,
            self.counts(),
            accepts=self.accepts,
            ledger=self.ledger.totals if self.ledger is not None else None,
            tick_errors=self.tick_errors,
            eval_loss=self.eval_loss(),
        )
        return self.last_snapshot

    def eval_loss(self) -> float:
        """The newest point of the eval history this peer holds (it evaluated, or read it to log)."""
        evaluator = self.observing.evaluator if self.observing is not None else None
        return evaluator.history[-1].loss if evaluator is not None and evaluator.history else math.nan
