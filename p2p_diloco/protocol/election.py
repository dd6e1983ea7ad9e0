"""The synchronizer election: a deterministic rule every peer evaluates on the DHT records it reads.

hivemind's DHT has no compare-and-swap (per key/subkey the later expiration wins), so nobody "wins" a
write; instead every peer reads the same heartbeats (DHT key `wire.keys.heartbeat_key`,
``p2p_diloco/<run_id>/<manifest_hash>_heartbeat``, one subkey per peer) and leases (`wire.keys.lease_key`,
``..._lease``, one subkey per holder) and applies `decide`. Peers that read the same records reach the
same conclusion.

The rule, in short:
- the live lease (not expired, not released) with the highest term is the synchronizer; ties between live
  leases of one term go to the holder ranked first by `rendezvous_rank(LEASE_TIE_SALT, term, holders)`;
- T = the highest term of a valid visible lease or the caller's `term_floor` (the highest valid term this
  peer has seen, so a term survives its lease record disappearing from the DHT). Heartbeats never raise T:
  their `term_seen` is a self-report any peer can forge (`swarm.election.membership` screens leases, see
  `protocol.lease_rules`). A holder of a term below T steps down;
- with no live lease of term >= T, the up-to-date eligible peers are ranked for term T+1 by a rendezvous
  hash of (run, T+1, peer ID). From a base time, claim windows of `claim_grace` seconds go to the ranked
  candidates in turn (rank 0 first, then rank 1 if rank 0 never claimed, ..., wrapping around), so at any
  moment exactly one candidate may claim. The base is the last lease's expiry + `lease_margin` ("lease
  grace"), or its release time for a released lease (rotation: no margin, and the previous holder is left
  out of the ranking if anyone else is eligible). With no record of term T visible the windows are aligned
  on time 0;
- succession: every claim and renewal names a successor, the eligible peer (not the holder) ranked first
  for the next term (`candidates.named_successor`, eligible within `successor_lag` versions: heartbeats
  are up to a period old). A follower named so that sees the holder down (`down`: its addresses refused
  connections, see `swarm.election.succession`) and is itself up to date claims the next term at once
  (`ElectionTag.SUCCESSION`) instead of waiting for the lease to lapse; readers accept that claim
  (`protocol.lease_rules`);
- fencing: a holder stops merging once `now >= expires_at - lease_margin` (it steps down instead of renewing
  late), while claimants wait until `expires_at + lease_margin`. Clocks may disagree by up to
  `lease_margin` and the two sides still never overlap. Updates carry their term and replicas ignore
  updates of a term below the highest they have seen (`lease_rules.should_accept_update`);
- confirmation (issue #40): claim windows assume a lease write is readable within `claim_grace`; under load
  it may not be, and the next-ranked candidate then claims the same term. So a claimant merges and publishes
  nothing until a read shows its own claim and no other claim of its term (`ElectionTag.CONFIRMED`, the
  caller passes `confirmed` from then on); a read that shows another claim of its term first makes it yield
  (`ElectionTag.YIELDED`: release the lease, publish nothing). Of two claims of one term at most one is
  confirmed: each claimant's read comes after its own write landed, so the read of the claimant whose write
  landed last shows the other claim. Both may yield (each read shows the other); the next term then opens at
  once, since a yield releases the lease. A claim released with no round merged is no rival: it published
  nothing and never will.

Record conventions (the swarm layer writes these; `ElectionDecision.lease_to_write` and
`release_lease` build them):
- every lease write (claim, renewal, release) sets `expires_at = now + lease_ttl`, so a record's write time
  is `expires_at - lease_ttl`; for a released lease that is the release time;
- store a lease in the DHT with an expiration later than `expires_at` (e.g. `dht_expiration`), so followers
  still see the term and the lease grace after the lease lapses; later writes then also win at their subkey.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import partial

from p2p_diloco.protocol.candidates import (
    PeerHeartbeat,
    eligible_candidates,
    named_successor,
    rendezvous_rank,
    why_not_eligible,
)
from p2p_diloco.protocol.decisions import Action, Decision
from p2p_diloco.protocol.timing import SwarmTiming

FOLLOW, HOLD, RENEW, STEP_DOWN, CLAIM, WAIT = (
    Action.FOLLOW,
    Action.HOLD,
    Action.RENEW,
    Action.STEP_DOWN,
    Action.CLAIM,
    Action.WAIT,
)


class ElectionTag(StrEnum):
    """Why `decide` decided what it did."""

    HELD_BY = "held by"  # follow: another peer holds a live lease
    HOLDING = "holding"  # hold: my lease is live and not due for renewal
    RENEW = "renew"  # renew: lease_renew_fraction of the TTL has elapsed
    HIGHER_TERM = "higher term"  # step_down: someone holds (or has held) a term above mine
    LOST_TIE = "lost tie"  # step_down: another live lease of my term wins the rendezvous tie-break
    LEASE_EXPIRED = "lease expired"  # step_down: too close to (or past) expiry to renew safely
    TERM_ENDED = "term ended"  # step_down: term_rounds rounds done; merge open rounds with a quorum, release
    REFUSED_LEASE = "refused lease"  # step_down: the lease rules refuse my own lease (an island's)
    CLAIM = "claim"  # claim: my window for term T+1 is open
    LEASE_GRACE = "lease grace"  # wait: the last lease has not yet passed expiry + lease_margin
    CLAIM_GRACE = "claim grace"  # wait: another candidate's claim window is open
    NOT_ELIGIBLE = "not eligible"  # wait: I may not synchronize, am unreachable, lagging, or just rotated out
    NO_CANDIDATES = "no candidates"  # wait: no live peer is eligible
    SUCCESSION = "succession"  # claim: the holder is down (its connections refused) and named me next
    PARTIAL_READ = "partial read"  # wait: my read may miss a candidate (I just started, or one vanished)
    INCOMPLETE_READ = "incomplete read"  # wait: my read lacks a record still stored (`claim_guard`)
    UNDER_WAY = "run under way"  # wait: a signed record shows the run started; my replica is at 0
    STOPPING = "stopping"  # wait: this peer is shutting down and never claims again
    STEPPING_DOWN = "stepping down"  # wait: I released my term; no read has shown its end yet
    UNCONFIRMED = "unconfirmed"  # hold: no complete read has shown my claim yet; merge nothing
    CONFIRMED = "confirmed"  # hold (or renew): a read shows my claim and no other of its term; merge
    YIELDED = "yielded"  # step_down: another claim of my term shows before mine is confirmed; release


LEASE_TIE_SALT = "lease-tie"  # tie-break between live leases needs nothing but the records themselves


@dataclass(frozen=True)
class LeaseRecord:
    """One holder's lease from the lease key (subkey = holder). Live while not released and
    `now < expires_at`."""

    holder: str
    term: int
    expires_at: float
    rounds_done: int = 0
    released: bool = False
    successor: str = ""  # who may claim the next term at once if the holder is seen down ("": nobody)

    def live(self, now: float) -> bool:
        return not self.released and now < self.expires_at


@dataclass(frozen=True)
class ElectionDecision(Decision):
    """`term`/`holder`: the term this decision is about and who holds it (or whose claim window is open);
    `expires_at`: for claim/renew the expiry to write, otherwise the relevant lease's expiry (or None)."""

    term: int = 0
    holder: str | None = None
    expires_at: float | None = None
    rounds_done: int = 0
    successor: str = ""

    def lease_to_write(self) -> LeaseRecord | None:
        """The record to store for a claim or renewal; None for every other action."""
        if self.action not in (CLAIM, RENEW) or self.holder is None or self.expires_at is None:
            return None
        return LeaseRecord(
            self.holder, self.term, self.expires_at, self.rounds_done, successor=self.successor
        )


