"""The long chaos mode's verdicts (``demo --chaos-every``): was any global state lost? Pure functions of
event logs, status rows and version lists; the orchestrator's end of run (`demo.endgame`) gathers them.

* `versions_went_back`: the replicated global state never went back. An update counts once a peer other
  than its publisher applied it (``applied`` events). Violations: a holder published, and some peer
  applied, a version at or below one another update (term, leader) had already replicated (it started
  from older state than the swarm had: ``republished``); two different updates of one version both replicated
  (``forked``); within one process lifetime (from a ``start`` event) a peer's reported versions decreased,
  dropping a version that was replicated or that it got by snapshot (``replica went back``; a holder fenced
  off by its followers, whose own updates nobody applied, drops them when it steps down: not global state).
  Returns them (empty: never went back).
* `digest_agreement`: replicas that report the same version of a fragment must report the same
  checksum of it (``tips``), and peers at the same versions of every fragment the same replica digest.
* `resume_check`: after all peers were stopped together and restarted from their state dirs, each one
  resumed from the versions it had at the stop (none from 0), and the swarm from its last versions.
* `faults_by_kind`: executed faults per kind, and the skipped ones.
* `newcomer_check`: a fresh peer through a just-restarted bootstrap node reached the swarm's versions
  within 2 heartbeat periods of its start and never published from 0 (`demo.newcomers` starts it).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

Event = Mapping[str, Any]


def _versions(value: object) -> tuple[int, ...] | None:
    if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def _update_rows(events_by_peer: Mapping[str, Sequence[Event]], kind: str) -> list[tuple]:
    """(t, fragment, version, (term, leader), peer) of every `kind` event, by time."""
    rows = [
        (float(e["t"]), int(e["fragment"]), int(e["version"]), (e.get("term"), e.get("leader")), peer)
        for peer, events in events_by_peer.items()
        for e in events
        if e.get("event") == kind and all(k in e for k in ("t", "fragment", "version"))
    ]
    return sorted(rows, key=lambda row: row[0])


def _dropped_global(
    made_by: Mapping[tuple[int, int], tuple], replicated: set, p: int, versions: range
) -> bool:
    """Whether versions a peer dropped of fragment `p` were global state: any of them replicated, or got
    without an update this peer saw (a snapshot). Its own updates nobody else applied are not."""
    return any((update := made_by.get((p, v))) is None or (p, v, update) in replicated for v in versions)


def versions_went_back(events_by_peer: Mapping[str, Sequence[Event]]) -> list[dict[str, Any]]:
    """Every place a version went back (module docstring), by time.

    The global state is what was replicated: an update some peer other than its publisher applied
    (an ``applied`` event: pushed to it, checked, applied). An update a holder published that nobody
    else applied (refused as not validly leased, or lost with its publisher) is not global state.
    """
    first_replicated: dict[tuple[int, int, tuple], float] = {}  # (fragment, version, update) -> first t
    for t, fragment, version, update, _peer in _update_rows(events_by_peer, "applied"):
        first_replicated.setdefault((fragment, version, update), t)
    problems = _forked(first_replicated) + _republished(events_by_peer, first_replicated)
    replicated_updates = set(first_replicated)
    for peer, events in events_by_peer.items():
        problems += _replica_went_back(peer, events, replicated_updates)
    return sorted(problems, key=lambda p: float(p.get("t") or 0.0))


def _forked(first_replicated: Mapping[tuple[int, int, tuple], float]) -> list[dict[str, Any]]:
    """Versions of a fragment that two different updates made, both replicated."""
    by_version: dict[tuple[int, int], set] = defaultdict(set)
    for fragment, version, update in first_replicated:
        by_version[(fragment, version)].add(update)
    return [
        {
            "t": max(first_replicated[(fragment, version, u)] for u in updates),
            "kind": "forked",
            "fragment": fragment,
            "version": version,
            "updates": sorted(map(list, updates), key=str),
        }
        for (fragment, version), updates in sorted(by_version.items())
        if len(updates) > 1
    ]


def _republished(
    events_by_peer: Mapping[str, Sequence[Event]], first_replicated: Mapping[tuple[int, int, tuple], float]
) -> list[dict[str, Any]]:
    """Replicated updates published at or below a version another update had already replicated."""
    problems = []
    for t, fragment, version, update, peer in _update_rows(events_by_peer, "published"):
        if (fragment, version, update) not in first_replicated:
            continue  # nobody else applied it (fenced off, e.g. a holder cut off from the DHT): not global
        older = [
            (v, u)
            for (f, v, u), t_r in first_replicated.items()
            if f == fragment and v >= version and u != update and t_r < t
        ]
        if older:
            v, u = max(older, key=lambda vu: vu[0])
            problems.append(
                {
                    "t": t,
                    "kind": "republished",
                    "peer": peer,
                    "fragment": fragment,
                    "version": version,
                    "term": update[0],
                    "after": v,
                    "after_term": u[0],
                }
            )
    return problems


def _replica_went_back(peer: str, events: Sequence[Event], replicated: set) -> list[dict[str, Any]]:
    """Within one process lifetime (from a ``start``), `peer`'s versions decreasing past global state."""
    problems = []
    current: tuple[int, ...] | None = None
    made_by: dict[tuple[int, int], tuple] = {}  # (fragment, version) -> the update that made it here
    for e in events:
        kind = e.get("event")
        if kind in ("published", "applied") and all(k in e for k in ("fragment", "version")):
            made_by[(int(e["fragment"]), int(e["version"]))] = (e.get("term"), e.get("leader"))
        if kind == "start":
            current = _versions(e.get("versions"))
        elif kind == "progress" and (seen := _versions(e.get("versions"))) is not None:
            if current is not None and len(current) == len(seen):
                back = [
                    p
                    for p, (a, b) in enumerate(zip(current, seen, strict=True))
                    if b < a and _dropped_global(made_by, replicated, p, range(b + 1, a + 1))
                ]
                if back:
                    problems.append(
                        {
                            "t": e.get("t"),
                            "kind": "replica went back",
                            "peer": peer,
                            "fragments": back,
                            "from": list(current),
                            "to": list(seen),
                        }
                    )
            current = seen
    return problems


