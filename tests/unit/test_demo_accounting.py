"""Goodput accounting (`p2p_diloco.demo.accounting`, the one module for both systems) on scripted event
logs with exact numbers: DiLoCo learners and baseline workers alike."""

from __future__ import annotations

import pytest

from p2p_diloco.demo import accounting
from p2p_diloco.demo.chaos import KILL_SYNC, chaos_schedule


def progress(t: float, **counters: float) -> dict:
    return {"t": t, "event": "progress", **counters}


# Peer A: up at 0, SIGKILLed at 60 (its last report at 50), restarted at 70.
PEER_A = [
    {"t": 0.0, "event": "start"},
    progress(10, compute_seconds=9, compute_merged=6, tokens=1000, bytes_sent=100),
    progress(50, compute_seconds=45, compute_merged=46, tokens=5000, bytes_sent=500),
    {"t": 70.0, "event": "start"},
    progress(80, compute_seconds=8, compute_merged=0, tokens=800),
    progress(100, compute_seconds=27, compute_merged=20, tokens=2700),
]
# Peer B: up before the window opens, never killed.
PEER_B = [
    {"t": -10.0, "event": "start"},
    progress(0, compute_seconds=9, compute_merged=5, tokens=900, bytes_received=50),
    progress(40, compute_seconds=45, compute_merged=45, tokens=4900),
    progress(100, compute_seconds=99, compute_merged=105, tokens=9900, bytes_received=650),
]


def test_goodput_over_the_whole_window_counts_lost_and_down_time_against_it():
    books = accounting.summarize({"a": PEER_A, "b": PEER_B}, start=0.0, end=100.0, learners=2)
    # A: 46 merged before the kill + 20 after the restart; B: 105 - 5
    assert books["goodput"] == pytest.approx((46 + 20 + 100) / 200)
    assert books["compute_fraction"] == pytest.approx((45 + 27 + 90) / 200)
    assert books["tokens"] == pytest.approx(5000 + 2700 + 9000)
    assert books["bytes_per_learner"]["a"] == {"sent": 500.0, "received": 0.0}
    assert books["bytes_per_learner"]["b"] == {"sent": 0.0, "received": 600.0}
    assert books["bytes_mean"] == {"sent": 250.0, "received": 300.0}


def test_goodput_in_a_sub_window_interpolates_and_is_flat_after_a_kill():
    books = accounting.summarize({"a": PEER_A, "b": PEER_B}, start=25.0, end=75.0, learners=2)
    # A life 1: 46 - 21 (slope 1 between t=10 and 50); A life 2: 0; B: 80 - 30
    assert books["per_peer"]["a"]["compute_merged"] == pytest.approx(25.0)
    assert books["per_peer"]["b"]["compute_merged"] == pytest.approx(50.0)
    assert books["goodput"] == pytest.approx(75 / 100)


def test_a_counter_that_drops_starts_a_new_lifetime_without_a_start_event():
    events = [progress(0, tokens=0), progress(10, tokens=10), progress(20, tokens=3, blocked_seconds=1)]
    assert len(accounting.lifetimes(events)) == 2
    assert accounting.counters_in_window(events, 0.0, 20.0)["tokens"] == pytest.approx(13.0)
    # other counters dropping (e.g. a clamped one) do not split a lifetime
    noisy = [progress(0, tokens=0, blocked_seconds=2), progress(10, tokens=10, blocked_seconds=1)]
    assert len(accounting.lifetimes(noisy)) == 1


def test_a_learner_slot_without_any_log_still_counts_in_the_denominator():
    books = accounting.summarize({"a": PEER_A}, start=0.0, end=100.0, learners=4)
    assert books["goodput"] == pytest.approx(66 / 400)


def test_paced_time_counts_as_compute_merged_in_proportion():
    events = [
        {"t": 0.0, "event": "start"},
        progress(10, compute_seconds=10, compute_merged=5, paced_seconds=4),
    ]
    books = accounting.summarize({"x": events}, start=0.0, end=10.0, learners=1, paced_as_compute=True)
    assert books["goodput"] == pytest.approx(0.7)
    assert books["compute_fraction"] == pytest.approx(1.4)


