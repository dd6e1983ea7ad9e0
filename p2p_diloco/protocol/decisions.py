"""`Decision`: what a protocol rule decided and why, in one short reason string."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """`action` is a fixed verb of the rule that made it; `reason` starts with a fixed tag, then details.

    Tests assert on the tag (e.g. ``reason.startswith("stale anchor")``); logs and `status` show all of it.
    """

    action: str
    reason: str

    def __str__(self) -> str:
        return f"{self.action}: {self.reason}"
