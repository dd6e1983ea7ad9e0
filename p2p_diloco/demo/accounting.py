"""Goodput accounting: goodput, uptime, failovers and bytes from event logs. Pure functions: no files, no
clock.

The one accounting module of the project: the demo's report and orchestrator, the benchmarks and the
baseline's test all read runs of either system through it. Inputs are the ``events.jsonl`` lines of the peers
(``{"t": time, "event": kind, ...}``). Both kinds of worker (`p2p-diloco join`,
`p2p-diloco baseline-worker`) emit ``progress`` events with cumulative counters of their process
lifetime: ``tokens``, ``compute_seconds``, ``compute_merged``, ``blocked_seconds``, ``bytes_sent``,
``bytes_received`` (the baseline also ``paced_seconds``); a line may carry only some of them. Rules:

* a lifetime starts at a ``start`` event (counters 0 there) or where tokens or compute_seconds drop;
* within a lifetime a counter is the piecewise-linear curve through its points, flat after the last one
  (what a SIGKILLed process did after its last report is lost, which is what happened to its work);
* a peer's amount in [start, end] is curve(end) - curve(start), summed over its lifetimes.

Definitions (N learner slots, wall = end - start):

* goodput = sum of compute_merged / (N * wall): compute whose tokens reached the global model. Time a
  slot is down, restarting or catching up, blocked, and compute never merged all count against it.
* uptime = |union of [a, a + period) over global-model advances a| / wall, clipped to the window: the
  fraction of wall times t such that the global model advanced in (t - period, t], i.e. within the last
  nominal round period (one expected round). Stalls around synchronizer kills: `demo.stalls`.
* failovers = how often the peer publishing global updates changed (by term order) without the old one
  releasing its term (a planned rotation is no failover).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Event = Mapping[str, Any]
COUNTERS = (
    "tokens",
    "compute_seconds",
    "compute_merged",
    "blocked_seconds",
    "bytes_sent",
    "bytes_received",
    "paced_seconds",
)
RESTART_COUNTERS = ("tokens", "compute_seconds")  # only a new process lifetime makes these drop


def _time(event: Event) -> float | None:
    t = event.get("t")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def lifetimes(events: Sequence[Event]) -> list[list[Event]]:
    """`start` and `progress` events of one peer grouped by process lifetime (log order)."""
    lives: list[list[Event]] = []
    last: dict[str, float] = {}
    for event in events:
        kind = event.get("event")
        if _time(event) is None or kind not in ("start", "progress"):
            continue
        if kind == "start":
            lives.append([event])
            last = {}
            continue
        values = {f: v for f in COUNTERS if (v := _number(event.get(f))) is not None}
        if not lives or any(values[f] < last.get(f, 0.0) for f in RESTART_COUNTERS if f in values):
            lives.append([])
            last = {}
        lives[-1].append(event)
        last.update(values)
    return lives


def _curve_at(life: Sequence[Event], field: str, t: float) -> float:
    points = sorted(
        (_time(e) or 0.0, 0.0 if e.get("event") == "start" else _number(e.get(field)))
        for e in life
        if e.get("event") == "start" or _number(e.get(field)) is not None
    )
    if not points or t < points[0][0]:
        return 0.0
    times = [p[0] for p in points]
    i = bisect.bisect_right(times, t)
    if i >= len(points):
        return float(points[-1][1] or 0.0)
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    v0, v1 = float(v0 or 0.0), float(v1 or 0.0)
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def counters_in_window(events: Sequence[Event], start: float, end: float) -> dict[str, float]:
    """How much of each counter one peer accumulated in [start, end]."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for life in lifetimes(events):
        for field in COUNTERS:
            totals[field] += max(0.0, _curve_at(life, field, end) - _curve_at(life, field, start))
    return totals


