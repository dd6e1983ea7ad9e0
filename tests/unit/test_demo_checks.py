"""The long chaos mode's pure parts: the seeded schedule (`demo.chaos.long_chaos_schedule`) and the
end-of-run verdicts (`demo.checks`: versions never went back, replicas agree, resume after a full
restart, faults by kind), on hand-made logs."""

from __future__ import annotations

import pytest

from p2p_diloco.demo import checks
from p2p_diloco.demo.chaos import (
    DOWN_SECONDS,
    KILL_BOOTSTRAP,
    KILL_LEARNER,
    KILL_SYNC,
    LONG_KINDS,
    STOP_LEARNER,
    chaos_schedule,
    long_chaos_schedule,
)
from p2p_diloco.demo.faults import is_current
from p2p_diloco.demo.report import check_lines, newcomer_line

# ---- the schedule ----------------------------------------------------------------------------------


def test_long_schedule_is_seeded_and_covers_the_whole_run():
    first = long_chaos_schedule(3, 300, seed=7, every=15)
    assert first == long_chaos_schedule(3, 300, seed=7, every=15)
    assert first != long_chaos_schedule(3, 300, seed=8, every=15)
    assert first.every == 15 and first.slow_learner == 2
    times = [f.at for f in first.faults]
    assert times == sorted(times) and len(times) == 19  # k * 15 for k = 1..19, the last <= 298
    for k, t in enumerate(times, start=1):
        assert abs(t - 15 * k) <= 0.15 * 15 + 0.05
    assert times[-1] <= 300 - 2
    for fault in first.faults:
        low, high = DOWN_SECONDS[fault.action]
        assert low <= fault.down <= high and 0 <= fault.learner < 3


def test_every_four_consecutive_faults_of_a_block_cover_every_kind():
    schedule = long_chaos_schedule(2, 400, seed=1, every=10)
    kinds = [f.action for f in schedule.faults]
    for start in range(0, len(kinds) - 3, 4):
        assert sorted(kinds[start : start + 4]) == sorted(LONG_KINDS)
    orders = {tuple(kinds[i : i + 4]) for i in range(0, len(kinds) - 3, 4)}
    assert len(orders) > 1  # shuffled per block, not one fixed order
    short = long_chaos_schedule(3, 40, seed=0, every=8)
    assert len(short.faults) == 4 and set(f.action for f in short.faults) == set(LONG_KINDS)


def test_long_schedule_refuses_bad_arguments_and_the_short_one_is_unchanged():
    with pytest.raises(ValueError, match="at least 2"):
        long_chaos_schedule(1, 100, seed=0, every=10)
    with pytest.raises(ValueError, match="> 0"):
        long_chaos_schedule(2, 100, seed=0, every=0)
    assert long_chaos_schedule(2, 5, seed=0, every=10).faults == ()
    short = chaos_schedule(4, 180, seed=3)
    assert short.every == 0 and [f.action for f in short.faults] == [KILL_SYNC, KILL_LEARNER, KILL_SYNC]
    assert {STOP_LEARNER, KILL_BOOTSTRAP} <= set(LONG_KINDS)


# ---- versions never went back ---------------------------------------------------------------------


def published(t: float, fragment: int, version: int, term: int, leader: str = "QmA") -> dict:
    return {
        "t": t,
        "event": "published",
        "fragment": fragment,
        "version": version,
        "term": term,
        "leader": leader,
    }


def applied(t: float, fragment: int, version: int, term: int, leader: str = "QmA") -> dict:
    return {**published(t, fragment, version, term, leader), "event": "applied"}


def progress(t: float, versions: list[int]) -> dict:
    return {"t": t, "event": "progress", "versions": versions}


def test_a_clean_run_with_failover_and_restart_never_went_back():
    events = {
        "a": [{"t": 0, "event": "start", "versions": [0, 0]}, published(1, 0, 1, 1), progress(1.5, [1, 0]),
              published(2, 1, 1, 1), progress(2.5, [1, 1])],
        # b restarts from an older persisted state: a new lifetime, not a step back; then takes over
        "b": [{"t": 0, "event": "start", "versions": [0, 0]}, applied(1.1, 0, 1, 1), applied(2.1, 1, 1, 1),
              progress(2.5, [1, 1]), {"t": 3, "event": "start", "versions": [1, 0]}, progress(4, [2, 1]),
              published(3.5, 0, 2, 2, "QmB")],
    }  # fmt: skip
    assert checks.versions_went_back(events) == []


