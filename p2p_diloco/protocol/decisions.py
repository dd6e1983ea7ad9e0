"""`Decision`: what a protocol rule decided and why, in one short reason string; `Action`: every verb."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Action(StrEnum):
    """The verbs of every rule (a `StrEnum`, so they also compare equal to their plain strings)."""

    ACCEPT = "accept"
    REJECT = "reject"
    CLIP = "clip"
    IGNORE = "ignore"
    # sync rounds
    CLOSE = "close"
    WAIT = "wait"
    # replica
    APPLY = "apply"
    LOAD = "load"
    REFUSE = "refuse"
    # election
    FOLLOW = "follow"
    HOLD = "hold"
    RENEW = "renew"
    STEP_DOWN = "step_down"
    CLAIM = "claim"
    # learner schedule
    SEND = "send"
    TRAIN = "train"
    # reconciliation
    IN_SYNC = "in_sync"
    KEEP = "keep"
    CATCH_UP = "catch_up"
    RECONCILE = "reconcile"


@dataclass(frozen=True)
class Decision:
    """`action` is a fixed verb of the rule that made it; `reason` starts with a fixed tag, then details.

    Tests assert on the tag (e.g. ``reason.startswith("stale anchor")``); logs and `status` show all of it.
    """

    action: str
    reason: str

    def __str__(self) -> str:
        return f"{self.action}: {self.reason}"
