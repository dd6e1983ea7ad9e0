"""The paper-scale goodput simulator: calibration against the paper, predictions, CLI and invariants."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from p2p_diloco.cli import main
from p2p_diloco.errors import ConfigError
from p2p_diloco.sim.calibrate import baseline_goodput, compare
from p2p_diloco.sim.decoupled import simulate_decoupled, split_chips
from p2p_diloco.sim.failure_model import CALIBRATED, PAPER_CHIPS, PAPER_GOODPUT, FailureModel
from p2p_diloco.sim.goodput import run_simulation
from p2p_diloco.sim.jobs import simulate_elastic_job, simulate_restart_job

YEAR = 365.25 * 24 * 3600


def paper(row: str, chips: int) -> float:
    return PAPER_GOODPUT[row][PAPER_CHIPS.index(chips)]


def test_same_seed_same_result_and_other_seed_differs():
    a = run_simulation(4, 600_000, hours=6, seed=3)
    b = run_simulation(4, 600_000, hours=6, seed=3)
    c = run_simulation(4, 600_000, hours=6, seed=4)
    assert a == b
    assert a["decoupled"]["goodput"] != c["decoupled"]["goodput"]
    assert a["dp"]["goodput"] != c["dp"]["goodput"]


@pytest.mark.parametrize("chips", PAPER_CHIPS)
def test_baseline_rows_match_the_paper(chips):
    """The calibration itself: both baseline rows, default horizons and seeds, every chip count."""
    assert baseline_goodput(CALIBRATED, "dp", chips) == pytest.approx(paper("dp", chips), abs=4.0)
    assert baseline_goodput(CALIBRATED, "elastic_dp", chips) == pytest.approx(
        paper("elastic_dp", chips), abs=2.0
    )


@pytest.mark.parametrize(
    ("learners", "chips"), [(2, 2_400_000), (4, 2_400_000), (4, 1_200_000), (8, 2_400_000), (16, 600_000)]
)
def test_decoupled_predictions_within_five_points(learners, chips):
    result = run_simulation(learners, chips, hours=36, seed=1)
    assert 100 * result["decoupled"]["goodput"] == pytest.approx(
        paper(f"decoupled M={learners}", chips), abs=5.0
    )


@pytest.mark.slow
def test_all_thirty_cells():
    cells = compare(CALIBRATED, seed=0)
    assert len(cells) == 30
    for row, chips, simulated, reference in cells:
        tolerance = 5.0 if row.startswith("decoupled") else (4.0 if row == "dp" else 2.0)
        assert abs(simulated - reference) <= tolerance, (row, chips, simulated, reference)


def test_goodput_grows_with_the_number_of_learners():
    goodputs = [
        run_simulation(m, 600_000, hours=24, seed=0)["decoupled"]["goodput"] for m in (1, 2, 4, 8, 16)
    ]
    assert all(later > earlier + 0.01 for earlier, later in zip(goodputs, goodputs[1:])), goodputs


def test_one_learner_is_elastic_dp_and_beats_plain_dp():
    result = run_simulation(1, 300_000, hours=24, seed=0)
    assert result["decoupled"]["goodput"] == pytest.approx(result["elastic_dp"]["goodput"], abs=0.01)
    assert result["elastic_dp"]["goodput"] > result["dp"]["goodput"] + 0.1


def test_uptime_is_near_total_from_four_learners():
    result = run_simulation(4, 2_400_000, hours=24, seed=0)
    assert result["decoupled"]["uptime"] > 0.98
    assert result["elastic_dp"]["uptime"] < 0.5
    assert 0 < result["dp"]["uptime"] < result["elastic_dp"]["uptime"]


def test_restart_job_matches_the_renewal_formula():
    model = dataclasses.replace(CALIBRATED, restart_seconds=60.0, checkpoint_seconds=0.0)
    chips = 300_000
    run = simulate_restart_job(chips, 200 * 3600.0, model, random.Random(0))
    expected = 1 / (1 + chips / YEAR * 60.0)
    assert run.goodput == pytest.approx(expected, abs=0.01)
    # a checkpoint interval loses work on top of the restart
    lossy = dataclasses.replace(model, checkpoint_seconds=60.0)
    assert simulate_restart_job(chips, 200 * 3600.0, lossy, random.Random(0)).goodput < run.goodput - 0.05


def test_elastic_job_with_free_joins_matches_the_renewal_formula():
    model = dataclasses.replace(
        CALIBRATED,
        shrink_seconds=30.0,
        grow_seconds=0.0,
        join_wait_seconds=0.0,
        repair_seconds=1e-3,
        step_seconds=1e-3,
    )
    chips = 600_000
    run = simulate_elastic_job(chips, 100 * 3600.0, model, random.Random(0))
    assert run.goodput == pytest.approx(1 / (1 + chips / YEAR * 30.0), abs=0.01)
    # paying for every rejoin costs more than letting repaired slices ride along
    slow_joins = dataclasses.replace(CALIBRATED, join_wait_seconds=0.0)
    assert (
        simulate_elastic_job(chips, 100 * 3600.0, slow_joins, random.Random(0)).goodput
        < simulate_elastic_job(chips, 100 * 3600.0, CALIBRATED, random.Random(0)).goodput - 0.02
    )


def test_decoupled_work_is_conserved_and_goes_through_the_synchronizer():
    run = simulate_decoupled(4, 400_000, 24 * 3600.0, CALIBRATED, seed=0)
    trained = sum(r.useful_chip_seconds for r in run.learners)
    assert run.merged_chip_seconds + run.in_flight_chip_seconds + run.lost_chip_seconds == pytest.approx(
        trained, rel=1e-9
    )
    assert run.rounds_merged > 0 and run.deltas_sent >= run.rounds_merged
    assert run.merged_chip_seconds > 0.99 * trained  # K = 1: nothing waits, nothing is lost


def test_stale_deltas_are_rejected_and_their_work_lost():
    """With max_staleness 0 and slow merges, deltas queued behind a merge are dropped as stale."""
    model = dataclasses.replace(CALIBRATED, max_staleness=0, sync_seconds=120.0, send_seconds=60.0)
    run = simulate_decoupled(8, 80_000, 12 * 3600.0, model, seed=0)
    trained = sum(r.useful_chip_seconds for r in run.learners)
    assert run.reject_reasons.get("stale anchor", 0) > 0
    assert run.lost_chip_seconds > 0
    assert run.merged_chip_seconds + run.in_flight_chip_seconds + run.lost_chip_seconds == pytest.approx(
        trained, rel=1e-9
    )


def test_uneven_split_is_handled():
    assert split_chips(10, 3) == [4, 3, 3]
    result = run_simulation(3, 100_000, hours=12, seed=0)
    assert result["params"]["chips_per_learner"] == [33333, 33334]
    assert 0 < result["decoupled"]["goodput"] <= 1


def test_lower_mtbf_means_lower_goodput():
    rare = run_simulation(4, 150_000, mtbf_years=4.0, hours=24, seed=0)
    often = run_simulation(4, 150_000, mtbf_years=0.25, hours=24, seed=0)
    for variant in ("dp", "elastic_dp", "decoupled"):
        assert rare[variant]["goodput"] > often[variant]["goodput"]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"learners": 0, "chips": 10}, "--learners"),
        ({"learners": 8, "chips": 4}, "--chips"),
        ({"learners": 2, "chips": 10, "mtbf_years": 0.0}, "--mtbf-years"),
        ({"learners": 2, "chips": 10, "mtbf_years": float("nan")}, "--mtbf-years"),
        ({"learners": 2, "chips": 10, "hours": -1.0}, "--hours"),
        ({"learners": 2, "chips": 2_400_000, "hours": 1e6}, "--hours"),
        ({"learners": 10_000, "chips": 2_400_000}, "--learners"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        run_simulation(**kwargs)


def test_failure_model_validates_itself():
    with pytest.raises(ConfigError, match="shrink_seconds"):
        FailureModel(shrink_seconds=0.0)


def test_cli_json_is_one_object_with_the_required_keys(capsys):
    assert main(["simulate", "--learners", "4", "--chips", "600000", "--hours", "6", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out)
    for variant in ("dp", "elastic_dp", "decoupled"):
        assert 0.0 < result[variant]["goodput"] <= 1.0
        assert 0.0 < result[variant]["uptime"] <= 1.0
    assert result["params"]["learners"] == 4 and result["paper"]["decoupled"] == 0.89


def test_cli_table_and_error_message(capsys):
    assert main(["simulate", "-M", "2", "-N", "150000", "--hours", "6"]) == 0
    out = capsys.readouterr().out
    assert "elastic data-parallel" in out and "Decoupled DiLoCo, M=2" in out
    assert main(["simulate", "-M", "5", "-N", "3"]) == 2
    assert "--chips (N) must be" in capsys.readouterr().err
