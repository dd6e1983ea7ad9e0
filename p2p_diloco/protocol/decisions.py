"""`Decision`: what a protocol rule decided, as `(action, tag, detail)`; `Action`: every verb.

`action` is a fixed verb, `tag` a member of the deciding rule's `StrEnum` of tags (defined once, in that
rule's module), `detail` free text for people. Code branches on `action` and `tag`, never on text;
`reason` ("<tag>: <detail>") is only what logs and `status` show.
"""

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


class AdmissionTag(StrEnum):
    """Why a frame or request was refused before any rule looked at its contents (shared by the transport's
    allowlist, the synchronizer, the update intake and the repair services)."""

    NOT_ALLOWED = "not allowed"  # the sender is not on the run's allowlist, or may not send this
    WRONG_RUN = "wrong run"
    WRONG_MANIFEST = "wrong manifest"
    UNKNOWN_FRAGMENT = "unknown fragment"
    ALREADY_MERGED = "already merged"  # a delta repeats work an applied update merged before


def reason_text(tag: str, detail: str) -> str:
    """The line people read: ``"<tag>: <detail>"``, or the tag alone."""
    return f"{tag}: {detail}" if detail else str(tag)


@dataclass(frozen=True)
class Decision:
    """`action`: a fixed verb of the rule that made it; `tag`: why, a member of that rule's tag enum;
    `detail`: the particulars, for logs and `status` only."""

    action: str
    tag: str
    detail: str = ""

    @property
    def reason(self) -> str:
        return reason_text(self.tag, self.detail)

    def __str__(self) -> str:
        return f"{self.action}: {self.reason}"
