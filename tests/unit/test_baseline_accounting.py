"""Goodput accounting over scripted event logs (`p2p_diloco.baseline.accounting`), exact numbers."""

from __future__ import annotations

import pytest

from p2p_diloco.baseline.accounting import counters_in_window, split_lifetimes, summarize_run


def progress(t, tokens, compute, merged, blocked, sent=0.0, received=0.0, **extra):
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


# Peer A is SIGKILLed after t=103 (no stop event) and restarts at t=105; peer B runs throughout.
PEER_A = [
    {"t": 100.0, "event": "start", "peer_id": "A"},
    progress(101.0, 100, 0.5, 0.4, 0.3, 10, 20),
    {"t": 102.0, "event": "global_step", "epoch": 3, "outcome": "averaged"},
    progress(103.0, 300, 1.5, 1.2, 0.9, 30, 60),
    {"t": 105.0, "event": "start", "peer_id": "A"},
    progress(106.0, 50, 0.25, 0.25, 0.5, 0, 100),
    progress(110.0, 250, 1.25, 1.0, 2.5, 40, 140),
]
PEER_B = [
    {"t": 100.0, "event": "start", "peer_id": "B"},
    progress(102.0, 200, 1.0, 1.0, 0.8, 20, 20),
    progress(110.0, 1000, 5.0, 4.0, 2.4, 100, 100),
    {"t": 110.5, "event": "stopped", "digest": "x"},
]


def test_summary_of_a_run_with_a_crash_and_restart():
    report = summarize_run({"A": PEER_A, "B": PEER_B}, start=100.0, end=110.0)
    # sums: tokens 550 + 1000, compute 2.75 + 5, merged 2.2 + 4, blocked 3.4 + 2.4; capacity 2 x 10 s
    assert report["tokens"] == pytest.approx(1550)
    assert report["goodput"] == pytest.approx(6.2 / 20)
    assert report["compute_fraction"] == pytest.approx(7.75 / 20)
    assert report["blocked_fraction"] == pytest.approx(5.8 / 20)
    assert report["bytes_per_learner"] == pytest.approx({"sent": 85.0, "received": 150.0})
    assert report["learners"] == 2 and report["wall_seconds"] == 10.0
    assert report["per_peer"]["A"]["compute_merged"] == pytest.approx(2.2)
    assert report["per_peer"]["B"]["tokens"] == pytest.approx(1000)


def test_learner_slots_without_a_log_count_as_idle_capacity():
    report = summarize_run({"A": PEER_A, "B": PEER_B}, start=100.0, end=110.0, learners=4)
    assert report["goodput"] == pytest.approx(6.2 / 40)
    assert report["bytes_per_learner"]["sent"] == pytest.approx(170 / 4)


def test_window_cuts_lifetimes_and_interpolates_between_reports():
    # life 1 runs 100..103 (flat afterwards), life 2 starts at 105 from zero
    assert counters_in_window(PEER_A, 101.0, 106.0)["tokens"] == pytest.approx((300 - 100) + 50)
    # 102 is halfway between the reports at 101 (100 tokens) and 103 (300 tokens): 200 there
    assert counters_in_window(PEER_A, 102.0, 104.0)["tokens"] == pytest.approx(100)
    # from the start event (0 at t=100) to the first report (100 at t=101)
    assert counters_in_window(PEER_A, 100.0, 100.5)["tokens"] == pytest.approx(50)
    assert counters_in_window(PEER_A, 111.0, 120.0)["tokens"] == 0.0


def test_a_counter_that_decreases_starts_a_new_lifetime():
    events = [
        progress(1.0, 10, 1, 1, 0),
        progress(2.0, 30, 2, 2, 0),
        progress(3.0, 5, 0.5, 0.5, 0),  # restarted, its start line lost
        progress(4.0, 15, 1.5, 1.5, 0),
    ]
    lives = split_lifetimes(events)
    assert [[e["t"] for e in life] for life in lives] == [[1.0, 2.0], [3.0, 4.0]]
    assert counters_in_window(events, 0.0, 10.0)["tokens"] == pytest.approx(30 + 15)


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
    report = summarize_run({"L": events}, start=0.0, end=4.0)
    assert report["tokens"] == pytest.approx(120)
    assert report["goodput"] == pytest.approx(0.5 / 4)
    assert report["bytes_per_learner"] == {"sent": 0.0, "received": 0.0}


def test_bad_windows_and_learner_counts_are_refused():
    with pytest.raises(ValueError, match="end > start"):
        summarize_run({"A": PEER_A}, start=5.0, end=5.0)
    with pytest.raises(ValueError, match="at least one learner"):
        summarize_run({}, start=0.0, end=1.0)
