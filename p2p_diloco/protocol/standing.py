"""Each learner's standing as this peer has seen it in applied updates: how many rounds it contributed to
(a new key's merge weight ramps up over its first rounds) and when it last did (only learners merged
recently count as live, so idle heartbeats of made-up keys change neither the outer scaling nor whom a
round waits for), and per fragment, so that a sparse round's gather set lists the longest-waiting first
(`protocol.gather`).

Every peer keeps one, fed by every update it applies (`UpdateBook`), so whichever peer holds the lease
next already knows the swarm's learners. Time is passed in; memory is bounded by the peers that
contributed within `forget_after` seconds.

**Weight is earned** (`earned`, issue #41): the one rule every merge, dense or union, applies to the
weights the counter checks left (`RobustGuard.check_counters`: tokens per step as the manifest says, steps
at most H). A key is *established* once `new_peer_rounds` applied updates merged its deltas; an established
key's weight is its claim, untouched. A key still on its ramp (a new key, or one of fewer merged rounds)
weighs

    ramp x min(claim, M),   ramp = (rounds merged + 1) / (new_peer_rounds + 1)

where M is the round's median claim of its established contributors (of all its contributors when none is
established): whatever it claims, a key without history never weighs more than the round's median established
learner, and less while its ramp is below 1. Keys are free, so the keys on their ramp in a round weigh
together at most `newcomer_share` x M (scaled down alike when they would weigh more): a thousand fresh keys
weigh what one median learner does. Weights are relative within a round, so the rule also bounds what a round
*counts*: each contribution counts weight / claim (1 for an established key, at most its ramp for a new one)
towards the contributors the outer scaling divides by the live learners (`Earned.counted`), so a round of
fresh keys alone moves the model as much as one established learner at most (`newcomer_share`), not as much as
a full round. Until some key has `new_peer_rounds` merged rounds (the first rounds of a run, as this peer saw
them) nobody has history: every claim counts as it is, and every key merged then is a *founder*, established
from the start (the learners that start a run are not newcomers). A key's standing grows only with merges of
its deltas in applied, signed update records, one per round, so it takes `new_peer_rounds` merged rounds to
reach full weight whatever its claims. The loss score of issue #41 item 2 caps the weights it returns further
(`protocol.loss_score.capped`: weight = min(earned weight, score cap x claim)).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SAME_ANSWER_MARGIN = 1e-3  # seconds: `active_until`'s answer is kept this far short of a window's rounded end


def lower_median(values: Sequence[float]) -> float:
    """The ceil(n/2)-th smallest of `values` (of an even count, the smaller middle one)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True)
class Earned:
    """A round's merge weights in merge order, and how many contributors it counts for the outer scaling:
    the sum of weight / claim (`counted_of`)."""

    weights: tuple[float, ...]
    counted: float


def counted_of(weights: Sequence[float], claims: Sequence[float]) -> float:
    """How many contributors a round counts: the sum of weight / claim, each at most 1 (every replica of a
    union round computes it from the listed weights and the signed claims)."""
    return sum(min(1.0, w / c) if c > 0 else 0.0 for w, c in zip(weights, claims, strict=True))