def highest_term(leases: Iterable[LeaseRecord]) -> int:
    """The highest term among all visible lease records, expired and released ones included (0 if none)."""
    return max((lease.term for lease in leases), default=0)


def highest_term_seen(leases: Iterable[LeaseRecord], term_floor: int = 0) -> int:
    """T: the highest term in visible (valid) leases, or `term_floor` if higher."""
    return max(highest_term(leases), term_floor)


def current_holder(leases: Iterable[LeaseRecord], now: float) -> LeaseRecord | None:
    """The live lease with the highest term; between live leases of that term, the holder ranked first by
    `rendezvous_rank(LEASE_TIE_SALT, term, holders)`. None if no lease is live."""
    live = [lease for lease in leases if lease.live(now)]
    if not live:
        return None
    top = max(lease.term for lease in live)
    of_top = {lease.holder: lease for lease in sorted(live, key=lambda x: x.expires_at) if lease.term == top}
    if len(of_top) == 1:  # no tie to break (nearly every read: ranking one holder hashed it per shard)
        return next(iter(of_top.values()))
    return of_top[rendezvous_rank(LEASE_TIE_SALT, top, of_top)[0]]


def release_lease(lease: LeaseRecord, now: float, timing: SwarmTiming, rounds_done: int) -> LeaseRecord:
    """The released record a holder writes when its term ends, after merging its open rounds (`Peer`).

    Like every lease write it expires at ``now + lease_ttl``, so its write (release) time is recoverable and
    its DHT expiration is later than the record it replaces."""
    return replace(lease, expires_at=now + timing.lease_ttl, rounds_done=rounds_done, released=True)


