"""Stalls around synchronizer kills (`p2p_diloco.demo.stalls`) and the report lines and uptime they go
with, on hand-made timelines (seconds since the run's start)."""

from __future__ import annotations

import pytest

from p2p_diloco.demo import stalls
from p2p_diloco.demo.report import stall_lines

SYNC_KILL = {"t": 20.0, "learner": "learner-1", "action": "kill_sync", "why": "the current synchronizer",
             "synchronizer": True}  # fmt: skip
LEARNER_KILL = {"t": 40.0, "learner": "learner-2", "action": "kill_learner", "why": "scheduled learner"}


def progress(t: float, first_accepts: list) -> dict:
    return {"t": t, "event": "progress", "first_accepts": first_accepts}


def test_stall_runs_from_the_last_update_before_the_kill_to_the_first_after_it():
    advances = [1.0, 5.0, 18.5, 19.0, 23.5, 24.0, 30.0]
    assert stalls.stall_at(advances, 20.0, end=60.0) == {
        "last_before": 19.0, "first_after": 23.5, "stall": pytest.approx(4.5), "resolved": True
    }  # fmt: skip
    # an update at the very moment of the kill counts as before it
    assert stalls.stall_at([10.0, 20.0, 21.0], 20.0, end=60.0)["stall"] == pytest.approx(1.0)
    # nothing after the kill: the stall runs to the end of the window, unresolved
    open_ended = stalls.stall_at([10.0, 12.0], 20.0, end=60.0)
    assert open_ended["stall"] == pytest.approx(48.0) and not open_ended["resolved"]
    # nothing before: measured from the window's start
    assert stalls.stall_at([25.0], 20.0, end=60.0)["stall"] == pytest.approx(25.0)


def test_first_accepts_take_each_peers_earliest_report_per_term():
    events = {
        "a": [progress(10, []), progress(11, [[3, 100.5]]), progress(12, [[3, 100.5], [5, 130.0]])],
        "b": [
            progress(10, [[4, 121.0]]),
            {"t": 11, "event": "published"},
            progress(12, [["bad"], [4, 121.0]]),
        ],
    }
    assert stalls.first_accepts(events) == [
        {"t": 100.5, "term": 3, "peer": "a", "shard": 0},
        {"t": 121.0, "term": 4, "peer": "b", "shard": 0},
        {"t": 130.0, "term": 5, "peer": "a", "shard": 0},
    ]


def test_with_shards_a_sync_kill_is_timed_by_the_accepts_of_the_shards_the_victim_held():
    """Shards number their terms on their own: the new shard-3 holder's term 4 is not hidden by its earlier
    term 4 of shard 1, and the other shards' holders (accepting all along) do not count."""
    published = [
        {"t": 10.0, "event": "published", "fragment": 3, "leader": "Qm1"},  # shard 3: learner-1's
        {"t": 12.0, "event": "published", "fragment": 0, "leader": "Qm1"},  # shard 0: learner-1's, then
        {"t": 15.0, "event": "published", "fragment": 4, "leader": "Qm0"},  # learner-0's (fragment 4 mod 4)
        {"t": 25.0, "event": "published", "fragment": 3, "leader": "Qm0"},  # after the kill: not counted
    ]
    assert stalls.held_shards(published, "Qm1", 20.0, 4) == [3]
    assert stalls.held_shards(published, "Qm0", 20.0, 4) == [0]
    assert stalls.held_shards(published, "Qm2", 20.0, 4) == []
    events = {
        "learner-0": [progress(10, [[4, 5.0, 1]]), progress(30, [[4, 5.0, 1], [4, 22.5, 3]])],
        "learner-2": [progress(30, [[7, 21.0, 2]])],  # shard 2's holder, a first accept of a new term
    }
    accepts = stalls.first_accepts(events)
    assert {(a["peer"], a["shard"], a["term"]) for a in accepts} == {
        ("learner-0", 1, 4), ("learner-0", 3, 4), ("learner-2", 2, 7)
    }  # fmt: skip
    (row,) = stalls.sync_kill_stalls([{**SYNC_KILL, "shards": [3]}], [19.0, 20.5], accepts, end=60.0)
    assert row["new_holder"] == "learner-0" and row["to_first_accept"] == pytest.approx(2.5)
    assert row["shards"] == [3]
    # an older report's kill (no shards): the first accept of any shard, as before
    (old,) = stalls.sync_kill_stalls([SYNC_KILL], [19.0, 20.5], accepts, end=60.0)
    assert old["new_holder"] == "learner-2" and old["to_first_accept"] == pytest.approx(1.0)


def test_sync_kill_rows_time_the_new_holders_first_accepted_delta():
    advances = [2.0, 19.5, 22.0, 41.0, 42.0]
    accepts = [
        {"t": 3.0, "term": 1, "peer": "learner-1"},
        {"t": 20.5, "term": 2, "peer": "learner-1"},  # the killed peer itself (a stale report): ignored
        {"t": 21.2, "term": 2, "peer": "learner-0"},
        {"t": 50.0, "term": 3, "peer": "learner-2"},
    ]
    rows = stalls.sync_kill_stalls([SYNC_KILL, LEARNER_KILL, {"t": 30.0, "skipped": "all down"}], advances,
                                   accepts, end=60.0)  # fmt: skip
    assert len(rows) == 1  # the learner kill and the skipped fault are no synchronizer kills
    row = rows[0]
    assert row["stall"] == pytest.approx(2.5) and row["first_after"] == 22.0
    assert (
        row["to_first_accept"] == pytest.approx(1.2) and row["new_holder"] == "learner-0" and row["term"] == 2
    )
    # older reports name sync kills by their reason only
    old_style = {k: v for k, v in SYNC_KILL.items() if k != "synchronizer"}
    assert stalls.sync_kill_stalls([old_style], advances, accepts, end=60.0)[0]["stall"] == pytest.approx(2.5)


def test_summary_gives_worst_and_median_and_counts_kills_without_an_accept():
    rows = [
        {"stall": 1.0, "to_first_accept": 0.5, "resolved": True},
        {"stall": 4.0, "to_first_accept": None, "resolved": True},
        {"stall": 2.0, "to_first_accept": 1.5, "resolved": False},
    ]
    summary = stalls.stall_summary(rows)
    assert summary == {
        "sync_kills": 3, "worst_stall": 4.0, "median_stall": 2.0, "unresolved": 1,
        "worst_to_first_accept": 1.5, "median_to_first_accept": 1.0, "without_accept": 1,
    }  # fmt: skip
    assert stalls.stall_summary([])["worst_stall"] is None


def test_report_lines_name_each_kill_and_the_worst_and_median():
    advances = [2.0, 19.5, 22.0]
    rows = stalls.sync_kill_stalls(
        [SYNC_KILL], advances, [{"t": 21.0, "term": 2, "peer": "learner-0"}], end=60.0
    )
    lines = stall_lines({"stalls": rows, "stall_summary": stalls.stall_summary(rows)})
    assert lines[0] == (
        "sync kill at 20.0 s (learner-1): stall 2.5 s, first delta accepted by the new holder after 1.0 s "
        "(learner-0, term 2)"
    )
    assert lines[1].startswith("stall per sync kill: worst 2.5 s, median 2.5 s")
    assert stall_lines({"stalls": [], "stall_summary": {}}) == []
