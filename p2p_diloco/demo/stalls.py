"""Stalls around synchronizer kills: how long the global model stood still, and how soon the new holder
took work. Pure functions of timelines (seconds since the run's start): no files, no clock.

Per SIGKILL of the synchronizer at time k (`sync_kill_stalls`):

* ``stall`` = first global update after k - last global update at or before k (the global updates are
  `accounting.version_advances`: first sightings of each (fragment, version)). With no update after k
  in the run, the stall runs to the end of the window and ``resolved`` is False; with none before k,
  it is measured from the window's start.
* ``to_first_accept`` = the first remote delta accepted after k by a peer other than the killed one,
  minus k: the time until the new holder was taking learners' work again. Peers report, in their
  progress events, the time of the first delta they accepted in each synchronizer term
  (``first_accepts``: ``[[term, t, shard], ...]``, `node.threads.DeltaAccepts`; older reports omit the
  shard, which is then 0); a holder's own deltas never cross the network and do not count. With
  synchronizer shards the demo's "synchronizer" is the peer that published last, of any shard: a kill
  row carries the shards whose newest update before the kill was the victim's (`held_shards`), and
  only those shards' accepts count (the other shards' holders take deltas all along, and every shard
  numbers its terms on its own).

`stall_summary` gives worst and median of both over a run's synchronizer kills.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Event = Mapping[str, Any]


def first_accepts(events_by_peer: Mapping[str, Sequence[Event]]) -> list[dict[str, Any]]:
    """``[{"t", "term", "peer", "shard"}]`` by time: per peer, shard and term, the earliest first-accept
    time reported in that peer's ``progress`` events (absolute times, as in the events)."""
    found: dict[tuple[str, int, int], float] = {}
    for peer, events in events_by_peer.items():
        for event in events:
            if event.get("event") != "progress":
                continue
            for row in event.get("first_accepts") or ():
                try:
                    term, t = int(row[0]), float(row[1])
                    shard = int(row[2]) if len(row) > 2 else 0
                except (TypeError, ValueError, IndexError):
                    continue
                key = (peer, shard, term)
                found[key] = min(t, found.get(key, t))
    return sorted(
        ({"t": t, "term": term, "peer": peer, "shard": shard} for (peer, shard, term), t in found.items()),
        key=lambda a: a["t"],
    )


def stall_at(advances: Sequence[float], kill: float, *, end: float, start: float = 0.0) -> dict[str, Any]:
    """The stall around a kill at `kill` (module docstring): ``{"last_before", "first_after", "stall",
    "resolved"}``; `advances` are global-update times in the same time base."""
    before = [a for a in advances if a <= kill]
    after = [a for a in advances if a > kill]
    last_before = max(before) if before else start
    first_after = min(after) if after else None
    stall = (first_after if first_after is not None else end) - last_before
    return {
        "last_before": max(before) if before else None,
        "first_after": first_after,
        "stall": stall,
        "resolved": first_after is not None,
    }


def held_shards(published: Iterable[Event], holder: str, before: float, shards: int) -> list[int]:
    """The shards whose newest update published at or before `before` was `holder`'s (its peer ID): what a
    kill of `holder` at `before` fails over. `published`: ``published`` events (``fragment``, ``leader``,
    ``t`` in the time base of `before`); fragment p belongs to shard p mod `shards`."""
    newest: dict[int, tuple[float, str]] = {}
    for event in published:
        if event.get("event") != "published" or float(event["t"]) > before:
            continue
        shard = int(event["fragment"]) % shards
        t = float(event["t"])
        if shard not in newest or t > newest[shard][0]:
            newest[shard] = (t, str(event.get("leader")))
    return sorted(shard for shard, (_, leader) in newest.items() if leader == holder)


def first_accept_after(
    accepts: Iterable[Mapping[str, Any]], kill: float, killed: str | None, shards: Iterable[int] | None = None
) -> Mapping[str, Any] | None:
    """The earliest accept (`first_accepts` rows, same time base as `kill`) after `kill` by another peer,
    of one of `shards` (None or empty: of any shard)."""
    wanted = set(shards or ())
    later = [
        a
        for a in accepts
        if a["t"] > kill and a.get("peer") != killed and (not wanted or a.get("shard", 0) in wanted)
    ]
    return min(later, key=lambda a: a["t"]) if later else None


def sync_kill_stalls(
    kills: Sequence[Mapping[str, Any]],
    advances: Sequence[float],
    accepts: Sequence[Mapping[str, Any]],
    *,
    end: float,
) -> list[dict[str, Any]]:
    """One row per synchronizer kill (``kills`` rows with ``synchronizer`` true, or the older
    ``why == "the current synchronizer"``): ``{"t", "learner", "shards", "stall", "last_before",
    "first_after", "resolved", "first_accept", "to_first_accept", "new_holder", "term"}``; a kill's
    ``shards`` (`held_shards`, absent in older reports) limit the accepts that time it. `advances`,
    `accepts` and the kill times share one time base (seconds since the run's start in the report)."""
    rows = []
    for kill in kills:
        if "skipped" in kill or not is_sync_kill(kill):
            continue
        t = float(kill["t"])
        row: dict[str, Any] = {"t": t, "learner": kill.get("learner"), "shards": kill.get("shards")}
        row.update(stall_at(advances, t, end=end))
        accept = first_accept_after(accepts, t, kill.get("learner"), kill.get("shards"))
        row["first_accept"] = accept["t"] if accept else None
        row["to_first_accept"] = accept["t"] - t if accept else None
        row["new_holder"] = accept.get("peer") if accept else None
        row["term"] = accept.get("term") if accept else None
        rows.append(row)
    return rows


def is_sync_kill(kill: Mapping[str, Any]) -> bool:
    return bool(kill.get("synchronizer")) or kill.get("why") == "the current synchronizer"


def _worst_median(values: Sequence[float]) -> tuple[float | None, float | None]:
    return (max(values), statistics.median(values)) if values else (None, None)


def stall_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{"sync_kills", "worst_stall", "median_stall", "unresolved", "worst_to_first_accept",
    "median_to_first_accept", "without_accept"}`` over `sync_kill_stalls` rows (None when no kill)."""
    stalls = [float(r["stall"]) for r in rows]
    accepts = [float(r["to_first_accept"]) for r in rows if r.get("to_first_accept") is not None]
    worst, median = _worst_median(stalls)
    worst_accept, median_accept = _worst_median(accepts)
    return {
        "sync_kills": len(rows),
        "worst_stall": worst,
        "median_stall": median,
        "unresolved": sum(1 for r in rows if not r.get("resolved", True)),
        "worst_to_first_accept": worst_accept,
        "median_to_first_accept": median_accept,
        "without_accept": sum(1 for r in rows if r.get("to_first_accept") is None),
    }
