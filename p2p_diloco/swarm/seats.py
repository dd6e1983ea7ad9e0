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

from collections.abc import Sequence
from dataclasses import dataclass

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import shards
from p2p_diloco.swarm.handover import Handover
from p2p_diloco.swarm.membership import Membership, SwarmView
from p2p_diloco.swarm.succession import HolderWatch
from p2p_diloco.swarm.synchronizer import Synchronizer, SynchronizerRole
from p2p_diloco.wire.frames import decode_delta_header


@dataclass
class Seat:
    """One shard as this peer sees it (shard 0's parts are the ones the rest of the peer holds)."""

    shard: int
    fragments: frozenset[int]
    membership: Membership
    role: SynchronizerRole
    handover: Handover
    watch: HolderWatch

    @property
    def sync(self) -> Synchronizer | None:
        """The `Synchronizer` of this shard's term this peer holds (None while it holds none)."""
        return self.role.sync


def busy(seats: Sequence[Seat], seat: Seat, view: SwarmView, now: float) -> frozenset[str]:
    """Candidates that hold their share of the shards other than `seat`'s (what this peer follows there,
    itself included), with the share from the candidates `view` shows live."""
    if len(seats) == 1:
        return frozenset()
    others = [other.membership.holder for other in seats if other is not seat]
    candidates = sum(1 for hb in view.heartbeats if hb.may_sync and hb.live(now))
    return shards.at_cap(shards.holdings(others), shards.holder_cap(len(seats), candidates))


def seat_of_delta(seats: Sequence[Seat], frame: bytes, max_bytes: int) -> Seat:
    """The seat whose shard merges the fragment a delta frame names (shard 0's when S = 1, or when the frame
    does not decode or names no fragment: that seat refuses it as the unsharded peer always did)."""
    if len(seats) == 1:
        return seats[0]
    try:
        header = decode_delta_header(frame, max_bytes=max_bytes)
    except DecodeError:
        return seats[0]
    fragment = header.fragment
    if not isinstance(fragment, int) or fragment < 0:
        return seats[0]
    return seats[shards.shard_of(fragment, len(seats))]


def accepting_term(seats: Sequence[Seat], frame: bytes, max_bytes: int) -> tuple[int, int]:
    """(shard, term) that an accepted delta `frame` counts under: its shard's, and the term this peer holds
    there (the highest term seen of that shard while it holds none)."""
    seat = seat_of_delta(seats, frame, max_bytes)
    sync = seat.sync
    return seat.shard, sync.term if sync is not None else seat.membership.term_seen