def digest_agreement(peers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Agreement of replicas from status rows ``{"peer", "versions", "digest", "tips"}`` (``tips``: per
    fragment ``[term, checksum]``; may be empty). ``agree`` is True when no two peers at the same
    version of a fragment (or at the same versions of all) report different checksums (or digests)."""
    groups: dict[tuple[int, ...], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    by_fragment: dict[tuple[int, int], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for row in peers:
        versions = _versions(row.get("versions"))
        if versions is None:
            continue
        groups[versions][str(row.get("digest", ""))].append(str(row.get("peer")))
        tips = row.get("tips") or []
        if len(tips) == len(versions):
            for fragment, (version, tip) in enumerate(zip(versions, tips, strict=True)):
                by_fragment[(fragment, version)][str(tip[1])].append(str(row.get("peer")))
    disagreements = [
        {"fragment": fragment, "version": version, "checksums": dict(found)}
        for (fragment, version), found in sorted(by_fragment.items())
        if len(found) > 1
    ]
    disagreements += [
        {"versions": list(versions), "digests": dict(found)}
        for versions, found in sorted(groups.items())
        if len(found) > 1
    ]
    largest = max(groups.items(), key=lambda kv: sum(len(v) for v in kv[1].values()), default=None)
    return {
        "peers": sum(sum(len(v) for v in found.values()) for found in groups.values()),
        "agree": bool(groups) and not disagreements,
        "version_groups": len(groups),
        "largest_group": (
            {
                "versions": list(largest[0]),
                "peers": sum(len(v) for v in largest[1].values()),
                "digests": sorted(largest[1]),
            }
            if largest
            else None
        ),
        "fragment_versions_compared": sum(
            1 for found in by_fragment.values() if sum(len(v) for v in found.values()) > 1
        ),
        "disagreements": disagreements,
    }


def resume_check(
    before: Mapping[str, Sequence[int] | None], after: Mapping[str, Sequence[int] | None]
) -> dict[str, Any]:
    """`before`: each peer's versions when all were stopped (persisted); `after`: the versions each one
    restored at its restart (None: it did not come back). ``resumed`` is True when every peer came back
    at exactly its versions, none at all zeros, and the swarm's (element-wise max) versions are the same."""
    rows, ok = {}, bool(before)
    for name, was in sorted(before.items()):
        now = after.get(name)
        same = was is not None and now is not None and list(now) == list(was)
        from_zero = now is not None and not any(now)
        rows[name] = {
            "stopped_at": None if was is None else list(was),
            "restarted_at": None if now is None else list(now),
            "same": same,
            "from_zero": from_zero,
        }
        ok = ok and same and not from_zero
    swarm_before = _elementwise_max([v for v in before.values() if v is not None])
    swarm_after = _elementwise_max([v for v in after.values() if v is not None])
    return {
        "resumed": ok and swarm_before == swarm_after and swarm_before is not None,
        "swarm_before": swarm_before,
        "swarm_after": swarm_after,
        "peers": rows,
    }


def _elementwise_max(rows: Sequence[Sequence[int]]) -> list[int] | None:
    rows = [list(r) for r in rows if r]
    if not rows or len({len(r) for r in rows}) != 1:
        return None
    return [max(column) for column in zip(*rows, strict=True)]


def faults_by_kind(kills: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{"executed": {kind: n}, "skipped": {kind: n}, "total": n}`` from the run's fault log."""
    executed = Counter(str(k.get("action")) for k in kills if "skipped" not in k)
    skipped = Counter(str(k.get("action")) for k in kills if "skipped" in k)
    return {
        "executed": dict(sorted(executed.items())),
        "skipped": dict(sorted(skipped.items())),
        "total": sum(executed.values()),
    }


def newcomer_check(
    newcomer: Sequence[Event], swarm: Mapping[str, Sequence[Event]], heartbeat_period: float
) -> dict[str, Any]:
    """A fresh peer started through the bootstrap node right after its restart (#31): its ``start`` event,
    the swarm's versions then (element-wise max of the learners' ``progress`` events up to that time),
    when its own versions (``catch_up`` ``after`` or ``progress``, raised by each ``applied``, ``replayed``
    or ``published`` update in between) first reached them, and whether it ever
    published a version of a branch of its own from 0 (a ``published`` version 1). ``ok``: it reached them
    within 2 heartbeat periods of its start and never did that."""
    start = next((e for e in newcomer if e.get("event") == "start" and "t" in e), None)
    from_zero = [e for e in newcomer if e.get("event") == "published" and e.get("version") == 1]
    row: dict[str, Any] = {"started": None, "swarm_at_start": None, "reached_after": None}
    row["published_from_zero"] = len(from_zero)
    if start is None:
        return {**row, "ok": False, "why": "it never started"}
    t0 = float(start["t"])
    row["started"] = t0
    target = row["swarm_at_start"] = _swarm_versions_at(swarm, t0)
    reached = _first_reaching(newcomer[newcomer.index(start) :], target) if target is not None else None
    if reached is not None:
        e, mine = reached
        row["reached_after"] = round(float(e.get("t", t0)) - t0, 2)
        row["reached_versions"] = mine
    bound = 2 * heartbeat_period
    row["bound"] = bound
    in_time = row["reached_after"] is not None and row["reached_after"] <= bound
    row["ok"] = in_time and not from_zero
    if not row["ok"]:
        row["why"] = (
            f"published {len(from_zero)} version(s) of its own branch from 0"
            if from_zero
            else f"reached the swarm's versions after {row['reached_after']} s (bound {bound} s)"
        )
    return row


def _swarm_versions_at(swarm: Mapping[str, Sequence[Event]], t: float) -> list[int] | None:
    """The element-wise max of the versions the swarm's ``progress`` events reported up to `t`."""
    return _elementwise_max(
        [
            v
            for events in swarm.values()
            for e in events
            if e.get("event") == "progress"
            and float(e.get("t", 0)) <= t
            and (v := _versions(e.get("versions")))
        ]
    )


def _first_reaching(events: Sequence[Event], target: Sequence[int]) -> tuple[Event, list[int]] | None:
    """The first event after which the peer's versions are all at least `target`, and those versions.

    Its versions are what it reports (``start``, ``progress``, ``catch_up`` ``after``), raised by each
    update it applied, replayed or published in between (when it applied it, not at its next progress).
    """
    mine: list[int] | None = None
    for e in events:
        kind = e.get("event")
        fragment, version = e.get("fragment"), e.get("version")
        if kind in ("start", "catch_up", "progress"):
            reported = _versions(e.get("after") if kind == "catch_up" else e.get("versions"))
            mine = list(reported) if reported is not None else mine
        elif (
            kind in ("applied", "published", "replayed")
            and mine is not None
            and isinstance(fragment, int)
            and isinstance(version, int)
            and 0 <= fragment < len(mine)
        ):
            mine[fragment] = max(mine[fragment], version)
        else:
            continue
        if (
            mine is not None
            and len(mine) == len(target)
            and all(m >= n for m, n in zip(mine, target, strict=True))
        ):
            return e, list(mine)
    return None
