"""Which lease records count: the rules every reader enforces before the election sees a lease.

A lease record is signed by its holder (the DHT's owner tag), so nobody can write a lease in another's
name, but a hostile peer can write any lease *for itself*: a huge term, an expiry an hour ahead, an
already-expired record for the current term to make its updates look leased. Every peer screens what it
reads with `screen_leases`, a pure function of the records, the time each was first seen by this peer,
and what this peer already trusts; a refused record is returned with its reason and never reaches the
election (`protocol.election`) or the update checks (`should_accept_update` fences updates by term). The
rules:

1. the holder may synchronize (`RunManifest.may_synchronize`: the allowlist and `[trust] synchronizers`);
2. its expiry is at most `lease_ttl` (+ `lease_margin` for clock skew) after it was first seen: every
   honest write sets ``expires_at = now + lease_ttl`` and is read within a heartbeat period;
3. its term is at most one above the highest term already backed by a valid lease (`term_floor`; a peer
   that has trusted no term yet trusts the highest live term in view on first use), so terms climb one at
   a time;
4. it was written in the claim window: not before the previous term's lease (its records this peer saw
   first) had passed its expiry or was released; other holders of the same term are a tie the election
   breaks. (A claimant whose reads missed the holder's renewals for a whole renewal interval is refused
   too; with a third peer reporting its term the exception below admits it, in a swarm of two the two
   terms stand apart until one lease lapses: a known limit of a machine too loaded to read the DHT.)

Succession. A holder names in every claim and renewal the peer ranked first for the next term
(`candidates.named_successor`); when its process is gone (connections refused, not merely silent) that
peer claims the next term at once instead of waiting out the lease. Rule 4 admits such a claim when the
previous term's newest record names its holder: the old holder chose it, every reader sees the choice,
and a frozen old holder that wakes up finds a higher term and is fenced out of it like any zombie.

Rules 3 and 4 have one exception: a term this peer missed (a term that began and ended between two of
its reads on a loaded machine) or a healed partition (the other side's terms ran ahead and were claimed
while this side's lease was live). Such a lease counts when a live peer other than its holder, itself
allowed to synchronize, reports its term in its heartbeat (`MIN_PEERS_FOR_JUMP`,
`MIN_PEERS_FOR_EARLY_CLAIM`): neither the holder's own heartbeat nor a stranger's suffices, and the
holder must still be a synchronizer of the run (rule 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.protocol.decisions import Action, Decision
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.timing import SwarmTiming


class LeaseTag(StrEnum):
    """Why a lease record was refused."""

    NOT_SYNCHRONIZER = "lease holder may not synchronize"
    TOO_LONG = "lease expiry too far ahead"
    TERM_JUMP = "lease term jump"
    EARLY_CLAIM = "lease claimed early"


# A term this peer missed (a short term under load, a healed partition) is vouched for by any live peer
# other than its holder that reports it: in a swarm of three, the holder and one other peer is all there
# is. A forger still needs a key that may synchronize (rule 1) and a second identity.
MIN_PEERS_FOR_JUMP = 1
MIN_PEERS_FOR_EARLY_CLAIM = 1


@dataclass(frozen=True)
class SeenLease:
    """A lease record and when this peer first read that exact record (its write is at or before it)."""

    lease: LeaseRecord
    first_seen: float


def write_time(lease: LeaseRecord, timing: SwarmTiming) -> float:
    """Every lease write sets `expires_at = now + lease_ttl` (`protocol.election`)."""
    return lease.expires_at - timing.lease_ttl


@dataclass(frozen=True)
class Screened:
    valid: list[SeenLease]
    refused: list[tuple[LeaseRecord, str, str]]  # (record, tag, detail)


def screen_leases(
    seen: Iterable[SeenLease],
    *,
    term_floor: int,
    timing: SwarmTiming,
    may_synchronize: Callable[[str], bool],
    terms_reported: Mapping[str, int] | None = None,
    history: Mapping[int, Sequence[SeenLease]] | Iterable[SeenLease] = (),
) -> Screened:
    """Split `seen` into the records that count and the refused ones (module docstring, rules 1-4).

    `terms_reported`: the terms live peers that may synchronize report (read only for a term jump or an
    early claim, so a caller may pass a mapping that is built when first read); `history`: records that
    counted in earlier reads, by term or as one sequence (a renewal replaces its predecessor in the DHT,
    but when the term lapsed as first seen is what rule 4 needs)."""
    by_term = history if isinstance(history, Mapping) else _by_term(history)
    reported = terms_reported if terms_reported is not None else {}
    refused: list[tuple[LeaseRecord, str, str]] = []
    candidates: list[SeenLease] = []
    for item in seen:
        problem = _holder_or_expiry_problem(item, timing, may_synchronize)
        if problem is None:
            candidates.append(item)
        else:
            refused.append((item.lease, *problem))
    floor = term_floor
    if floor == 0 and candidates:
        floor = _first_use_floor(candidates)
    valid: list[SeenLease] = []
    for item in sorted(candidates, key=lambda x: x.lease.term):
        lease = item.lease
        if lease.term > floor + 1 and not _reported_by_others(lease, reported, MIN_PEERS_FOR_JUMP):
            refused.append(
                (
                    lease,
                    LeaseTag.TERM_JUMP,
                    f"term {lease.term} skips terms above {floor} (at most one at a time)",
                )
            )
            continue
        counted = [*by_term.get(lease.term - 1, ()), *(v for v in valid if v.lease.term == lease.term - 1)]
        early = _early_claim(item, counted, timing, reported)
        if early is not None:
            refused.append((lease, LeaseTag.EARLY_CLAIM, early))
            continue
        valid.append(item)
        floor = max(floor, lease.term)
    return Screened(valid, refused)


def _by_term(records: Iterable[SeenLease]) -> dict[int, list[SeenLease]]:
    grouped: dict[int, list[SeenLease]] = {}
    for item in records:
        grouped.setdefault(item.lease.term, []).append(item)
    return grouped


def _holder_or_expiry_problem(
    item: SeenLease, timing: SwarmTiming, may_synchronize: Callable[[str], bool]
) -> tuple[str, str] | None:
    """Rules 1 and 2, which need no other record: (tag, detail) of the first broken, or None."""
    lease = item.lease
    if not may_synchronize(lease.holder):
        return LeaseTag.NOT_SYNCHRONIZER, f"{lease.holder} is not a synchronizer of this run"
    if lease.expires_at > item.first_seen + timing.lease_ttl + timing.lease_margin:
        ahead = lease.expires_at - item.first_seen
        detail = f"term {lease.term} expires {ahead:.1f}s after it was first seen, more than lease_ttl"
        return LeaseTag.TOO_LONG, f"{detail} {timing.lease_ttl}s"
    return None


def _first_use_floor(candidates: list[SeenLease]) -> int:
    """Trust on first use: a peer that has trusted no term yet starts below the highest term in view
    (the live ones if any). From then on terms must climb one at a time."""
    live = [x.lease.term for x in candidates if not x.lease.released and x.lease.live(x.first_seen)]
    return max(live or [x.lease.term for x in candidates]) - 1


def _early_claim(
    item: SeenLease, counted: list[SeenLease], timing: SwarmTiming, reported: Mapping[str, int]
) -> str | None:
    """Rule 4: why `item` was claimed before the previous term lapsed, or None if it was not (or may be:
    the previous holder named it, or enough other peers report its term). `counted`: records of the
    previous term that count."""
    lease = item.lease
    # Only records of the previous term seen before this one: a late renewal of the old term (a zombie
    # holder) must not turn its successor's valid claim into an early one.
    previous = [
        v.lease for v in counted if v.lease.term == lease.term - 1 and v.first_seen <= item.first_seen
    ]
    base = _claim_base(previous, timing)
    early = base is not None and write_time(lease, timing) < base - timing.lease_margin
    if early and named_next(previous, lease.holder):
        early = False  # succession: the holder named this claimant to take over if it dies
    if early and not _reported_by_others(lease, reported, MIN_PEERS_FOR_EARLY_CLAIM):
        written = f"term {lease.term} was written at {write_time(lease, timing):.2f}"
        return f"{written}, before term {lease.term - 1} lapsed at {base:.2f}"
    return None


def named_next(previous: list[LeaseRecord], claimant: str) -> bool:
    """Whether the previous term's newest record (the holder's latest renewal) names `claimant` as the
    successor who may claim the next term before the lease runs out (`candidates.named_successor`)."""
    if not previous:
        return False
    return max(previous, key=lambda x: x.expires_at).successor == claimant


def _reported_by_others(lease: LeaseRecord, terms_reported: Mapping[str, int], at_least: int) -> bool:
    """Whether `at_least` live peers other than the holder report having seen `lease.term`."""
    others = sum(term >= lease.term for peer, term in terms_reported.items() if peer != lease.holder)
    return others >= at_least


def _claim_base(previous: list[LeaseRecord], timing: SwarmTiming) -> float | None:
    """When the previous term lapsed as far as its visible records tell: when its last holder's lease did
    (each holder's last expiry, or its release). A claimant that yielded (`election.ElectionTag.YIELDED`)
    released its claim while the term's holder went on: that release ends nothing but the yield."""
    if not previous:
        return None
    ends = []
    for holder in {x.holder for x in previous}:
        mine = [x for x in previous if x.holder == holder]
        released = [write_time(x, timing) for x in mine if x.released]
        # a release ends the holder's lease, whatever the expiry of the renewals before it
        ends.append(min(released) if released else max(x.expires_at for x in mine))
    return max(ends)


def counts_as_held(item: SeenLease) -> bool:
    """Whether the lease vouches for updates of its term: it was live when this peer first saw it."""
    return item.first_seen < item.lease.expires_at  # a released one too: its expiry is after its release


class FencingTag(StrEnum):
    """Why `should_accept_update` accepted or ignored an update's term."""

    CURRENT_TERM = "current term"
    NEWER_TERM = "newer term"
    LOWER_TERM = "lower term"


ACCEPT, IGNORE = Action.ACCEPT, Action.IGNORE  # should_accept_update(): actions


def should_accept_update(update_term: int, highest_term_seen: int) -> Decision:
    """Fencing for replicas: ignore an update whose term is below the highest term this replica has seen.

    "accept" with "newer term" tells the caller to raise its highest term seen to `update_term`.
    """
    if update_term < highest_term_seen:
        return Decision(
            IGNORE, FencingTag.LOWER_TERM, f"update term {update_term} < highest seen {highest_term_seen}"
        )
    if update_term > highest_term_seen:
        return Decision(
            ACCEPT, FencingTag.NEWER_TERM, f"update term {update_term} > highest seen {highest_term_seen}"
        )
    return Decision(ACCEPT, FencingTag.CURRENT_TERM, f"term {update_term}")