def dht_expiration(lease: LeaseRecord, timing: SwarmTiming) -> float:
    """DHT expiration for storing `lease`: one TTL past its logical expiry, so the term stays visible."""
    return lease.expires_at + timing.lease_ttl


def _claim_base(last: Sequence[LeaseRecord], timing: SwarmTiming) -> float:
    """When claims for the next term may start, from the (non-live) records of the highest term; with none
    visible, claim windows are aligned on time 0."""
    if not last:
        return 0.0
    return max(
        lease.expires_at - timing.lease_ttl if lease.released else lease.expires_at + timing.lease_margin
        for lease in last
    )


def decide(
    self_id: str,
    run_id: str,
    heartbeats: Iterable[PeerHeartbeat],
    leases: Iterable[LeaseRecord],
    now: float,
    timing: SwarmTiming,
    *,
    my_lease: LeaseRecord | None,
    rounds_done: int,
    max_lag: int = 0,
    term_floor: int = 0,
    verified_newest: int | None = None,
    down: Collection[str] = (),
    successor_lag: int = 0,
    confirmed: bool = True,
) -> ElectionDecision:
    """What `self_id` should do about the synchronizer role now.

    `leases` are the records that passed `protocol.lease_rules` (all of them are trusted here);
    `my_lease` is the lease this peer last wrote and still believes it holds (None, or a released record,
    when it holds none); `rounds_done` counts the rounds it merged in that term; `term_floor` and
    `verified_newest` are what this peer itself has verified (see `highest_term_seen`, `newest_versions`);
    `down`: peers this peer has just seen dead (connections refused: the process is gone, not frozen);
    `successor_lag`: how far behind (in summed versions) a peer's heartbeat may be and still be named
    successor (heartbeats are up to a period old, and the holder publishes meanwhile);
    `confirmed`: whether a read already confirmed `my_lease`'s claim (module docstring, "confirmation").
    """
    heartbeats, leases = list(heartbeats), list(leases)
    term_seen = highest_term_seen(leases, term_floor)
    holder = current_holder(leases, now)

    def successor(next_term: int) -> str:
        return named_successor(self_id, run_id, heartbeats, now, next_term, successor_lag, verified_newest)

    if my_lease is not None and not my_lease.released:
        if my_lease.holder != self_id:
            raise ValueError(f"my_lease is held by {my_lease.holder!r}, not by this peer {self_id!r}")
        decision = _decide_as_holder(my_lease, holder, term_seen, leases, now, timing, rounds_done, confirmed)
        return _naming(decision, successor(decision.term + 1)) if decision.action == RENEW else decision

    if holder is not None and holder.term >= term_seen:

        def eligible() -> bool:
            return any(
                hb.peer_id == self_id for hb in eligible_candidates(heartbeats, now, max_lag, verified_newest)
            )

        return _decide_under_holder(self_id, holder, eligible, down, now, timing, successor)
    decision = _decide_claim(
        self_id, run_id, heartbeats, leases, term_seen, now, timing, max_lag, verified_newest
    )
    return _naming(decision, successor(decision.term + 1)) if decision.action == CLAIM else decision


