"""What a peer is at one synchronizer shard, explicitly: its seat's `Phase`, and the rule that moves it.

A seat (`swarm.election.seats.Seat`) is in exactly one phase:

- `FOLLOWING`: it holds nothing and follows the shard's holder it knows (or none yet). A peer that may not
  synchronize is always here (or stopping).
- `CANDIDATE`: it may synchronize, holds nothing and follows no live holder: it waits for its claim window
  (or for a guard of `protocol.claim_guard.gate` to clear).
- `HOLDING`: it holds the shard's lease: merges its fragments' rounds (once a read confirmed its claim:
  `protocol.election`, "confirmation"), renews, names a successor.
- `STEPPING_DOWN`: it released its term (term ended, or it yielded an unconfirmed claim); it claims nothing
  until a read shows that term over (its released record, or another holder), or `lease_ttl` has passed.
- `STOPPING`: the peer is shutting down. Terminal: it released what it held and never claims again.

`after_decision` and `after_read` are the whole transition table; they are pure, so the table is tested
on its own (`tests/unit/test_phase.py`). The seat performs what a transition implies (take the term,
release the lease, follow the holder) and the peer returns those as intents.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.protocol import election
from p2p_diloco.protocol.election import ElectionDecision, ElectionTag


class Phase(StrEnum):
    FOLLOWING = "following"
    CANDIDATE = "candidate"
    HOLDING = "holding"
    STEPPING_DOWN = "stepping down"
    STOPPING = "stopping"


@dataclass(frozen=True)
class Stepped:
    """A seat's step: the phase before and after one event, and why (the decision's reason, or the
    event's)."""

    before: Phase
    after: Phase
    why: str

    @property
    def changed(self) -> bool:
        return self.before != self.after


def after_decision(phase: Phase, decision: ElectionDecision, may_claim: bool) -> Phase:
    """The phase an election decision moves a seat to (`may_claim`: this peer may synchronize now)."""
    if phase == Phase.STOPPING:
        return Phase.STOPPING
    action = decision.action
    if action in (election.CLAIM, election.RENEW):
        return Phase.HOLDING
    if action == election.HOLD:
        return Phase.HOLDING if phase == Phase.HOLDING else _idle(may_claim, decision)
    if action == election.STEP_DOWN:
        if phase == Phase.HOLDING and decision.tag in (ElectionTag.TERM_ENDED, ElectionTag.YIELDED):
            return Phase.STEPPING_DOWN
        return _idle(may_claim, decision)
    if phase == Phase.STEPPING_DOWN and action == election.WAIT:
        return Phase.STEPPING_DOWN  # only a read that shows the term over ends it (`after_read`)
    return _idle(may_claim, decision)


def _idle(may_claim: bool, decision: ElectionDecision) -> Phase:
    """Holding nothing: following a holder (or unable to claim), or a candidate waiting to claim."""
    if decision.action == election.FOLLOW or not may_claim:
        return Phase.FOLLOWING
    return Phase.CANDIDATE


def after_read(phase: Phase, term_over: bool, stepped_down_at: float | None, now: float, ttl: float) -> Phase:
    """Before the election of a read: a seat stepping down is done once the read shows its term over
    (`term_over`) or `ttl` has passed since it released; every other phase stays."""
    if phase != Phase.STEPPING_DOWN:
        return phase
    if term_over or stepped_down_at is None or now - stepped_down_at >= ttl:
        return Phase.CANDIDATE
    return phase


def after_stop(phase: Phase) -> Phase:
    """`Stopping` moves every seat to `STOPPING`, whatever it was (a holder releases first)."""
    del phase
    return Phase.STOPPING
