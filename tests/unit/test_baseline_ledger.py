"""A baseline worker's counters (`p2p_diloco.baseline.ledger`): merged vs dropped compute, blocking, bytes."""

from __future__ import annotations

import pytest

from p2p_diloco.baseline.ledger import (
    ALONE,
    AVERAGED,
    FAILED,
    StepLedger,
    allreduce_bytes,
    step_outcome,
)


def test_averaged_and_alone_steps_merge_their_pending_compute():
    ledger = StepLedger()
    ledger.local_step(0.5, tokens=64)
    ledger.local_step(0.25, tokens=64)
    assert ledger.pending_seconds == 0.75
    ledger.global_step(AVERAGED, optimizer_seconds=0.125)
    ledger.local_step(0.5, tokens=64)
    ledger.global_step(ALONE, optimizer_seconds=0.0)
    s = ledger.snapshot()
    assert (s["steps"], s["tokens"]) == (3, 192)
    assert s["compute_seconds"] == 1.375
    assert s["compute_merged"] == 1.375
    assert s["compute_dropped"] == 0.0 and s["compute_pending"] == 0.0
    assert (s["rounds_averaged"], s["rounds_alone"], s["global_steps"]) == (1, 1, 2)


def test_failed_rounds_and_reloads_drop_the_work():
    ledger = StepLedger()
    ledger.local_step(0.5, tokens=8)
    ledger.global_step(FAILED, optimizer_seconds=0.25)
    ledger.local_step(0.5, tokens=8)
    ledger.reloaded()
    ledger.local_step(0.125, tokens=8)  # still pending: neither merged nor dropped
    s = ledger.snapshot()
    assert s["compute_seconds"] == 1.375
    assert s["compute_merged"] == 0.0
    assert s["compute_dropped"] == 1.25
    assert s["compute_pending"] == 0.125
    assert (s["rounds_failed"], s["reloads"]) == (1, 1)


def test_blocking_in_progress_shows_in_snapshots_but_the_final_figure_wins():
    ledger = StepLedger()
    ledger.blocking_started(10.0)
    assert ledger.snapshot(12.5)["blocked_seconds"] == 2.5
    assert ledger.snapshot()["blocked_seconds"] == 0.0
    ledger.blocking_ended(1.0)  # the measured wait minus the local optimizer step
    assert ledger.snapshot(99.0)["blocked_seconds"] == 1.0
    ledger.paced(0.5)
    ledger.add_bytes(10.0, 20.0)
    s = ledger.snapshot()
    assert (s["paced_seconds"], s["bytes_sent"], s["bytes_received"]) == (0.5, 10.0, 20.0)


def test_unknown_outcome_is_refused():
    with pytest.raises(ValueError, match="unknown"):
        StepLedger().global_step("reloaded", optimizer_seconds=0.0)


def test_butterfly_allreduce_bytes():
    assert allreduce_bytes(1000, 1) == (0.0, 0.0)
    assert allreduce_bytes(1000, 2) == (1000.0, 1000.0)
    assert allreduce_bytes(1000, 4) == (1500.0, 1500.0)
    with pytest.raises(ValueError):
        allreduce_bytes(1000, 0)


@pytest.mark.parametrize(
    ("group_size", "peers_seen", "outcome"),
    [(2, 3, AVERAGED), (3, 3, AVERAGED), (0, 0, ALONE), (0, 1, ALONE), (0, 2, FAILED), (1, 2, FAILED)],
)
def test_step_outcome(group_size, peers_seen, outcome):
    assert step_outcome(group_size, peers_seen) == outcome
