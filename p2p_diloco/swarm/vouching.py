"""Which fragment states this peer may trust without having computed them, and which tips may tell it where
to look: the one place where heartbeats' branch tips become evidence (docs/security.md, "Where trust
comes from").

A heartbeat's branch tips are self-reports, and a snapshot is whatever its server chose to send, so
neither may move a replica by itself (a forged tip once pulled every honest replica onto random weights;
two fresh keys reporting the same forged tip once did it again). Trust flows from the run authority:
authority -> peers that may synchronize (`RunManifest.may_synchronize`: listed synchronizers, the
allowlist; everyone in an open run) -> their leases -> update records -> fragment states.

- `Vouchers` remembers, per fragment, the (version, checksum, term) of every update record this peer
  checked (signature of its leader, and the leader's lease; `Peer` and `Repair` check, then call `vouch`).
  Under union rounds (sparse codecs) a leader whose record this replica merged itself, from that record's
  base version, to another result than the record claims is `caught` (issue #41): its records vouch for
  nothing any more, and the states they vouched for are dropped, so neither a refetch, a reconciliation
  nor a catch-up can install the state it claimed (a forged merge) on its word alone.
- `reported_tips`: other live peers' tips with every term capped at the highest term a valid lease has
  shown (`Membership.term_seen`): a claimed term never counts above it.
- `credible_tips`: tips a checked record vouches for or that a peer that may synchronize reports: these
  may name a repair's target; tips of any other key never do.
- `Vouchers.trusted_tips`: states vouched for, or reported alike by two peers that may synchronize:
  these may be installed or reconciled toward. A thousand unlisted keys saying the same weigh nothing.

Memory is bounded: the newest `MAX_VOUCHED` states per fragment. `trusted_ahead` tells on which fragments
trusted tips are ahead of this replica (election and the holder's catch-up before merging).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from p2p_diloco.protocol import reconcile
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.wire.records import HeartbeatInfo

MAX_VOUCHED = 64
MIN_INDEPENDENT_PEERS = 2


class Vouchers:
    def __init__(self, num_fragments: int):
        # fragment -> version -> (checksum, term, leader) of the checked record that produced that state
        self._states: list[dict[int, tuple[str, int, str]]] = [{} for _ in range(num_fragments)]
        self.generation = 0  # changes with every vouch (what was trusted may differ)
        self.caught: set[str] = set()  # leaders whose union record merged here to another result

    def vouch(self, record: UpdateRecord) -> bool:
        """`record`'s signature and lease were checked: the state it leads to is vouched for, unless its
        leader was caught forging a merge (then nothing is vouched and the answer is False)."""
        if record.leader in self.caught:
            return False
        self.generation += 1
        states = self._states[record.fragment]
        states[record.to_version] = (record.checksum, record.term, record.leader)
        for version in sorted(states)[:-MAX_VOUCHED]:
            del states[version]
        return True

    def catch(self, leader: str) -> None:
        """`leader` published a union record whose listed deltas merge, on this replica's state at the
        record's base version, to another result than it claims: it vouches for nothing from now on, and
        what its records vouched for is forgotten."""
        self.caught.add(leader)
        self.generation += 1
        for states in self._states:
            for version in [v for v, (_, _, who) in states.items() if who == leader]:
                del states[version]

    def term_of(self, fragment: int, version: int, checksum: str) -> int | None:
        """The term of the checked record that produced this state, or None if none did."""
        found = self._states[fragment].get(version)
        return found[1] if found is not None and found[0] == checksum else None

    def newest(self, fragment: int) -> int:
        return max(self._states[fragment], default=0)

    def vouched(self, fragment: int, tip: BranchTip) -> bool:
        return self.term_of(fragment, tip.version, tip.checksum) is not None

    def trusted_tips(
        self, fragment: int, tips: Mapping[str, BranchTip], may_witness: Witness
    ) -> dict[str, BranchTip]:
        """The peers' tips of `fragment` that are vouched for, or reported alike by `MIN_INDEPENDENT_PEERS`
        peers that may witness (may synchronize); what other keys report never counts."""
        witnessed = Counter(tip.state for who, tip in tips.items() if may_witness(who))
        return {
            peer: tip
            for peer, tip in tips.items()
            if self.vouched(fragment, tip) or witnessed[tip.state] >= MIN_INDEPENDENT_PEERS
        }

    def credible_tips(
        self, fragment: int, tips: Mapping[str, BranchTip], may_witness: Witness
    ) -> dict[str, BranchTip]:
        """The tips that may name a repair's target: vouched for, or reported by a peer that may witness."""
        return {peer: tip for peer, tip in tips.items() if may_witness(peer) or self.vouched(fragment, tip)}


Witness = Callable[[str], bool]  # whether a peer's reports may count as evidence (it may synchronize)


def reported_tips(
    live_peers: Mapping[str, HeartbeatInfo], me: str, term_ceilings: Sequence[int]
) -> list[dict[str, BranchTip]]:
    """Per fragment p, other live peers' tips of p, each term capped at `term_ceilings[p]` (the highest term
    a valid lease has shown this peer): a heartbeat's claimed term never counts above what a lease backs.
    One pass over the peers for every fragment (it runs every read: issue #40)."""
    reported: list[dict[str, BranchTip]] = [{} for _ in term_ceilings]
    for peer, info in live_peers.items():
        tips = info.branch_tips
        if peer == me or not tips:
            continue
        for found, tip, ceiling in zip(reported, tips, term_ceilings, strict=False):
            found[peer] = tip if tip.term <= ceiling else BranchTip(ceiling, tip.version, tip.checksum)
    return reported


def sources_on(state: BranchTip, tips: Mapping[str, BranchTip], may_witness: Witness) -> list[str]:
    """Peers reporting `state` (where to look: what they send is checked), those that may witness first."""
    on = [peer for peer, tip in tips.items() if tip.same_state(state)]
    return sorted(on, key=lambda peer: (not may_witness(peer), peer))


@dataclass(frozen=True)
class Ahead:
    """A fragment on which a trusted tip of a live peer is ahead of this replica: the winning tip among
    the trusted ones, and the peers on it (sources to catch up from)."""

    winner: BranchTip
    sources: tuple[str, ...]


def trusted_ahead(
    vouchers: Vouchers,
    mine: Sequence[BranchTip],
    reported: Sequence[Mapping[str, BranchTip]],
    may_witness: Witness,
) -> dict[int, Ahead]:
    """Fragments whose trusted winning tip among `reported[p]` (other live peers' tips) is ahead of `mine[p]`
    on a history my state may lie on (`reconcile.classify` says catch up).

    A synchronizer must publish from the newest global state: an update built on an older version starts
    a branch of a higher term that every replica further ahead refuses (it carries fewer updates,
    `protocol.reconcile`), so the round's deltas are lost, and that could still win later over versions
    only dead peers held. So a peer counts these versions when it judges whether it is up to date enough
    to claim, and a holder catches such a fragment up before it merges a round of it.
    """
    ahead = {}
    for p, (tip, tips) in enumerate(zip(mine, reported, strict=True)):
        if reconcile.outranked_by_none(tip, tips.values()):  # nothing to catch up to
            continue
        theirs = vouchers.trusted_tips(p, tips, may_witness)
        if not theirs:
            continue
        winner = reconcile.winning_tip(theirs.values())
        if reconcile.action_of(tip, winner) == reconcile.CATCH_UP:
            ahead[p] = Ahead(winner, tuple(sources_on(winner, tips, may_witness)))
    return ahead