class Standing:
    def __init__(
        self,
        *,
        new_peer_rounds: int,
        active_window: float,
        newcomer_grace: float,
        newcomer_share: float = 1.0,
    ):
        self.new_peer_rounds = new_peer_rounds
        self.newcomer_share = newcomer_share
        self.active_window = active_window
        self.newcomer_grace = newcomer_grace
        self.forget_after = 10 * max(active_window, newcomer_grace)
        self.rounds: Counter[str] = Counter()  # peer -> applied updates that merged its deltas
        self.founders: set[str] = set()  # merged before any key had history (`has_history`)
        self.last_merged: dict[str, float] = {}
        self.first_heard: dict[str, float] = {}
        # fragment -> peer -> when an applied update of it last merged the peer's delta (a table per
        # fragment: no key built per contributor of every update, issue #40)
        self.fragment_merged: defaultdict[int, dict[str, float]] = defaultdict(dict)
        self._forgot_at = float("-inf")  # when the tables were last swept (`_forget`)
        # bumped whenever what `active` reads changes: an answer of `active_until` holds until then
        self.version = 0

    def note_merged(self, contributors: Iterable[str], now: float, fragment: int | None = None) -> None:
        contributors = list(contributors)
        self.version += 1
        if not self.has_history():  # merged before any key had history: the run's founders
            self.founders.update(contributors)
        # in C, not a Python step per contributor: every peer books every update's (issue #40)
        self.rounds.update(contributors)
        self.last_merged.update(dict.fromkeys(contributors, now))
        if fragment is not None:
            self.fragment_merged[fragment].update(dict.fromkeys(contributors, now))
        self._forget(now)

    def heard(self, peers: Iterable[str], now: float) -> None:
        """Peers whose heartbeats were read at `now` (their first one starts their newcomer grace)."""
        first_heard = self.first_heard
        known = len(first_heard)
        for peer in peers:
            first_heard.setdefault(peer, now)
        if len(first_heard) != known:
            self.version += 1

    def ramp(self, peer: str) -> float:
        """The factor on `peer`'s merge weight: (rounds merged + 1) / (new_peer_rounds + 1), at most 1."""
        if self.new_peer_rounds <= 0 or peer in self.founders:
            return 1.0
        return min(1.0, (self.rounds.get(peer, 0) + 1) / (self.new_peer_rounds + 1))

    def established(self, peer: str) -> bool:
        """Whether `peer` has its full weight: `new_peer_rounds` applied updates merged its deltas, or it is a
        founder (merged before any key had history)."""
        return peer in self.founders or self.rounds.get(peer, 0) >= self.new_peer_rounds

    def has_history(self) -> bool:
        """Whether some key has `new_peer_rounds` merged rounds (before that nobody has history: claims count
        as they are, and every key merged then is a founder, with full weight from the start)."""
        return self.new_peer_rounds <= 0 or any(n >= self.new_peer_rounds for n in self.rounds.values())

    def earned(self, claims: Sequence[tuple[str, float]]) -> Earned:
        """The merge weights of one round's contributions, `claims` (sender, weight as the counter checks
        left it) in merge order, and the contributors the round counts: established senders' claims
        untouched, the others' ramped, capped at the round's median claim M and together at most
        `newcomer_share` x M (the module docstring)."""
        values = [float(w) for _, w in claims]
        if not self.has_history() or all(self.established(peer) for peer, _ in claims):
            return Earned(tuple(values), float(len(values)))
        new = [not self.established(peer) for peer, _ in claims]
        settled = [w for w, n in zip(values, new) if not n]
        median = lower_median(settled or values)
        weights = [
            self.ramp(peer) * min(w, median) if n else w for (peer, _), w, n in zip(claims, values, new)
        ]
        newcomers = sum(w for w, n in zip(weights, new) if n)
        budget = self.newcomer_share * median
        if newcomers > budget:
            scale = budget / newcomers
            weights = [w * scale if n else w for w, n in zip(weights, new)]
        return Earned(tuple(weights), counted_of(weights, values))

    def waiting_since(self, peer: str, fragment: int, now: float) -> float:
        """Since when `peer` has waited for a merge of `fragment` as this peer saw it: the last applied update
        of `fragment` that merged its delta, else when it was first heard of, else `now` (the order of a
        sparse round's gather set, `protocol.gather`)."""
        merged = self.fragment_merged.get(fragment)
        found = merged.get(peer) if merged is not None else None
        return found if found is not None else self.first_heard.get(peer, now)

    def active(self, learners: Iterable[str], now: float) -> frozenset[str]:
        """The live `learners` that count: merged within `active_window`, or heard first within
        `newcomer_grace` (a new learner is awaited while its first deltas are on their way); a learner
        never heard (an unlisted key before its first accepted delta) does not count."""
        return self.active_until(learners, now)[0]

    def active_until(self, learners: Iterable[str], now: float) -> tuple[frozenset[str], float]:
        """`active`, and a time before which it gives the same answer for these `learners` while `version`
        stays: a little (`SAME_ANSWER_MARGIN`) before the earliest moment a counted learner's windows both
        close (one left out stays out as time passes). A holder asks after every event it handles
        (`Membership.live_learners`), so it keeps the answer."""
        never = float("-inf")
        last_merged, first_heard = self.last_merged, self.first_heard
        window, grace = self.active_window, self.newcomer_grace
        active, closes = [], float("inf")
        for peer in learners:
            merged, heard = last_merged.get(peer, never), first_heard.get(peer, never)
            if now - merged <= window or now - heard <= grace:
                active.append(peer)
                closes = min(closes, max(merged + window, heard + grace))
        return frozenset(active), closes - SAME_ANSWER_MARGIN

    def _forget(self, now: float) -> None:
        """Drop what is older than `forget_after`; the sweep runs at most once per tenth of it (every peer
        applies every update, and a sweep per update passed over M x P entries: issue #40), so a peer's
        history may outlive `forget_after` by up to a tenth of it; the active and newcomer windows, far
        shorter, answer the same."""
        if now - self._forgot_at < self.forget_after / 10:
            return
        self._forgot_at = now
        self.version += 1
        horizon = now - self.forget_after
        for table in (self.last_merged, self.first_heard):
            for peer in [p for p, t in table.items() if t < horizon]:
                del table[peer]
        for peer in [p for p in self.rounds if p not in self.last_merged]:
            del self.rounds[peer]
            self.founders.discard(peer)
        for merged in self.fragment_merged.values():
            for peer in [p for p, t in merged.items() if t < horizon]:
                del merged[peer]