def test_an_update_nobody_else_applied_is_not_global_state():
    # a's term-2 claim was refused by everyone; b later wins term 2 and publishes the same version
    events = {
        "a": [published(1, 0, 1, 1), published(5, 0, 2, 2, "QmA")],
        "b": [applied(1.1, 0, 1, 1), published(9, 0, 2, 2, "QmB")],
        "c": [applied(1.2, 0, 1, 1), applied(9.1, 0, 2, 2, "QmB")],
    }
    assert checks.versions_went_back(events) == []


def test_a_holder_cut_off_from_the_swarm_publishing_old_versions_nobody_applies_has_lost_nothing():
    events = {
        "a": [published(1, 0, 1, 1), published(2, 0, 2, 1)],
        "b": [applied(1.1, 0, 1, 1), applied(2.1, 0, 2, 1)],
        "z": [published(3, 0, 1, 2, "QmZ"), published(4, 0, 2, 2, "QmZ")],  # refused by everyone
    }
    assert checks.versions_went_back(events) == []
    events["b"].append(applied(4.1, 0, 2, 2, "QmZ"))  # had b applied z's v2, it overwrote replicated state
    assert [p["kind"] for p in checks.versions_went_back(events)] == ["republished", "forked"]


def test_a_fenced_off_holder_dropping_its_own_unapplied_updates_has_not_gone_back():
    # a's renewals did not reach the others: they refused its term-1 updates v2 and v3, b took term 2 from
    # v1, and a reconciled onto b's branch (its versions went 3 -> 2): nothing replicated was dropped
    events = {
        "a": [progress(0.5, [0, 0]), published(1, 0, 1, 1), published(2, 0, 2, 1), published(3, 0, 3, 1),
              progress(3.5, [3, 0]), applied(6, 0, 2, 2, "QmB"), progress(6.5, [2, 0])],
        "b": [applied(1.1, 0, 1, 1), published(5, 0, 2, 2, "QmB")],
        "c": [applied(1.2, 0, 1, 1), applied(5.1, 0, 2, 2, "QmB")],
    }  # fmt: skip
    assert checks.versions_went_back(events) == []
    events["c"].insert(1, applied(2.2, 0, 2, 1))  # had c applied a's v2, b's term-2 v2 would overwrite it
    assert [p["kind"] for p in checks.versions_went_back(events)] == ["republished", "forked"]
    events["a"][-1] = progress(6.5, [1, 0])  # and a peer dropping a version it got from elsewhere went back
    assert "replica went back" in [p["kind"] for p in checks.versions_went_back(events)]


def test_overwriting_replicated_state_forks_and_a_replica_going_back_are_all_reported():
    events = {
        "a": [published(1, 0, 1, 1), published(2, 0, 2, 1), progress(2.5, [2, 0])],
        "b": [applied(2.1, 0, 2, 1), published(5, 0, 2, 2, "QmB"), progress(6, [2, 0]), progress(7, [1, 0])],
        "c": [applied(5.1, 0, 2, 2, "QmB")],
    }
    found = checks.versions_went_back(events)
    assert [p["kind"] for p in found] == ["republished", "forked", "replica went back"]
    assert found[0] == {"t": 5.0, "kind": "republished", "peer": "b", "fragment": 0, "version": 2, "term": 2,
                        "after": 2, "after_term": 1}  # fmt: skip
    assert found[1]["fragment"] == 0 and found[1]["version"] == 2 and len(found[1]["updates"]) == 2
    assert found[2]["fragments"] == [0] and found[2]["from"] == [2, 0] and found[2]["to"] == [1, 0]


# ---- replicas agree ----------------------------------------------------------------------------------


def row(peer: str, versions: list[int], digest: str, tips: list | None = None) -> dict:
    return {"peer": peer, "versions": versions, "digest": digest, "tips": tips or []}


