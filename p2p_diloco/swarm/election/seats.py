"""A peer's seats at the synchronizer shards: per shard, the membership that elects its holder, the role
that merges its fragments while this peer holds it, the handover check and the successor's watch.

With ``[diloco] synchronizer_shards = S`` (`protocol.shards`) every shard is elected on its own lease key
(`Membership` per shard) and merged by its own `SynchronizerRole`; the `Peer` runs each shard's election on
each read of the swarm, routes each delta to the seat of its fragment's shard and its learner's deltas to
each shard's holder (`Outbox.follow`). A holder's crash stalls only its shards. With S = 1 the one seat is
exactly the unsharded peer. `busy` keeps the shards spread: a candidate that already holds its share of
the other shards (ceil(S / candidates)) steps aside in a shard's claim ranking while others are up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from p2p_diloco.protocol import election, shards
from p2p_diloco.protocol.claim_guard import ClaimChecks
from p2p_diloco.protocol.election import ElectionDecision, ElectionTag
from p2p_diloco.protocol.timing import SwarmTiming
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election import phase
from p2p_diloco.swarm.election.handover import Handover
from p2p_diloco.swarm.election.membership import Membership, SwarmView
from p2p_diloco.swarm.election.phase import Phase, Stepped
from p2p_diloco.swarm.election.succession import HolderWatch
from p2p_diloco.swarm.synchronizer import Synchronizer, SynchronizerRole
from p2p_diloco.wire.frames import InboundDelta


@dataclass
class Seat:
    """One shard as this peer sees it (shard 0's parts are the ones the rest of the peer holds), with its
    explicit `Phase`. `elected`, `stop` and `read` are its transitions (`swarm.election.phase`); `wake_at` is
    when it next needs a sync tick."""

    shard: int
    fragments: frozenset[int]
    membership: Membership
    role: SynchronizerRole
    handover: Handover
    watch: HolderWatch
    emit: Callable[[fx.Intent], None]
    timing: SwarmTiming
    phase: Phase = Phase.FOLLOWING
    released: tuple[int, float] | None = None  # (term, when) this seat last released a term

    @property
    def sync(self) -> Synchronizer | None:
        """The `Synchronizer` of this shard's term this peer holds (None while it holds none)."""
        return self.role.sync

    def read(self, view: SwarmView, now: float) -> Stepped:
        """A read of the swarm, before its election: a seat stepping down is done once the read shows its
        released term over (its released record, or a higher term)."""
        before, released = self.phase, self.released
        over = released is not None and (
            self.membership.released(self.membership.peer_id, released[0])
            or any(lease.term > released[0] for lease in view.leases)
        )
        self.phase = phase.after_read(before, over, released and released[1], now, self.timing.lease_ttl)
        return Stepped(before, self.phase, "the read shows my released term over")

    def checks(self, under_way: str | None) -> ClaimChecks:
        """What this seat's claims are gated on (`protocol.claim_guard.gate`; the membership adds the
        warm-up and the read's gaps)."""
        stepping_down = None
        if self.phase == Phase.STEPPING_DOWN and self.released is not None:
            stepping_down = f"I released term {self.released[0]} and no read has shown it over yet"
        return ClaimChecks(self.phase == Phase.STOPPING, stepping_down, under_way=under_way)

    def elected(self, decision: ElectionDecision, now: float, may_claim: bool) -> Stepped:
        """Apply one election decision: take or renew the lease, step down (releasing an ended term), or
        follow. A stopping seat changes nothing."""
        before = self.phase
        self.phase = phase.after_decision(before, decision, may_claim)
        if before == Phase.STOPPING:
            return Stepped(before, self.phase, decision.reason)
        role, membership, sync = self.role, self.membership, self.role.sync
        if decision.action in (election.CLAIM, election.RENEW):
            self._take(decision, now)
        elif decision.action == election.STEP_DOWN:
            if membership.my_lease is not None and decision.tag == ElectionTag.TERM_ENDED:
                rounds = sync.rounds_done if sync else 0
                role.finish_open_rounds(now)
                self._release(now, rounds)
            elif decision.tag == ElectionTag.YIELDED:  # merged nothing: no round to finish
                self._release(now, 0)
            self._drop(None, 0)
        elif decision.action == election.FOLLOW:
            self._drop(decision.holder, decision.term)
        elif decision.action == election.HOLD and sync is not None:
            membership.follow(membership.peer_id, sync.term)
        else:
            membership.follow(None, 0)
        if decision.tag == ElectionTag.CONFIRMED and role.sync is not None:
            membership.confirmed = True  # a read showed its claim alone: its rounds merge from now on
        return Stepped(before, self.phase, decision.reason)

    def stop(self, now: float) -> bool:
        """The peer stops: a holder merges its open rounds that have a quorum and releases its lease; every
        seat then holds nothing and never claims again. Whether a lease was released."""
        released = False
        sync = self.role.sync
        if sync is not None and self.phase != Phase.STOPPING:
            self.role.finish_open_rounds(now)
            released = self._release(now, sync.rounds_done)
        self._drop(None, 0)
        self.phase = phase.after_stop(self.phase)
        return released

    def wake_at(self, now: float) -> float | None:
        """When this seat next needs a sync tick (a round's grace ends, a hold lifts); None while it holds
        nothing or waits only for events."""
        return self.role.wake_at(now) if self.phase == Phase.HOLDING else None

    def _take(self, decision: ElectionDecision, now: float) -> None:
        lease = decision.lease_to_write()
        assert lease is not None
        if decision.action == election.CLAIM or self.role.sync is None:
            self.role.take(lease.term)
            self.handover.begin(lease.term, now)
        if decision.action == election.CLAIM:
            self.membership.confirmed = False  # it merges once a read confirms the claim
            self.emit(fx.Claimed(lease.term, decision.reason, self.shard))
        self.emit(self.membership.lease_record(lease, "lease"))
        self.membership.my_lease = lease
        self.membership.follow(self.membership.peer_id, lease.term)

    def _drop(self, holder: str | None, term: int) -> None:
        """Hold nothing (the term's `Synchronizer` and lease forgotten) and follow `holder`'s `term`."""
        self.role.sync, self.membership.my_lease, self.membership.confirmed = None, None, False
        self.membership.follow(holder, term)

    def _release(self, now: float, rounds: int) -> bool:
        lease = self.membership.my_lease
        if lease is None:
            return False
        released = election.release_lease(lease, now, self.timing, rounds)
        self.emit(self.membership.lease_record(released, "released lease"))
        self.emit(fx.LeaseReleased(lease.term, rounds))
        self.released = (lease.term, now)
        return True


def busy(seats: Sequence[Seat], seat: Seat, view: SwarmView, now: float) -> frozenset[str]:
    """Candidates that hold their share of the shards other than `seat`'s (what this peer follows there,
    itself included), with the share from the candidates `view` shows live."""
    if len(seats) == 1:
        return frozenset()
    others = [other.membership.holder for other in seats if other is not seat]
    candidates = sum(1 for hb in view.heartbeats if hb.may_sync and hb.live(now))
    return shards.at_cap(shards.holdings(others), shards.holder_cap(len(seats), candidates))


def seat_of_delta(seats: Sequence[Seat], delta: InboundDelta) -> Seat:
    """The seat whose shard merges the fragment a delta names (shard 0's when S = 1, or when the frame does
    not decode or names no fragment: that seat refuses it as the unsharded peer always did)."""
    fragment = delta.fragment
    if len(seats) == 1 or fragment is None:
        return seats[0]
    return seats[shards.shard_of(fragment, len(seats))]


def accepted(seat: Seat) -> fx.DeltaAccepted:
    """What a delta this seat accepted counts under: its shard, and the term this peer holds there (the
    highest term seen of that shard while it holds none)."""
    sync = seat.sync
    return fx.DeltaAccepted(seat.shard, sync.term if sync is not None else seat.membership.term_seen)
