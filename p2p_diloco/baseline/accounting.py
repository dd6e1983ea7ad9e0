"""Goodput accounting over the event logs of a run: pure functions, no files, no clock.

Works on the ``events.jsonl`` lines of any peer that emits ``progress`` events with cumulative
counters (a baseline worker or a DiLoCo learner alike): ``{"t": time, "event": "progress",
"tokens": ..., "compute_seconds": ..., "compute_merged": ..., "blocked_seconds": ..., "bytes_sent": ...,
"bytes_received": ...}``. Counters restart from zero in every process lifetime; a lifetime begins at a
``start`` event or wherever a counter decreases.

Within a lifetime a counter is read as the piecewise-linear curve through its progress points, starting
from 0 at the ``start`` event when there is one and flat after the last point (what a killed process did
after its last report is unknown, hence not counted). A counter's amount in the window [start, end] is
curve(end) - curve(start), summed over lifetimes and peers. With N learners and wall = end - start:

* goodput = sum of compute_merged / (N * wall): compute whose work reached the global model;
* compute_fraction = sum of compute_seconds / (N * wall); blocked_fraction = sum of blocked_seconds / (N * wall);
* tokens = sum of tokens; bytes_per_learner = {"sent": sum of bytes_sent / N, "received": ... / N}.

N defaults to the number of peers given; pass the number of learner slots when a slot has no log.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

PROGRESS_EVENT = "progress"
START_EVENT = "start"
COUNTER_FIELDS = (
    "tokens",
    "compute_seconds",
    "compute_merged",
    "blocked_seconds",
    "bytes_sent",
    "bytes_received",
)

Event = Mapping[str, Any]


def _time_of(event: Event) -> float | None:
    t = event.get("t")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


def split_lifetimes(events: Sequence[Event]) -> list[list[Event]]:
    """The `start` and `progress` events of one peer's log, grouped by process lifetime (in log order).

    Each group begins with its `start` event when the log has one; a progress event whose counter is
    below the previous one's also begins a group (a restart whose `start` line was lost).
    """
    lives: list[list[Event]] = []
    last: dict[str, float] = {}
    for event in events:
        kind = event.get("event")
        if _time_of(event) is None or kind not in (START_EVENT, PROGRESS_EVENT):
            continue
        if kind == START_EVENT:
            lives.append([event])
            last = {}
            continue
        counters = {f: float(event[f]) for f in COUNTER_FIELDS if isinstance(event.get(f), int | float)}
        if not lives or any(value < last.get(f, 0.0) for f, value in counters.items()):
            lives.append([])
            last = {}
        lives[-1].append(event)
        last.update(counters)
    return lives


def _curve(life: Sequence[Event], field: str) -> tuple[list[float], list[float]]:
    """Breakpoints (times, values) of `field` in one lifetime, sorted by time."""
    points: list[tuple[float, float]] = []
    for event in life:
        t = _time_of(event)
        assert t is not None
        if event.get("event") == START_EVENT:
            points.append((t, 0.0))
        elif isinstance(event.get(field), int | float):
            points.append((t, float(event[field])))
    points.sort(key=lambda p: p[0])
    return [p[0] for p in points], [p[1] for p in points]


def _value_at(times: list[float], values: list[float], t: float) -> float:
    if not times or t <= times[0]:
        return 0.0 if not times or t < times[0] else values[0]
    if t >= times[-1]:
        return values[-1]
    i = bisect.bisect_right(times, t)
    t0, t1, v0, v1 = times[i - 1], times[i], values[i - 1], values[i]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def counters_in_window(events: Sequence[Event], start: float, end: float) -> dict[str, float]:
    """How much of each counter one peer accumulated between `start` and `end` (module docstring)."""
    totals = dict.fromkeys(COUNTER_FIELDS, 0.0)
    for life in split_lifetimes(events):
        for field in COUNTER_FIELDS:
            times, values = _curve(life, field)
            totals[field] += max(0.0, _value_at(times, values, end) - _value_at(times, values, start))
    return totals


def summarize_run(
    events_by_peer: Mapping[str, Sequence[Event]],
    *,
    start: float,
    end: float,
    learners: int | None = None,
) -> dict[str, Any]:
    """Goodput, compute and blocked fractions, tokens and bytes per learner over [start, end].

    `events_by_peer` maps a peer name to its event log lines (e.g. `node.state.read_events(dir)`).
    Returns ``{"goodput", "compute_fraction", "blocked_fraction", "tokens", "bytes_per_learner":
    {"sent", "received"}, "learners", "wall_seconds", "per_peer": {name: {counter: amount}}}``.
    """
    if not end > start:
        raise ValueError(f"the window must have end > start, got start={start} end={end}")
    n = len(events_by_peer) if learners is None else learners
    if n < 1:
        raise ValueError(f"need at least one learner, got {n}")
    per_peer = {name: counters_in_window(events, start, end) for name, events in events_by_peer.items()}
    total = {field: sum(c[field] for c in per_peer.values()) for field in COUNTER_FIELDS}
    capacity = n * (end - start)
    return {
        "goodput": total["compute_merged"] / capacity,
        "compute_fraction": total["compute_seconds"] / capacity,
        "blocked_fraction": total["blocked_seconds"] / capacity,
        "tokens": total["tokens"],
        "bytes_per_learner": {"sent": total["bytes_sent"] / n, "received": total["bytes_received"] / n},
        "learners": n,
        "wall_seconds": end - start,
        "per_peer": per_peer,
    }
