"""The checks a claim of `protocol.election.decide` passes before a peer makes it (issue 29): the read it
was decided on is complete, and the claimant is itself up to date.

A complete read. hivemind's DHT returns what the nodes it reached hold, so a read can come back partial (a
starved process whose RPCs time out, a slow or frozen node), and a peer that claims on a partial read may
claim a term that a peer it did not see claims too. But a record, once read, stays stored until its DHT
expiration (a later write to its subkey only replaces it with a later expiration; nothing deletes it): a
read that lacks a record this peer read before, while that record must still be stored, is provably
partial. `covered` finds such *gaps*, and a plain claim made on a read with gaps waits (`gate`,
`ElectionTag.INCOMPLETE_READ`) until a read returns the record again or its expiration passes. The wait
is bounded: a record counts only until its DHT expiration, capped at what an honest write sets
(`record_life`: a heartbeat lives `heartbeat_ttl`, a lease `lease_ttl` past an expiry that is itself at
most `lease_ttl` + `lease_margin` after its write), so a forged far-future expiration cannot hold claims
back longer, and a peer that is really alone still claims once the records of the departed lapse. A
complete read never waits: a dead holder's heartbeat and lease are returned by complete reads until they
expire, so a failover claims as fast as before. Clocks may disagree by `lease_margin`, so a record counts
until its expiration less that margin. A read that holds nothing but this peer's own records, while it read
another peer's within `alone_after` (twice a lease record's life), is a gap too: a peer starved longer
than a record's life cannot tell its reads from being alone, and being alone is rare enough to wait for.

A confirmed claim. A claim is confirmed (`protocol.election`, "confirmation") only on a read without gaps
(`hold_confirmation`): a partial read may lack another claim of the same term.

An up-to-date claimant. Claim windows are ranked with slack (when `decide` with `max_lag` 0 returns one of
`WINDOW_TAGS`, the caller decides again with `max_lag` = what this replica gained during a heartbeat TTL;
every other decision, succession included, stays strict): a peer reads the others' heartbeats up to a
TTL old but knows its own replica now, and ranking only the strictly up-to-date let each of several
peers rank itself "1 of 1" while the swarm published (8 unpaced peers on 2 cores: up to 6 claims of one
term). With slack every peer ranks the same candidates; `hold_lagging_claim` then lets a claimant use
its window only if it is strictly up to date (otherwise the window passes and the next one opens
`claim_grace` later).

Pure: the caller keeps the `ReadCover` between reads and passes the time in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from p2p_diloco.protocol.candidates import PeerHeartbeat, eligible_candidates, why_not_eligible
from p2p_diloco.protocol.election import CLAIM, WAIT, ElectionDecision, ElectionTag
from p2p_diloco.protocol.timing import SwarmTiming

WINDOW_TAGS = frozenset({ElectionTag.CLAIM, ElectionTag.CLAIM_GRACE, ElectionTag.NOT_ELIGIBLE})


class RecordKind(StrEnum):
    HEARTBEAT = "heartbeat"
    LEASE = "lease"


@dataclass(frozen=True, order=True)
class RecordSlot:
    """One record's place in the DHT: its kind (key) and its subkey (the peer that wrote it)."""

    kind: RecordKind
    peer: str

    def __str__(self) -> str:
        return f"the {self.kind} of {self.peer}"


@dataclass(frozen=True)
class ReadGaps:
    """What a read lacked: each missing slot, with the time the record last read there stays stored until;
    `others_seen`: set when the read held only this peer's own records, the last time one held another's
    (the wait lasts until `alone_after` past it)."""

    missing: Mapping[RecordSlot, float]
    others_seen: float | None = None
    alone_after: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.missing) or self.others_seen is not None

    def until(self) -> float:
        alone = float("-inf") if self.others_seen is None else self.others_seen + self.alone_after
        return max([alone, *self.missing.values()])

    def __str__(self) -> str:
        names = [str(slot) for slot in sorted(self.missing)]
        text = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        lacks = f"lacks {text}, stored until {max(self.missing.values()):.2f} at least" if names else ""
        alone = ""
        if self.others_seen is not None:
            alone = f"holds only my own records; another peer's were read at {self.others_seen:.2f}"
        return "; ".join(x for x in (lacks, alone) if x) + f" (waiting until {self.until():.2f} at most)"