def _decide_under_holder(
    self_id: str,
    holder: LeaseRecord,
    eligible: Callable[[], bool],
    down: Collection[str],
    now: float,
    timing: SwarmTiming,
    successor: Callable[[int], str],
) -> ElectionDecision:
    """Another live lease of the highest term: follow it, or succeed its holder at once if it is down and
    named this peer, and this peer is `eligible()` (asked only then: ranking every candidate's versions on
    every read of every shard was a tenth of a peer's time at 256 peers, issue #40); this peer's own lease
    from before a restart is left to lapse."""
    if holder.holder == self_id:  # my own lease from before a restart: let it lapse, do not resume
        return ElectionDecision(
            WAIT,
            ElectionTag.LEASE_GRACE,
            f"my own term {holder.term} lease from before a restart, live until {holder.expires_at:.2f}",
            term=holder.term,
            holder=self_id,
            expires_at=holder.expires_at,
        )
    if holder.holder in down and holder.successor == self_id and eligible():
        claim = ElectionDecision(
            CLAIM,
            ElectionTag.SUCCESSION,
            f"{holder.holder} (term {holder.term}) is down and named me its successor",
            term=holder.term + 1,
            holder=self_id,
            expires_at=now + timing.lease_ttl,
        )
        return _naming(claim, successor(holder.term + 2))
    return ElectionDecision(
        FOLLOW,
        ElectionTag.HELD_BY,
        f"{holder.holder} term {holder.term} until {holder.expires_at:.2f}",
        term=holder.term,
        holder=holder.holder,
        expires_at=holder.expires_at,
    )


def _naming(decision: ElectionDecision, successor: str) -> ElectionDecision:
    """A claim or renewal that names `successor` in the lease it writes (and says so in its reason)."""
    return replace(
        decision, successor=successor, detail=f"{decision.detail}; successor {successor or 'none'}"
    )


def _decide_as_holder(
    mine: LeaseRecord,
    holder: LeaseRecord | None,
    term_seen: int,
    leases: Sequence[LeaseRecord],
    now: float,
    timing: SwarmTiming,
    rounds_done: int,
    confirmed: bool = True,
) -> ElectionDecision:
    """A holder's decision: step down when outranked (`_outranked`), otherwise `_keeping` its lease; an
    unconfirmed claimant first checks its claim on the read (`_unconfirmed`)."""
    outranked = _outranked(mine, holder, term_seen, tie=confirmed)
    if outranked is not None:
        return outranked
    decision = _keeping(mine, leases, now, timing, rounds_done)
    return decision if confirmed else _unconfirmed(decision, _confirmation(mine, leases))


def _keeping(
    mine: LeaseRecord, leases: Sequence[LeaseRecord], now: float, timing: SwarmTiming, rounds_done: int
) -> ElectionDecision:
    """A holder that nothing outranks: step down when its lease runs out, end its term after `term_rounds`
    rounds, renew once `lease_renew_fraction` of the TTL passed, otherwise hold."""
    term = mine.term
    # Others fence me on what they read: if my renewal is not visible yet, the older expiry is the one
    # that counts.
    visible = [x.expires_at for x in leases if x.holder == mine.holder and x.term == term and not x.released]
    expires_at = min([mine.expires_at, *visible])
    mine_until = partial(ElectionDecision, term=term, holder=mine.holder, expires_at=expires_at)
    if now >= expires_at - timing.lease_margin:
        return mine_until(
            STEP_DOWN,
            ElectionTag.LEASE_EXPIRED,
            f"term {term} lease expires at {expires_at:.2f}; stop merging by "
            f"{expires_at - timing.lease_margin:.2f} (margin {timing.lease_margin}s)",
        )
    if rounds_done >= timing.term_rounds:
        return mine_until(
            STEP_DOWN,
            ElectionTag.TERM_ENDED,
            f"{rounds_done} of {timing.term_rounds} rounds done in term {term}; "
            "merge the open rounds that have a quorum, then release",
            rounds_done=rounds_done,
        )
    written_at = expires_at - timing.lease_ttl
    if now - written_at >= timing.lease_renew_fraction * timing.lease_ttl:
        return ElectionDecision(
            RENEW,
            ElectionTag.RENEW,
            f"term {term}, {now - written_at:.2f}s of {timing.lease_ttl}s elapsed",
            term=term,
            holder=mine.holder,
            expires_at=now + timing.lease_ttl,
            rounds_done=rounds_done,
        )
    holding = f"term {term} until {expires_at:.2f}, {rounds_done} rounds done"
    return mine_until(HOLD, ElectionTag.HOLDING, holding, rounds_done=rounds_done)


