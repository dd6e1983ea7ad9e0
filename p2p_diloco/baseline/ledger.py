"""A baseline worker's own books: compute, merged compute, blocked time, tokens and estimated bytes.

`StepLedger` holds cumulative counters for one process lifetime (they start at zero on every start,
which `p2p_diloco.demo.accounting` detects). It is fed durations measured by the worker, never reads a
clock itself, and is thread-safe (the progress reporter snapshots it while the training loop runs).

Merged compute: the forward/backward seconds of local steps wait in `pending` until the global optimizer
step that consumes their accumulated gradients. That step's `RoundOutcome` decides their fate:

* `AVERAGED`: gradients were all-reduced with at least one other peer and applied: merged;
* `ALONE`: hivemind saw no other live peer, so the local gradients *are* the global step: merged;
* `FAILED`: other peers were visible but the round failed or timed out; hivemind applies the local
  gradients to this peer's copy only, which then differs from the others' until a later parameter
  averaging blends it back (if any): not merged;
* `RELOADED`: hivemind found the peer out of sync and replaced its state by a peer's: not merged.

The local optimizer (AdamW) seconds of a global step count as compute, merged with the same verdict.

Bytes are estimates (hivemind does not count them): a butterfly all-reduce in a group of g peers sends
and receives `2 * (g - 1) / g` times the averaged bytes at every member (`allreduce_bytes`).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

AVERAGED = "averaged"
ALONE = "alone"
FAILED = "failed"
RELOADED = "reloaded"
MERGED_OUTCOMES = frozenset({AVERAGED, ALONE})


def allreduce_bytes(num_bytes: int, group_size: int) -> tuple[float, float]:
    """(sent, received) by one member of a butterfly all-reduce of `num_bytes` in a group of `group_size`.

    Each member sends the g - 1 parts it does not reduce and receives g - 1 contributions to its own part,
    then sends its averaged part to the g - 1 others and receives theirs: 2 (g - 1) / g of the bytes each way.
    """
    if num_bytes < 0 or group_size < 1:
        raise ValueError(f"need num_bytes >= 0 and group_size >= 1, got {num_bytes} and {group_size}")
    moved = 2.0 * num_bytes * (group_size - 1) / group_size
    return moved, moved


def step_outcome(group_size: int, peers_seen: int) -> str:
    """The outcome of a global step whose gradient round had `group_size` members (0: none or failed)
    while hivemind's progress records showed `peers_seen` peers, this one included."""
    if group_size >= 2:
        return AVERAGED
    return ALONE if peers_seen <= 1 else FAILED


@dataclass
class LedgerCounters:
    """Cumulative since the process started; the field names are those of the `progress` event."""

    steps: int = 0
    tokens: int = 0
    compute_seconds: float = 0.0
    compute_merged: float = 0.0
    compute_dropped: float = 0.0
    blocked_seconds: float = 0.0
    paced_seconds: float = 0.0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    global_steps: int = 0
    rounds_averaged: int = 0
    rounds_alone: int = 0
    rounds_failed: int = 0
    reloads: int = 0


class StepLedger:
    """Counters of one worker process (module docstring). All durations in seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = LedgerCounters()
        self._pending = 0.0  # compute seconds whose gradients await a global step
        self._blocked_since: float | None = None

    @property
    def pending_seconds(self) -> float:
        with self._lock:
            return self._pending

    def local_step(self, compute_seconds: float, tokens: int) -> None:
        """A forward/backward pass on `tokens` tokens whose gradients were accumulated."""
        with self._lock:
            self._counters.steps += 1
            self._counters.tokens += tokens
            self._counters.compute_seconds += compute_seconds
            self._pending += compute_seconds

    def blocking_started(self, now: float) -> None:
        """The worker entered the optimizer step; `snapshot(now)` counts the wait so far as blocked."""
        with self._lock:
            self._blocked_since = now

    def blocking_ended(self, blocked_seconds: float) -> None:
        """The optimizer step returned; `blocked_seconds` is its duration minus local optimizer work."""
        with self._lock:
            self._blocked_since = None
            self._counters.blocked_seconds += max(0.0, blocked_seconds)

    def paced(self, seconds: float) -> None:
        """Time slept to honour `--min-step-time` (neither compute nor blocked)."""
        with self._lock:
            self._counters.paced_seconds += seconds

    def global_step(self, outcome: str, optimizer_seconds: float) -> None:
        """A global optimizer step consumed the pending gradients with `outcome` (module docstring)."""
        if outcome not in (AVERAGED, ALONE, FAILED):
            raise ValueError(f"unknown global step outcome {outcome!r}")
        with self._lock:
            c = self._counters
            c.global_steps += 1
            c.compute_seconds += optimizer_seconds
            spent = self._pending + optimizer_seconds
            if outcome in MERGED_OUTCOMES:
                c.compute_merged += spent
            else:
                c.compute_dropped += spent
            self._pending = 0.0
            if outcome == AVERAGED:
                c.rounds_averaged += 1
            elif outcome == ALONE:
                c.rounds_alone += 1
            else:
                c.rounds_failed += 1

    def reloaded(self) -> None:
        """State was replaced by a peer's: pending gradients are discarded."""
        with self._lock:
            self._counters.reloads += 1
            self._counters.compute_dropped += self._pending
            self._pending = 0.0

    def add_bytes(self, sent: float, received: float) -> None:
        with self._lock:
            self._counters.bytes_sent += sent
            self._counters.bytes_received += received

    def snapshot(self, now: float | None = None) -> dict[str, float | int]:
        """The counters as a dict; with `now`, an optimizer step still running counts as blocked so far."""
        with self._lock:
            values = asdict(self._counters)
            if now is not None and self._blocked_since is not None:
                values["blocked_seconds"] += max(0.0, now - self._blocked_since)
            values["compute_pending"] = self._pending
        return values
