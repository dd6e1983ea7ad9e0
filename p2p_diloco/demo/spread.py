"""How updates spread through a swarm of real peers, from their event logs: pure functions, no files, no
clock.

`scripts/bench_swarm.py` (issue #29) reads one run's ``events.jsonl`` per peer through this module. Inputs
are the peers' events (``{"t": DHT time, "event": kind, ...}``, `demo.accounting`): ``published`` (the
holder's update: fragment, version, term, leader), ``applied`` (an update pushed to this peer and applied)
and ``progress`` (cumulative ``bytes_sent``/``bytes_received`` of the peer's transport: payload bytes of
deltas, updates, fetches and what it serves; DHT traffic excluded, `net.traffic`). Every peer runs on one
machine here, so the events' times are on one clock. Definitions, for a window [start, end]:

* merged updates = distinct (fragment, version) published in the window;
* a peer's bytes per merged update = its bytes sent (received, both) in the window / merged updates;
  the busiest peer is the one with the most bytes sent + received;
* update size = one fragment's int8 frame, given by the caller (`scripts/bench_swarm.py` encodes the
  model's fragments); beside it, the median over peers that published nothing of bytes received /
  updates applied (what an update costs such a peer, fetches and repairs included);
* a publisher's fan-out = its bytes sent in the window / (updates it published there × update size),
  for each peer that published at least a tenth of the window's updates:
  copies of each update it sent, an upper bound (what it served to fetches and its own deltas count too);
* propagation of an update = the last ``applied`` time over the other peers minus its ``published`` time
  (a peer that caught up by fetching instead emits no ``applied`` and is not counted).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from p2p_diloco.demo.accounting import Event, counters_in_window

Key = tuple[int, int]  # (fragment, version)


def _first_times(events_by_peer: Mapping[str, Sequence[Event]], kind: str) -> dict[Key, dict[str, float]]:
    """(fragment, version) -> {peer: the time of its first `kind` line of that update}."""
    seen: dict[Key, dict[str, float]] = {}
    for peer, events in events_by_peer.items():
        for event in events:
            fragment, version, t = event.get("fragment"), event.get("version"), event.get("t")
            if event.get("event") != kind or not isinstance(t, int | float):
                continue
            if isinstance(fragment, int) and isinstance(version, int):
                at = seen.setdefault((fragment, version), {})
                at[peer] = min(float(t), at.get(peer, float(t)))
    return seen


def publications(events_by_peer: Mapping[str, Sequence[Event]]) -> dict[Key, tuple[float, str]]:
    """(fragment, version) -> (first ``published`` time, the peer whose log has it)."""
    return {
        key: min((t, peer) for peer, t in at.items())
        for key, at in _first_times(events_by_peer, "published").items()
    }


def applications(events_by_peer: Mapping[str, Sequence[Event]]) -> dict[Key, dict[str, float]]:
    """(fragment, version) -> {peer: its first ``applied`` time}."""
    return _first_times(events_by_peer, "applied")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def propagation(events_by_peer: Mapping[str, Sequence[Event]], start: float, end: float) -> dict[str, Any]:
    """Seconds from publish to applied on the last other peer, for updates published in the window."""
    published = publications(events_by_peer)
    applied = applications(events_by_peer)
    delays, reached = [], []
    for key, (t, publisher) in published.items():
        if not start <= t <= end:
            continue
        at = {p: a for p, a in applied.get(key, {}).items() if p != publisher}
        if at:
            delays.append(max(at.values()) - t)
            reached.append(len(at))
    return {
        "updates": len(delays),
        "p50": percentile(delays, 0.5),
        "p99": percentile(delays, 0.99),
        "max": max(delays, default=None),
        "peers_reached_median": statistics.median(reached) if reached else None,
    }


def traffic(
    events_by_peer: Mapping[str, Sequence[Event]], start: float, end: float, update_bytes: float
) -> dict[str, Any]:
    """Per peer bytes per merged update, the busiest peer, the publishers' fan-out with `update_bytes`
    one update's frame (module docstring)."""
    published = {k: v for k, v in publications(events_by_peer).items() if start <= v[0] <= end}
    merged = len(published)
    applied = applications(events_by_peer)
    by_publisher: dict[str, int] = {}  # each peer's own published lines (two may publish one version)
    for at in _first_times(events_by_peer, "published").values():
        for peer, t in at.items():
            if start <= t <= end:
                by_publisher[peer] = by_publisher.get(peer, 0) + 1
    claims = [
        (e.get("shard", 0), e.get("term"), peer)
        for peer, events in events_by_peer.items()
        for e in events
        if e.get("event") == "claim" and isinstance(e.get("t"), int | float) and start <= e["t"] <= end
    ]
    claimers: dict[tuple[Any, Any], set[str]] = {}
    for shard, term, peer in claims:
        claimers.setdefault((shard, term), set()).add(peer)
    peers: dict[str, dict[str, float]] = {}
    per_copy = []
    for peer, events in events_by_peer.items():
        c = counters_in_window(events, start, end)
        got = sum(1 for k, at in applied.items() if k in published and peer in at)
        peers[peer] = {
            "bytes_sent": c["bytes_sent"],
            "bytes_received": c["bytes_received"],
            "sent_per_update": c["bytes_sent"] / merged if merged else 0.0,
            "received_per_update": c["bytes_received"] / merged if merged else 0.0,
            "published": by_publisher.get(peer, 0),
            "applied": got,
        }
        if peer not in by_publisher and got:
            per_copy.append(c["bytes_received"] / got)
    fanout = {
        peer: peers[peer]["bytes_sent"] / (n * update_bytes)
        for peer, n in by_publisher.items()
        if n >= max(1, merged // 10)  # a holder of a good part of the window, not a brief one
    }
    busiest = max(peers, key=lambda p: peers[p]["bytes_sent"] + peers[p]["bytes_received"], default=None)
    row = peers.get(busiest, {}) if busiest else {}
    return {
        "merged_updates": merged,
        "claims": len(claims),  # elections in the window: more than one per term is a split election
        "terms_claimed": len(claimers),  # (shard, term) pairs
        # (shard, term) pairs claimed by two peers or more: a split election
        "terms_held_twice": sum(1 for peers_of in claimers.values() if len(peers_of) > 1),
        "update_bytes": update_bytes,
        "received_per_applied_median": statistics.median(per_copy) if per_copy else None,
        "per_peer": peers,
        "busiest": busiest,
        "busiest_bytes_per_update": (row["bytes_sent"] + row["bytes_received"]) / merged
        if row and merged
        else None,
        "publisher_fanout": fanout,
        "publisher_fanout_max": max(fanout.values(), default=None),
    }


def _relay_at(events: Sequence[Event], t: float) -> Mapping[str, Any]:
    """The ``relay`` counters (`swarm.relay.RelayStats`) of the last progress event at or before `t`."""
    found: Mapping[str, Any] = {}
    for event in events:
        stamp = event.get("t")
        if isinstance(stamp, int | float) and stamp > t:
            break
        if event.get("event") == "progress" and isinstance(event.get("relay"), Mapping):
            found = event["relay"]
    return found


def relay_counts(events_by_peer: Mapping[str, Sequence[Event]], start: float, end: float) -> dict[str, Any]:
    """Per peer, what its relay counters (progress events' ``relay``, present once updates are relayed)
    grew by in the window (a restarted process's counters from 0), and each publisher's pushes per update
    it published; {} when no peer reports them."""
    peers: dict[str, dict[str, float]] = {}
    for peer, events in events_by_peer.items():
        first, last = _relay_at(events, start), _relay_at(events, end)
        if not last:
            continue
        grew = {}
        for name in ("published", "publish_pushes", "relayed", "update_bytes_sent", "offers_sent"):
            a, b = first.get(name, 0), last.get(name, 0)
            if isinstance(a, int | float) and isinstance(b, int | float):
                grew[name] = b - a if b >= a else b
        grew["max_hop"] = last.get("max_hop", 0)
        peers[peer] = grew
    if not peers:
        return {}
    pushes = {p: c["publish_pushes"] / c["published"] for p, c in peers.items() if c.get("published", 0) > 0}
    return {
        "per_peer": peers,
        "publisher_pushes_per_update": pushes,
        "max_hop": max((c["max_hop"] for c in peers.values()), default=0),
    }