def _unconfirmed(decision: ElectionDecision, confirmation: ElectionDecision) -> ElectionDecision:
    """An unconfirmed claimant's decision, from its `_keeping` one and its claim's `_confirmation`: a yield
    first, then its lease running out; a renewal carries a confirmation along (tag `CONFIRMED`); a hold
    becomes the confirmation (confirmed, or still unconfirmed)."""
    if confirmation.action == STEP_DOWN or decision.action == STEP_DOWN:
        return confirmation if confirmation.action == STEP_DOWN else decision
    if decision.action == HOLD:
        return replace(confirmation, expires_at=decision.expires_at)
    if confirmation.tag == ElectionTag.CONFIRMED:
        return replace(
            decision, tag=ElectionTag.CONFIRMED, detail=f"{confirmation.detail}; {decision.detail}"
        )
    return decision


def rivals(mine: LeaseRecord, leases: Iterable[LeaseRecord]) -> list[LeaseRecord]:
    """Other claims of `mine`'s term that may have merged: every other holder's record of it except one
    released with no round merged (a yield, or a stop before any merge)."""
    return [
        x
        for x in leases
        if x.term == mine.term and x.holder != mine.holder and not (x.released and x.rounds_done == 0)
    ]


def _confirmation(mine: LeaseRecord, leases: Sequence[LeaseRecord]) -> ElectionDecision:
    """An unconfirmed claim on a read: yield if another claim of its term shows, confirm if the read shows
    this claim alone, otherwise hold unconfirmed (module docstring, "confirmation")."""
    term, me = mine.term, mine.holder
    others = sorted({x.holder for x in rivals(mine, leases)})
    if others:
        return ElectionDecision(
            STEP_DOWN,
            ElectionTag.YIELDED,
            f"{', '.join(others)} also claimed term {term} before a read confirmed my claim; "
            "I release it, having merged nothing",
            term=term,
        )
    if any(x.holder == me and x.term == term for x in leases):
        detail = f"a read shows my claim of term {term} and no other; merging from now on"
        return ElectionDecision(HOLD, ElectionTag.CONFIRMED, detail, term=term, holder=me)
    detail = f"no read has shown my claim of term {term} yet; merging nothing until one does"
    return ElectionDecision(HOLD, ElectionTag.UNCONFIRMED, detail, term=term, holder=me)


def _outranked(
    mine: LeaseRecord, holder: LeaseRecord | None, term_seen: int, *, tie: bool = True
) -> ElectionDecision | None:
    """The step-down of a holder that a higher term, or (`tie`: a confirmed holder) a tie of its own term
    it loses, outranks. An unconfirmed claimant yields to any other claim of its term instead."""
    term = mine.term
    if holder is not None and holder.term > term:
        return ElectionDecision(
            STEP_DOWN,
            ElectionTag.HIGHER_TERM,
            f"{holder.holder} holds term {holder.term} > my term {term}",
            term=holder.term,
            holder=holder.holder,
            expires_at=holder.expires_at,
        )
    if term_seen > term:
        return ElectionDecision(
            STEP_DOWN, ElectionTag.HIGHER_TERM, f"term {term_seen} was seen > my term {term}", term=term_seen
        )
    if tie and holder is not None and holder.term == term and holder.holder != mine.holder:
        return ElectionDecision(
            STEP_DOWN,
            ElectionTag.LOST_TIE,
            f"{holder.holder} also holds term {term} and wins the tie-break",
            term=term,
            holder=holder.holder,
            expires_at=holder.expires_at,
        )
    return None