NO_GAPS = ReadGaps({})


@dataclass(frozen=True)
class ReadCover:
    """What `covered` keeps between reads: the records read, each with the time it stays stored until,
    and when a read last returned a record of another peer."""

    expected: Mapping[RecordSlot, float] = field(default_factory=dict)
    others_seen: float = float("-inf")


def record_life(kind: RecordKind, timing: SwarmTiming) -> float:
    """How long after it is read an honest record of `kind` can stay stored, at most."""
    if kind == RecordKind.HEARTBEAT:
        return timing.heartbeat_ttl + timing.lease_margin
    return 2 * timing.lease_ttl + 2 * timing.lease_margin


def read_of(heartbeats: Iterable[PeerHeartbeat], leases: Mapping[str, float]) -> dict[RecordSlot, float]:
    """A read as `covered` takes it: the heartbeats the election reads (each with its DHT expiration) and
    the lease records of synchronizers (holder -> the record's DHT expiration)."""
    read = {RecordSlot(RecordKind.HEARTBEAT, hb.peer_id): hb.expires_at for hb in heartbeats}
    return read | {RecordSlot(RecordKind.LEASE, holder): until for holder, until in leases.items()}


def alone_after(timing: SwarmTiming) -> float:
    """How long after it last read another peer's record a peer whose reads hold only its own waits."""
    return 2 * record_life(RecordKind.LEASE, timing)


def covered(
    cover: ReadCover, read: Mapping[RecordSlot, float], self_id: str, now: float, timing: SwarmTiming
) -> tuple[ReadCover, ReadGaps]:
    """Check a read (slot -> DHT expiration of the record it returned; `now`: the end of the read) against
    `cover` (what this returned for the earlier reads). Returns what to keep and the read's gaps: slots
    read before that it lacks whose record must still be stored, or, when it holds only `self_id`'s
    records, every other peer's slot of the last `alone_after` seconds."""
    margin = timing.lease_margin
    kept = {slot: until for slot, until in cover.expected.items() if until - margin > now}
    gaps = {slot: until for slot, until in kept.items() if slot not in read}
    others = any(slot.peer != self_id for slot in read)
    lonely = None if others or now >= cover.others_seen + alone_after(timing) else cover.others_seen
    for slot, expiration in read.items():
        until = min(expiration, now + record_life(slot.kind, timing))
        kept[slot] = max(until, kept.get(slot, until))
    return ReadCover(kept, now if others else cover.others_seen), ReadGaps(gaps, lonely, alone_after(timing))


Samples = tuple[tuple[float, int], ...]


def lags(
    samples: Samples, sample: tuple[float, int], timing: SwarmTiming, fragments: int
) -> tuple[Samples, tuple[int, int]]:
    """From (time, this replica's versions sum) samples of earlier elections and this one's: the samples to
    keep and two lags, each the versions gained over a window plus one per fragment: how far a peer in sync
    may seem behind in a heartbeat up to two periods old (a successor), or in any live heartbeat (a TTL:
    a claim window)."""
    now, total = sample
    windows = (2 * timing.heartbeat_period, timing.heartbeat_ttl)
    kept = [*samples, sample]
    while len(kept) > 1 and kept[1][0] <= now - max(windows):
        kept.pop(0)

    def gained(window: float) -> int:
        before = [versions for at, versions in kept if at <= now - window]
        return max(0, total - (before[-1] if before else kept[0][1])) + fragments

    return tuple(kept), (gained(windows[0]), gained(windows[1]))


def _waiting(decision: ElectionDecision, tag: ElectionTag, detail: str) -> ElectionDecision:
    return replace(decision, action=WAIT, tag=tag, detail=detail, holder=None, expires_at=None, successor="")


