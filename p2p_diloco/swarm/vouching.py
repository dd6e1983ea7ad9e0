"""Which fragment states this peer may trust without having computed them: states vouched for by a signed,
validly leased update record, or reported alike by at least two other peers.

A heartbeat's branch tips are self-reports, and a snapshot is whatever its server chose to send, so
neither may move a replica by itself (a forged tip once pulled every honest replica onto random weights).
`Vouchers` remembers, per fragment, the (version, checksum, term) of every update record this peer
checked (signature of its leader, and the leader's lease; `Peer` and `Repair` check, then call `vouch`).
Anti-entropy only repairs toward a trusted tip, and a snapshot is installed only if its state is vouched.
Memory is bounded: the newest `MAX_VOUCHED` states per fragment.
"""

from __future__ import annotations

from collections.abc import Mapping

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
