"""The demo's accounting (`p2p_diloco.demo.accounting`) on a scripted schedule with exact numbers."""

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


def test_uptime_is_the_union_of_two_period_windows_after_each_advance():
    assert accounting.uptime([10, 12, 30, 80], start=0.0, end=100.0, period=5.0) == pytest.approx(0.32)
    assert accounting.uptime([95], start=0.0, end=100.0, period=5.0) == pytest.approx(0.05)
    assert accounting.uptime([], start=0.0, end=100.0, period=5.0) == 0.0


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


def test_nominal_period_is_steps_per_round_times_the_median_step_time():
    events = [progress(0, step=0), progress(1, step=10), progress(2, step=15), progress(3, step=25)]
    assert accounting.nominal_period({"a": events}, 2.0) == pytest.approx(0.2)


def test_the_chaos_schedule_is_seeded_and_kills_the_synchronizer_twice():
    first, again = chaos_schedule(4, 180, seed=3), chaos_schedule(4, 180, seed=3)
    assert first == again
    assert [f.action for f in first.faults].count(KILL_SYNC) == 2
    assert all(0 < f.at < 180 and f.down > 0 and 0 <= f.learner < 4 for f in first.faults)
    assert chaos_schedule(4, 180, seed=4) != first