def test_uptime_is_the_union_of_one_period_windows_after_each_advance():
    # [10, 15) + [15, 17) + [30, 35) + [80, 85): 17 of 100 s had an advance within the last 5 s
    assert accounting.uptime([10, 12, 30, 80], start=0.0, end=100.0, period=5.0) == pytest.approx(0.17)
    assert accounting.uptime([97], start=0.0, end=100.0, period=5.0) == pytest.approx(0.03)
    assert accounting.uptime([], start=0.0, end=100.0, period=5.0) == 0.0
    # an advance every period keeps it at 1; a 12 s gap in updates every 2 s costs 12 - 2 s
    assert accounting.uptime([2.0 * k for k in range(50)], start=0.0, end=100.0, period=2.0) == 1.0
    gap = [2.0 * k for k in range(50) if not 20 < 2.0 * k < 32]
    assert accounting.uptime(gap, start=0.0, end=100.0, period=2.0) == pytest.approx(0.9)


def test_version_advances_take_the_first_sighting_and_ignore_stale_epochs():
    events = [
        {"t": 5.0, "event": "published", "fragment": 0, "version": 1, "term": 1, "leader": "x"},
        {"t": 4.0, "event": "applied", "fragment": 0, "version": 1, "term": 1, "leader": "x"},
        {"t": 6.0, "event": "applied", "fragment": 1, "version": 1, "term": 1, "leader": "x"},
        progress(10, global_epoch=3),
        progress(11, global_epoch=3),
        progress(12, global_epoch=2),
        progress(13, global_epoch=4),
    ]
    assert accounting.version_advances(events) == [4.0, 6.0, 10.0, 13.0]


def test_failovers_count_changes_of_the_publishing_peer_only():
    events = [
        {"t": 5.0, "event": "published", "term": 1, "leader": "x"},
        {"t": 12.0, "event": "published", "term": 1, "leader": "x"},
        {"t": 30.0, "event": "published", "term": 2, "leader": "y"},
        {"t": 50.0, "event": "published", "term": 3, "leader": "y"},  # rotation to itself: no failover
        {"t": 70.0, "event": "published", "term": 4, "leader": "x"},
    ]
    changes = accounting.failovers(events)
    assert [(c["t"], c["from"], c["to"]) for c in changes] == [(30.0, "x", "y"), (70.0, "y", "x")]


def test_a_planned_rotation_is_no_failover_in_the_report():
    events = [
        {"t": 5.0, "event": "published", "term": 1, "leader": "x"},
        {"t": 20.0, "event": "released_lease", "term": 1, "rounds": 50},  # x rotated out after its rounds
        {"t": 21.0, "event": "published", "term": 2, "leader": "y"},
        {"t": 40.0, "event": "published", "term": 3, "leader": "x"},  # y lapsed (killed): a failover
    ]
    changes = accounting.failovers(events)
    assert [(c["t"], c["term"], c["from"], c["to"]) for c in changes] == [(40.0, 3, "y", "x")]
    assert len(accounting.failovers(e for e in events if e["event"] != "released_lease")) == 2


def test_nominal_period_is_steps_per_round_times_the_median_step_time():
    events = [progress(0, step=0), progress(1, step=10), progress(2, step=15), progress(3, step=25)]
    assert accounting.nominal_period({"a": events}, 2.0) == pytest.approx(0.2)


# ---- baseline workers' logs (full counter lines, extra events) -------------------------------------


def full_progress(t, tokens, compute, merged, blocked, sent=0.0, received=0.0, **extra):
    return {
        "t": t,
        "event": "progress",
        "tokens": tokens,
        "compute_seconds": compute,
        "compute_merged": merged,
        "blocked_seconds": blocked,
        "bytes_sent": sent,
        "bytes_received": received,
        **extra,
    }


# Worker A is SIGKILLed after t=103 (no stop event) and restarts at t=105; worker B runs throughout.
WORKER_A = [
    {"t": 100.0, "event": "start", "peer_id": "A"},
    full_progress(101.0, 100, 0.5, 0.4, 0.3, 10, 20),
    {"t": 102.0, "event": "global_step", "epoch": 3, "outcome": "averaged"},
    full_progress(103.0, 300, 1.5, 1.2, 0.9, 30, 60),
    {"t": 105.0, "event": "start", "peer_id": "A"},
    full_progress(106.0, 50, 0.25, 0.25, 0.5, 0, 100),
    full_progress(110.0, 250, 1.25, 1.0, 2.5, 40, 140),
]
WORKER_B = [
    {"t": 100.0, "event": "start", "peer_id": "B"},
    full_progress(102.0, 200, 1.0, 1.0, 0.8, 20, 20),
    full_progress(110.0, 1000, 5.0, 4.0, 2.4, 100, 100),
    {"t": 110.5, "event": "stopped", "digest": "x"},
]


