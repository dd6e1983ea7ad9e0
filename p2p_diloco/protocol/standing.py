"""Each learner's standing as this peer has seen it in applied updates: how many rounds it contributed to
(a new key's merge weight ramps up over its first rounds) and when it last did (only learners merged
recently count as live, so idle heartbeats of made-up keys change neither the outer scaling nor whom a
round waits for), and per fragment, so that a sparse round's gather set lists the longest-waiting first
(`protocol.gather`).

Every peer keeps one, fed by every update it applies (`UpdateBook`), so whichever peer holds the lease
next already knows the swarm's learners. Time is passed in; memory is bounded by the peers that
contributed within `forget_after` seconds.
"""

from __future__ import annotations

from collections.abc import Iterable


class Standing:
    def __init__(self, *, new_peer_rounds: int, active_window: float, newcomer_grace: float):
        self.new_peer_rounds = new_peer_rounds
        self.active_window = active_window
        self.newcomer_grace = newcomer_grace
        self.forget_after = 10 * max(active_window, newcomer_grace)
        self.rounds: dict[str, int] = {}
        self.last_merged: dict[str, float] = {}
        self.first_heard: dict[str, float] = {}
        self.fragment_merged: dict[tuple[str, int], float] = {}  # (peer, fragment) -> last merged there

    def note_merged(self, contributors: Iterable[str], now: float, fragment: int | None = None) -> None:
        for peer in contributors:
            self.rounds[peer] = self.rounds.get(peer, 0) + 1
            self.last_merged[peer] = now
            if fragment is not None:
                self.fragment_merged[(peer, fragment)] = now
        self._forget(now)

    def heard(self, peers: Iterable[str], now: float) -> None:
        """Peers whose heartbeats were read at `now` (their first one starts their newcomer grace)."""
        for peer in peers:
            self.first_heard.setdefault(peer, now)

    def ramp(self, peer: str) -> float:
        """The factor on `peer`'s merge weight: (rounds merged + 1) / (new_peer_rounds + 1), at most 1."""
        if self.new_peer_rounds <= 0:
            return 1.0
        return min(1.0, (self.rounds.get(peer, 0) + 1) / (self.new_peer_rounds + 1))

    def waiting_since(self, peer: str, fragment: int, now: float) -> float:
        """Since when `peer` has waited for a merge of `fragment` as this peer saw it: the last applied update
        of `fragment` that merged its delta, else when it was first heard of, else `now` (the order of a
        sparse round's gather set, `protocol.gather`)."""
        return self.fragment_merged.get((peer, fragment), self.first_heard.get(peer, now))

    def active(self, learners: Iterable[str], now: float) -> frozenset[str]:
        """The live `learners` that count: merged within `active_window`, or heard first within
        `newcomer_grace` (a new learner is awaited while its first deltas are on their way); a learner
        never heard (an unlisted key before its first accepted delta) does not count."""
        return frozenset(
            peer
            for peer in learners
            if now - self.last_merged.get(peer, float("-inf")) <= self.active_window
            or now - self.first_heard.get(peer, float("-inf")) <= self.newcomer_grace
        )

    def _forget(self, now: float) -> None:
        horizon = now - self.forget_after
        for table in (self.last_merged, self.first_heard):
            for peer in [p for p, t in table.items() if t < horizon]:
                del table[peer]
        for peer in [p for p in self.rounds if p not in self.last_merged]:
            del self.rounds[peer]
        for key in [k for k, t in self.fragment_merged.items() if t < horizon]:
            del self.fragment_merged[key]