def summarize(
    events_by_peer: Mapping[str, Sequence[Event]],
    *,
    start: float,
    end: float,
    learners: int | None = None,
    paced_as_compute: bool = False,
) -> dict[str, Any]:
    """Goodput, compute/blocked fractions, tokens and bytes per learner over [start, end].

    `events_by_peer` maps a peer name to its event log lines (e.g. `node.state.read_events(dir)`).
    `learners` (N) defaults to the number of peers given; pass the number of learner slots when a slot
    has no log. Returns ``{"goodput", "compute_fraction", "blocked_fraction", "tokens",
    "bytes_per_learner": {name: {"sent", "received"}}, "bytes_mean": {"sent", "received"} (sums / N),
    "learners", "wall_seconds", "per_peer": {name: {counter: amount}}}``.
    `paced_as_compute`: count ``paced_seconds`` (a throttled worker's sleep, emulating a slower device)
    as compute, merged in the same proportion as that peer's measured compute in the window.
    """
    if not end > start:
        raise ValueError(f"the window needs end > start, got {start} .. {end}")
    if learners is None:
        learners = len(events_by_peer)
    if learners < 1:
        raise ValueError(f"need at least one learner, got {learners}")
    per_peer = {name: counters_in_window(events, start, end) for name, events in events_by_peer.items()}
    if paced_as_compute:
        for c in per_peer.values():
            share = c["compute_merged"] / c["compute_seconds"] if c["compute_seconds"] > 0 else 0.0
            c["compute_merged"] += share * c["paced_seconds"]
            c["compute_seconds"] += c["paced_seconds"]
    total = {f: sum(c[f] for c in per_peer.values()) for f in COUNTERS}
    capacity = learners * (end - start)
    return {
        "goodput": total["compute_merged"] / capacity,
        "compute_fraction": total["compute_seconds"] / capacity,
        "blocked_fraction": total["blocked_seconds"] / capacity,
        "tokens": total["tokens"],
        "bytes_per_learner": {
            name: {"sent": c["bytes_sent"], "received": c["bytes_received"]} for name, c in per_peer.items()
        },
        "bytes_mean": {
            "sent": total["bytes_sent"] / learners,
            "received": total["bytes_received"] / learners,
        },
        "learners": learners,
        "wall_seconds": end - start,
        "per_peer": per_peer,
    }


def version_advances(events: Iterable[Event]) -> list[float]:
    """Times at which the global model advanced: the first sighting of each (fragment, version) in
    ``published``/``applied`` events, or of each new ``global_epoch`` in ``progress`` events (baseline)."""
    first: dict[tuple, float] = {}
    for event in events:
        t = _time(event)
        if t is None:
            continue
        kind = event.get("event")
        if kind in ("published", "applied") and "fragment" in event and "version" in event:
            key: tuple = ("fragment", event["fragment"], event["version"])
        elif kind == "progress" and _number(event.get("global_epoch")) is not None:
            key = ("epoch", int(event["global_epoch"]))
        else:
            continue
        first[key] = min(t, first.get(key, t))
    epochs = sorted((k[1], t) for k, t in first.items() if k[0] == "epoch")
    # an epoch counts when first reached, not when a restarted peer reports an old one again
    times = [t for k, t in first.items() if k[0] == "fragment"]
    best = -1
    for epoch, t in sorted(epochs, key=lambda e: e[1]):
        if epoch > best:
            best = epoch
            times.append(t)
    return sorted(times)


def uptime(advances: Sequence[float], *, start: float, end: float, period: float) -> float:
    """Fraction of [start, end] covered by [a, a + period) for the advances a (module docstring)."""
    if not end > start:
        raise ValueError(f"the window needs end > start, got {start} .. {end}")
    if period <= 0:
        raise ValueError(f"period must be > 0, got {period}")
    covered, reach = 0.0, start
    for a in sorted(advances):
        lo, hi = max(a, reach), min(a + period, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered / (end - start)


def failovers(events: Iterable[Event]) -> list[dict[str, Any]]:
    """Changes of the publishing peer that were no planned rotation: ``[{"t", "term", "from", "to"}]``,
    from ``published`` events. A change after a term whose holder released it (its ``released_lease``
    event: a rotation after `timing.term_rounds` rounds, or a clean stop) is not a failover, as
    `swarm.Membership.released` tells a peer's own count."""
    events = list(events)
    released = {
        e["term"] for e in events if e.get("event") == "released_lease" and isinstance(e.get("term"), int)
    }
    first_by_term: dict[int, tuple[float, str]] = {}
    for event in events:
        t = _time(event)
        if event.get("event") != "published" or t is None or not isinstance(event.get("term"), int):
            continue
        term = event["term"]
        if term not in first_by_term or t < first_by_term[term][0]:
            first_by_term[term] = (t, str(event.get("leader")))
    changes, previous, previous_term = [], None, None
    for term in sorted(first_by_term):
        t, leader = first_by_term[term]
        if previous is not None and leader != previous and previous_term not in released:
            changes.append({"t": t, "term": term, "from": previous, "to": leader})
        previous, previous_term = leader, term
    return changes


def nominal_period(events_by_peer: Mapping[str, Sequence[Event]], steps_per_round: float) -> float:
    """`steps_per_round` times the median seconds per step seen between consecutive progress events."""
    rates = []
    for events in events_by_peer.values():
        for life in lifetimes(events):
            points = [
                (_time(e), _number(e.get("step", e.get("steps"))))
                for e in life
                if e.get("event") == "progress"
            ]
            points = [(t, s) for t, s in points if t is not None and s is not None]
            for (t0, s0), (t1, s1) in zip(points, points[1:], strict=False):
                if s1 > s0 and t1 > t0:
                    rates.append((t1 - t0) / (s1 - s0))
    if not rates:
        return 0.0
    rates.sort()
    return steps_per_round * rates[len(rates) // 2]
