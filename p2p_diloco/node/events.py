"""What a real peer writes about itself: its peer's telemetry intents as `events.jsonl` lines and ledger
entries (`PeerEventLog`), the cumulative goodput counters of its progress events (`GoodputCounters`,
read by `p2p_diloco.demo.accounting`) and its replica on disk (`ReplicaSaver`). All three run on the
peer's owner thread (a save's write on the I/O thread, from a frozen copy)."""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import Callable

from p2p_diloco.net.traffic import TransportCounts
from p2p_diloco.node.ledger import ContributionLedger
from p2p_diloco.node.state import StateDir
from p2p_diloco.node.training import TrainingView
from p2p_diloco.owner import Owner
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.swarm.updates import UpdateSource
from p2p_diloco.wire.interfaces import Clock

log = logging.getLogger(__name__)


def update_fields(record: UpdateRecord) -> dict[str, object]:
    """What `published` and `applied` events say of an update (the demo's books read them)."""
    return {
        "fragment": record.fragment,
        "version": record.to_version,
        "term": record.term,
        "leader": record.leader,
    }


def own_threads() -> list[str]:
    """Names of this process's live Python threads (the `threads` field of progress events)."""
    return sorted(t.name for t in threading.enumerate())


class PeerEventLog:
    """The driver's observer (called on the owner thread): telemetry intents to the event log, the
    ledger and, with `verbose`, stderr."""

    def __init__(
        self, event: Callable[..., None], ledger: ContributionLedger | None, *, verbose: bool, clock: Clock
    ):
        self.event = event
        self.ledger = ledger
        self.verbose = verbose
        self.clock = clock

    def __call__(self, intent: fx.Intent) -> None:
        match intent:
            case fx.Note():
                self.event("note", line=intent.line)
                if self.verbose:
                    print(intent.line, file=sys.stderr, flush=True)
            case fx.Published():
                contributors = [peer_id for peer_id, _ in intent.record.contributors]
                self.event("published", **update_fields(intent.record), contributors=contributors)
            case fx.Applied():
                if intent.how in (UpdateSource.PUSHED, UpdateSource.RELAYED):
                    fields = update_fields(intent.record)
                    self.event("applied", **fields, source=intent.source, how=str(intent.how))
                elif intent.how == UpdateSource.REPLAYED:  # apart: `applied` times measure propagation
                    self.event("replayed", **update_fields(intent.record), source=intent.source)
                if self.ledger is not None:
                    self.ledger.record(intent.record, self.clock.now())
            case fx.Claimed():
                self.event("claim", term=intent.term, reason=intent.reason, shard=intent.shard)
            case fx.LeaseReleased():
                self.event("released_lease", term=intent.term, rounds=intent.rounds)


class GoodputCounters:
    """Cumulative goodput counters of this process lifetime, for progress events (owner thread)."""

    def __init__(self, owner: Owner | None = None):
        self.owner = owner or Owner("peer-owner")
        self._blocked = 0.0

    def fields(self, view: TrainingView, peer: Peer, counts: TransportCounts | None) -> dict[str, object]:
        self.owner.check("GoodputCounters")
        alive = time.monotonic() - view.loop_started if view.loop_started else 0.0
        if view.training:  # loop time not spent in inner steps, kept monotone (paced steps may count more)
            self._blocked = max(self._blocked, alive - view.compute_seconds)
        return {
            "tokens": view.tokens,
            "compute_seconds": view.compute_seconds,
            "compute_merged": view.compute_merged,
            "blocked_seconds": self._blocked,
            "bytes_sent": counts.bytes_sent if counts else 0,
            "bytes_received": counts.bytes_received if counts else 0,
            "role": "synchronizer" if peer.sync is not None else "learner",
            "term": peer.term_seen,
            "tokens_per_s": view.tokens_per_s,
        }


class ReplicaSaver:
    """Saves replica and peer state: this moment's replica, taken on the owner thread (sharing its
    tensors, `GlobalReplica.frozen`), written on the I/O thread; saves run one at a time, in order."""

    def __init__(self, state: StateDir, peer: Peer, driver, clock: Clock, last_in_sync: float, event):  # noqa: ANN001
        self.state, self.peer, self.driver, self.clock, self.event = state, peer, driver, clock, event
        self.last_in_sync = last_in_sync  # last save while connected to the swarm (I/O thread's, in `write`)

    def save(self) -> concurrent.futures.Future:
        now = self.clock.now()
        # in sync while the swarm still sees our last heartbeat as live
        connected = now - self.peer.membership.last_read < self.peer.manifest.timing.heartbeat_ttl
        replica = self.peer.replica.frozen()
        shard_terms = tuple(seat.membership.term_seen for seat in self.peer.seats)  # shard 0's first
        known = tuple(
            address
            for peer_id, info in sorted(self.peer.membership.live_peers.items())
            if peer_id != self.peer.peer_id
            for address in info.addresses[:2]
        )

        def write() -> None:
            try:
                self.state.save(
                    replica,
                    self.peer.peer_id,
                    now=now,
                    in_sync=connected,
                    previous=self.last_in_sync,
                    known_peers=known,
                    term_seen=shard_terms[0],
                    shard_terms=shard_terms,
                )
            except OSError as exc:
                self.event("persist_failed", error=str(exc))
                log.error("could not persist the replica: %s", exc)
                return
            if connected:
                self.last_in_sync = now

        return self.driver.io(write)
