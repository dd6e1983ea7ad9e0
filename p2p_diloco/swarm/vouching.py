"""Which fragment states this peer may trust without having computed them: states vouched for by a signed,
validly leased update record, or reported alike by at least two other peers.

A heartbeat's branch tips are self-reports, and a snapshot is whatever its server chose to send, so
neither may move a replica by itself (a forged tip once pulled every honest replica onto random weights).
`Vouchers` remembers, per fragment, the (version, checksum, term) of every update record this peer
checked (signature of its leader, and the leader's lease; `Peer` and `Repair` check, then call `vouch`).
Anti-entropy only repairs toward a trusted tip, and a snapshot is installed only if its state is vouched.
Memory is bounded: the newest `MAX_VOUCHED` states per fragment. `trusted_ahead` tells on which fragments
trusted tips of live peers are ahead of this replica (election and the holder's catch-up before merging).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from p2p_diloco.protocol import reconcile
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.reconcile import BranchTip

MAX_VOUCHED = 64
MIN_INDEPENDENT_PEERS = 2


class Vouchers:
    def __init__(self, num_fragments: int):
        self._states: list[dict[int, tuple[str, int]]] = [{} for _ in range(num_fragments)]

    def vouch(self, record: UpdateRecord) -> None:
        """`record`'s signature and lease were checked: the state it leads to is vouched for."""
        states = self._states[record.fragment]
        states[record.to_version] = (record.checksum, record.term)
        for version in sorted(states)[:-MAX_VOUCHED]:
            del states[version]

    def term_of(self, fragment: int, version: int, checksum: str) -> int | None:
        """The term of the checked record that produced this state, or None if none did."""
        found = self._states[fragment].get(version)
        return found[1] if found is not None and found[0] == checksum else None

    def newest(self, fragment: int) -> int:
        return max(self._states[fragment], default=0)

    def trusted_tips(self, fragment: int, tips: Mapping[str, BranchTip]) -> dict[str, BranchTip]:
        """The peers' tips of `fragment` that are vouched for, or reported alike by two peers or more."""
        trusted = {}
        for peer, tip in tips.items():
            alike = sum(other.same_state(tip) for other in tips.values())
            if (
                self.term_of(fragment, tip.version, tip.checksum) is not None
                or alike >= MIN_INDEPENDENT_PEERS
            ):
                trusted[peer] = tip
        return trusted


@dataclass(frozen=True)
class Ahead:
    """A fragment on which a trusted tip of a live peer is ahead of this replica: the winning tip among
    the trusted ones, and the peers on it (sources to catch up from)."""

    winner: BranchTip
    sources: tuple[str, ...]


def trusted_ahead(
    vouchers: Vouchers, mine: Sequence[BranchTip], reported: Sequence[Mapping[str, BranchTip]]
) -> dict[int, Ahead]:
    """Fragments whose trusted winning tip among `reported[p]` (other live peers' tips) is ahead of `mine[p]`
    on a history my state may lie on (`reconcile.classify` says catch up).

    A synchronizer must publish from the newest global state: an update built on an older version starts
    a branch of a higher term, which wins reconciliation and drops the newer versions every other replica
    holds. So a peer counts these versions when it judges whether it is up to date enough to claim, and a
    holder catches such a fragment up before it merges a round of it.
    """
    ahead = {}
    for p, (tip, tips) in enumerate(zip(mine, reported, strict=True)):
        theirs = vouchers.trusted_tips(p, tips)
        if not theirs:
            continue
        winner = reconcile.winning_tip(theirs.values())
        if reconcile.classify(tip, winner).action == reconcile.CATCH_UP:
            sources = tuple(sorted(peer for peer, t in theirs.items() if t.same_state(winner)))
            ahead[p] = Ahead(winner, sources)
    return ahead