def test_replicas_at_the_same_versions_agree_and_other_groups_are_not_compared():
    peers = [
        row("a", [3, 2], "d1", [[2, "c30"], [2, "c20"]]),
        row("b", [3, 2], "d1", [[2, "c30"], [2, "c20"]]),
        row("c", [3, 1], "d0", [[2, "c30"], [1, "c10"]]),  # behind on fragment 1; fragment 0 agrees
    ]
    verdict = checks.digest_agreement(peers)
    assert verdict["agree"] and verdict["peers"] == 3 and verdict["version_groups"] == 2
    assert verdict["largest_group"] == {"versions": [3, 2], "peers": 2, "digests": ["d1"]}
    assert verdict["fragment_versions_compared"] == 2  # (0, v3) by three peers, (1, v2) by two


def test_a_different_checksum_at_the_same_version_is_a_disagreement():
    peers = [
        row("a", [3, 2], "d1", [[2, "c30"], [2, "c20"]]),
        row("b", [3, 2], "d2", [[2, "c30"], [2, "XX"]]),
    ]
    verdict = checks.digest_agreement(peers)
    assert not verdict["agree"]
    assert {"fragment": 1, "version": 2, "checksums": {"c20": ["a"], "XX": ["b"]}} in verdict["disagreements"]
    assert {"versions": [3, 2], "digests": {"d1": ["a"], "d2": ["b"]}} in verdict["disagreements"]
    assert not checks.digest_agreement([])["agree"]  # nobody answered: nothing agreed


# ---- resume after stopping everyone ----------------------------------------------------------------


def test_resume_needs_every_peer_back_at_its_own_versions_and_none_from_zero():
    before = {"a": [5, 4], "b": [5, 4], "c": [4, 4]}
    good = checks.resume_check(before, {"a": [5, 4], "b": [5, 4], "c": [4, 4]})
    assert good["resumed"] and good["swarm_before"] == good["swarm_after"] == [5, 4]
    from_zero = checks.resume_check(before, {"a": [0, 0], "b": [5, 4], "c": [4, 4]})
    assert not from_zero["resumed"] and from_zero["peers"]["a"]["from_zero"]
    missing = checks.resume_check(before, {"a": [5, 4], "b": None, "c": [4, 4]})
    assert not missing["resumed"] and missing["peers"]["b"]["restarted_at"] is None
    older = checks.resume_check(before, {"a": [5, 3], "b": [5, 4], "c": [4, 4]})
    assert not older["resumed"] and not older["peers"]["a"]["same"]
    assert not checks.resume_check({}, {})["resumed"]


# ---- faults and the report's words -----------------------------------------------------------------


def test_faults_by_kind_and_the_report_lines():
    kills = [
        {"t": 8, "action": KILL_SYNC}, {"t": 16, "action": STOP_LEARNER}, {"t": 24, "action": KILL_BOOTSTRAP},
        {"t": 31, "action": KILL_SYNC}, {"t": 38, "action": KILL_LEARNER, "skipped": "no learner would stay up"},
    ]  # fmt: skip
    faults = checks.faults_by_kind(kills)
    assert faults == {"executed": {KILL_BOOTSTRAP: 1, KILL_SYNC: 2, STOP_LEARNER: 1},
                      "skipped": {KILL_LEARNER: 1}, "total": 4}  # fmt: skip
    found = {
        "faults": faults,
        "bootstrap_restarts": [{"t": 27.0, "up": 30.5, "same_address": True}],
        "replicas": checks.digest_agreement([row("a", [3, 2], "d1"), row("b", [3, 2], "d1")]),
        "versions_went_back": [],
        "resume": {**checks.resume_check({"a": [3, 2]}, {"a": [3, 2]}), "not_checked": ["c"]},
        "no_state_lost": True,
    }
    text = "\n".join(check_lines(found))
    assert "faults: kill_bootstrap 1, kill_sync 2, stop_learner 1; skipped {'kill_learner': 1}" in text
    assert "bootstrap restarted at 27.0 s: up again, same address" in text
    assert "replicas: 2 live peers (status), agree" in text and "versions never went back" in text
    assert "resumed at [3, 2] (stopped at [3, 2]); not checked: c" in text
    assert text.endswith("no global state lost: yes")