def hold_lagging_claim(
    decision: ElectionDecision,
    self_id: str,
    heartbeats: Sequence[PeerHeartbeat],
    now: float,
    verified_newest: int | None,
) -> ElectionDecision:
    """A claim by a peer that is not strictly up to date (`max_lag` 0) waits: its claim window passes."""
    if decision.action != CLAIM:
        return decision
    if any(hb.peer_id == self_id for hb in eligible_candidates(heartbeats, now, 0, verified_newest)):
        return decision
    why = why_not_eligible(self_id, heartbeats, now, 0, verified_newest)
    return _waiting(decision, ElectionTag.NOT_ELIGIBLE, f"{why}; my window for term {decision.term} passes")


def hold_confirmation(decision: ElectionDecision, gaps: ReadGaps) -> ElectionDecision:
    """A claim is confirmed only on a complete read: one that lacks a record still stored may lack another
    claim of the same term too, so the claim stays unconfirmed (`ElectionTag.UNCONFIRMED`) until a read
    without gaps shows it alone."""
    if decision.tag != ElectionTag.CONFIRMED or not gaps:
        return decision
    detail = f"a read shows my claim of term {decision.term}, but it {gaps}; merging nothing yet"
    return replace(decision, tag=ElectionTag.UNCONFIRMED, detail=detail)


@dataclass(frozen=True)
class ClaimChecks:
    """What a claim is checked against before a seat makes it (`gate`). Each field is None (or empty)
    when its guard has nothing to say; otherwise it says why the claim waits."""

    stopping: bool = False  # the peer is shutting down (`swarm.election.phase.Phase.STOPPING`)
    stepping_down: str | None = None  # this seat released its term; a read has not shown the end yet
    warm_up: str | None = None  # this peer has not read the swarm for a heartbeat TTL yet
    gaps: ReadGaps = NO_GAPS  # the read lacks a record still stored (`covered`)
    under_way: str | None = None  # a signed record shows the run under way; this replica is at 0


NO_CHECKS = ClaimChecks()


def gate(decision: ElectionDecision, checks: ClaimChecks) -> ElectionDecision:
    """Every guard on claiming, in order; the first that applies turns the claim into a wait with its
    tag. Only claims are gated: renewing, holding and following never wait here.

    1. stopping (`STOPPING`): a stopping peer never claims again.
    2. stepping down (`STEPPING_DOWN`): a holder that released its term claims nothing until a read shows
       that term over (its released record, or another holder).
    3. warm-up (`PARTIAL_READ`): not before reading the swarm for a heartbeat TTL (a succession claim is
       exact and never waits: the caller leaves `warm_up` None for it).
    4. an incomplete read (`INCOMPLETE_READ`): a plain claim waits while the read has gaps.
    5. a run under way (`UNDER_WAY`): a replica at version 0 never starts a run others have published.

    Two checks come earlier, in the ranking itself: a candidate holding its share of the other shards
    steps aside (`busy` in `swarm.election.membership.Membership.decide`), and a claim window is used only by
    a strictly up-to-date peer (`hold_lagging_claim`)."""
    if decision.action != CLAIM:
        return decision
    term = decision.term
    if checks.stopping:
        return _waiting(decision, ElectionTag.STOPPING, "stopping: never claims again")
    if checks.stepping_down is not None:
        return _waiting(
            decision, ElectionTag.STEPPING_DOWN, f"would claim term {term}; {checks.stepping_down}"
        )
    if checks.warm_up is not None:
        return _waiting(decision, ElectionTag.PARTIAL_READ, f"would claim term {term}; {checks.warm_up}")
    if checks.gaps and decision.tag == ElectionTag.CLAIM:
        detail = f"would claim term {term} ({decision.detail}); my read {checks.gaps}"
        return _waiting(decision, ElectionTag.INCOMPLETE_READ, detail)
    if checks.under_way is not None:
        return _waiting(decision, ElectionTag.UNDER_WAY, checks.under_way)
    return decision