def test_summary_of_a_baseline_run_with_a_crash_and_restart():
    report = accounting.summarize({"A": WORKER_A, "B": WORKER_B}, start=100.0, end=110.0)
    # sums: tokens 550 + 1000, compute 2.75 + 5, merged 2.2 + 4, blocked 3.4 + 2.4; capacity 2 x 10 s
    assert report["tokens"] == pytest.approx(1550)
    assert report["goodput"] == pytest.approx(6.2 / 20)
    assert report["compute_fraction"] == pytest.approx(7.75 / 20)
    assert report["blocked_fraction"] == pytest.approx(5.8 / 20)
    assert report["bytes_mean"] == pytest.approx({"sent": 85.0, "received": 150.0})
    assert report["bytes_per_learner"]["A"] == pytest.approx({"sent": 70.0, "received": 200.0})
    assert report["learners"] == 2 and report["wall_seconds"] == 10.0
    assert report["per_peer"]["A"]["compute_merged"] == pytest.approx(2.2)
    assert report["per_peer"]["B"]["tokens"] == pytest.approx(1000)


def test_learner_slots_without_a_log_count_as_idle_capacity():
    report = accounting.summarize({"A": WORKER_A, "B": WORKER_B}, start=100.0, end=110.0, learners=4)
    assert report["goodput"] == pytest.approx(6.2 / 40)
    assert report["bytes_mean"]["sent"] == pytest.approx(170 / 4)


def test_window_cuts_lifetimes_and_interpolates_between_reports():
    # life 1 runs 100..103 (flat afterwards), life 2 starts at 105 from zero
    assert accounting.counters_in_window(WORKER_A, 101.0, 106.0)["tokens"] == pytest.approx((300 - 100) + 50)
    # 102 is halfway between the reports at 101 (100 tokens) and 103 (300 tokens): 200 there
    assert accounting.counters_in_window(WORKER_A, 102.0, 104.0)["tokens"] == pytest.approx(100)
    # from the start event (0 at t=100) to the first report (100 at t=101)
    assert accounting.counters_in_window(WORKER_A, 100.0, 100.5)["tokens"] == pytest.approx(50)
    assert accounting.counters_in_window(WORKER_A, 111.0, 120.0)["tokens"] == 0.0


def test_all_counters_decreasing_start_a_new_lifetime():
    events = [
        full_progress(1.0, 10, 1, 1, 0),
        full_progress(2.0, 30, 2, 2, 0),
        full_progress(3.0, 5, 0.5, 0.5, 0),  # restarted, its start line lost
        full_progress(4.0, 15, 1.5, 1.5, 0),
    ]
    lives = accounting.lifetimes(events)
    assert [[e["t"] for e in life] for life in lives] == [[1.0, 2.0], [3.0, 4.0]]
    assert accounting.counters_in_window(events, 0.0, 10.0)["tokens"] == pytest.approx(30 + 15)


def test_learner_events_with_other_fields_and_missing_counters():
    # a DiLoCo learner's progress line: its own extra fields, no byte counters yet
    events = [
        {"t": 0.0, "event": "start", "versions": [0, 0]},
        {"t": 2.0, "event": "progress", "step": 9, "versions": [1, 1], "tokens": 90, "compute_seconds": 1.0,
         "compute_merged": 0.5, "blocked_seconds": 0.0},
        {"t": 3.0, "event": "progress", "tokens": 120},  # no compute fields in this line
        {"event": "progress", "tokens": 10**9},  # no time: ignored
        {"t": 4.0, "event": "note", "line": "whatever"},
    ]  # fmt: skip
    report = accounting.summarize({"L": events}, start=0.0, end=4.0)
    assert report["tokens"] == pytest.approx(120)
    assert report["goodput"] == pytest.approx(0.5 / 4)
    assert report["bytes_mean"] == {"sent": 0.0, "received": 0.0}
    assert report["bytes_per_learner"]["L"] == {"sent": 0.0, "received": 0.0}


def test_bad_windows_and_learner_counts_are_refused():
    with pytest.raises(ValueError, match="end > start"):
        accounting.summarize({"A": WORKER_A}, start=5.0, end=5.0)
    with pytest.raises(ValueError, match="at least one learner"):
        accounting.summarize({}, start=0.0, end=1.0)
    with pytest.raises(ValueError, match="at least one learner"):
        accounting.summarize({"A": WORKER_A}, start=0.0, end=1.0, learners=0)


def test_the_chaos_schedule_is_seeded_and_kills_the_synchronizer_twice():
    first, again = chaos_schedule(4, 180, seed=3), chaos_schedule(4, 180, seed=3)
    assert first == again
    assert [f.action for f in first.faults].count(KILL_SYNC) == 2
    assert all(0 < f.at < 180 and f.down > 0 and 0 <= f.learner < 4 for f in first.faults)
    assert chaos_schedule(4, 180, seed=4) != first