def test_a_learner_is_current_when_fresh_and_at_most_one_version_behind_the_newest():
    reports = {
        "a": (100.0, [5, 7]),
        "b": (99.5, [4, 6]),  # one behind on both: current
        "c": (99.0, [3, 7]),  # two behind on fragment 0 (e.g. just continued after SIGSTOP)
        "d": (90.0, [9, 9]),  # stale report: neither current nor counted as the newest
    }
    assert [n for n in reports if is_current(n, reports, 100.0)] == ["a", "b"]
    assert not is_current("zz", reports, 100.0)


# ---- a newcomer through a restarted bootstrap node (#31) --------------------------------------------

SWARM = {
    "learner-0": [
        {"event": "progress", "t": 100.0, "versions": [5, 4]},
        {"event": "progress", "t": 109.0, "versions": [6, 6]},
        {"event": "progress", "t": 130.0, "versions": [9, 9]},  # after the newcomer's start: not its target
    ],
    "learner-1": [{"event": "progress", "t": 108.0, "versions": [7, 5]}],
}


def test_a_newcomer_at_the_swarms_versions_within_two_heartbeats_and_never_from_zero_passes():
    newcomer = [
        {"event": "start", "t": 110.0, "versions": [0, 0]},
        {"event": "catch_up", "t": 111.5, "before": [0, 0], "after": [7, 6]},
        {"event": "published", "t": 115.0, "fragment": 0, "version": 8},
    ]
    row = checks.newcomer_check(newcomer, SWARM, heartbeat_period=1.0)
    assert row["swarm_at_start"] == [7, 6] and row["reached_after"] == 1.5 and row["bound"] == 2.0
    assert row["ok"] and row["published_from_zero"] == 0
    line = newcomer_line({"name": "newcomer-1", "launched": 42.0, **row})
    assert "newcomer-1" in line and "[7, 6] 1.5 s after its start" in line and line.endswith(" ok")


def test_a_newcomer_reaches_the_swarm_when_it_applies_the_missing_update_not_at_its_next_progress():
    newcomer = [
        {"event": "start", "t": 110.0, "versions": [0, 0]},
        {"event": "catch_up", "t": 110.4, "before": [0, 0], "after": [7, 5]},  # its source was one behind
        {"event": "applied", "t": 110.5, "fragment": "1", "version": 9},  # not a fragment number: ignored
        {"event": "applied", "t": 110.6, "fragment": 1, "version": 6},
        {"event": "progress", "t": 112.1, "versions": [7, 6]},
    ]
    row = checks.newcomer_check(newcomer, SWARM, heartbeat_period=1.0)
    assert row["reached_after"] == 0.6 and row["reached_versions"] == [7, 6] and row["ok"], row


@pytest.mark.parametrize(
    "newcomer, why",
    [
        (  # caught up, but too late: 3 s after its start with a 1 s heartbeat
            [{"event": "start", "t": 110.0}, {"event": "progress", "t": 113.0, "versions": [7, 6]}],
            "after 3.0 s",
        ),
        (  # an island: it trained its own branch from version 0
            [
                {"event": "start", "t": 110.0},
                {"event": "published", "t": 110.5, "fragment": 1, "version": 1},
                {"event": "progress", "t": 111.0, "versions": [7, 6]},
            ],
            "from 0",
        ),
        ([{"event": "progress", "t": 113.0, "versions": [7, 6]}], "never started"),
        ([{"event": "start", "t": 110.0}, {"event": "progress", "t": 111.0, "versions": [7, 5]}], "None"),
    ],
)
def test_a_newcomer_late_on_its_own_branch_or_never_at_the_swarms_versions_fails(newcomer, why):
    row = checks.newcomer_check(newcomer, SWARM, heartbeat_period=1.0)
    assert not row["ok"] and why in row["why"], row
    if row["started"] is not None:
        assert "NOT ok" in newcomer_line({"name": "n", "launched": 1.0, **row})