def _decide_claim(
    self_id: str,
    run_id: str,
    heartbeats: Sequence[PeerHeartbeat],
    leases: Sequence[LeaseRecord],
    term_seen: int,
    now: float,
    timing: SwarmTiming,
    max_lag: int,
    verified_newest: int | None,
) -> ElectionDecision:
    next_term = term_seen + 1
    last = [lease for lease in leases if lease.term == term_seen]
    base = _claim_base(last, timing)
    if last and now < base:
        return _in_lease_grace(last, base)
    candidates = [hb.peer_id for hb in eligible_candidates(heartbeats, now, max_lag, verified_newest)]
    if not candidates:
        live = sum(hb.live(now) for hb in heartbeats)
        return ElectionDecision(
            WAIT,
            ElectionTag.NO_CANDIDATES,
            f"none of {live} live peers is eligible for term {next_term}",
            term=next_term,
        )
    rotated_out = {lease.holder for lease in last if lease.released}
    if any(c not in rotated_out for c in candidates):
        candidates = [c for c in candidates if c not in rotated_out]
    ranking = rendezvous_rank(run_id, next_term, candidates)
    if self_id not in ranking:
        turn = ranking[math.floor((now - base) / timing.claim_grace) % len(ranking)]
        why = "previous holder, rotating out" if self_id in rotated_out else None
        why = why or why_not_eligible(self_id, heartbeats, now, max_lag, verified_newest)
        return ElectionDecision(
            WAIT,
            ElectionTag.NOT_ELIGIBLE,
            f"{why}; {turn} may claim term {next_term}",
            term=next_term,
            holder=turn,
        )
    return _claim_window(self_id, ranking, next_term, base, now, timing)


def _in_lease_grace(last: Sequence[LeaseRecord], base: float) -> ElectionDecision:
    """Wait: the records of the highest term (`last`) lapsed, and claims of the next open at `base`."""
    old = max(last, key=lambda x: x.expires_at)
    return ElectionDecision(
        WAIT,
        ElectionTag.LEASE_GRACE,
        f"term {old.term} of {old.holder} lapsed; claims for term {old.term + 1} open at {base:.2f}",
        term=old.term,
        holder=old.holder,
        expires_at=old.expires_at,
    )


def follow_only(
    self_id: str, leases: Iterable[LeaseRecord], now: float, timing: SwarmTiming, *, term_floor: int = 0
) -> ElectionDecision:
    """`decide` for a peer that holds no lease and can never claim one (no candidate of the shard: the run
    does not let it synchronize, or it is not among the candidates whose heartbeats every peer reads,
    `protocol.heartbeat_buckets`): the decision `decide` reaches when no heartbeat shows it eligible, without
    ranking anyone. It follows a live holder of the highest term, waits out a lapsed term's lease grace,
    and otherwise waits for some candidate's claim (`NOT_ELIGIBLE`, naming no candidate: whose claim window
    is open does not concern it). At 256 peers, S = 16, every peer ran S full elections a read, ranking
    the candidates' heartbeats it could never be among (issue #40)."""
    leases = list(leases)
    term_seen = highest_term_seen(leases, term_floor)
    holder = current_holder(leases, now)
    if holder is not None and holder.term >= term_seen:
        return _decide_under_holder(self_id, holder, lambda: False, (), now, timing, lambda _: "")
    last = [lease for lease in leases if lease.term == term_seen]
    base = _claim_base(last, timing)
    if last and now < base:
        return _in_lease_grace(last, base)
    return ElectionDecision(
        WAIT,
        ElectionTag.NOT_ELIGIBLE,
        f"I am no candidate of this shard; a candidate may claim term {term_seen + 1}",
        term=term_seen + 1,
    )


def _claim_window(
    self_id: str, ranking: Sequence[str], next_term: int, base: float, now: float, timing: SwarmTiming
) -> ElectionDecision:
    """Claim windows of `claim_grace` seconds from `base`, one per ranked candidate in turn: claim in mine,
    otherwise wait and say when mine opens."""
    window = math.floor((now - base) / timing.claim_grace)
    turn = ranking[window % len(ranking)]
    if turn == self_id:
        return ElectionDecision(
            CLAIM,
            ElectionTag.CLAIM,
            f"term {next_term}, rank {ranking.index(self_id) + 1} of {len(ranking)}",
            term=next_term,
            holder=self_id,
            expires_at=now + timing.lease_ttl,
        )
    rank = ranking.index(self_id)
    my_window = window + (rank - window) % len(ranking)
    return ElectionDecision(
        WAIT,
        ElectionTag.CLAIM_GRACE,
        f"{turn} may claim term {next_term} now; I am rank {rank + 1} of {len(ranking)}, "
        f"my turn at {base + my_window * timing.claim_grace:.2f}",
        term=next_term,
        holder=turn,
    )
