"""`p2p-diloco simulate`: goodput and uptime of DP, elastic DP and Decoupled DiLoCo at paper scale.

`run_simulation` runs the three variants on the same cluster (N chips failing as Poisson processes)
with the calibrated `FailureModel` and returns plain fractions; `cli_simulate` prints them as a table
or as one JSON object. The model and its calibration are described in docs/failure_model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from typing import Any

from p2p_diloco.errors import ConfigError
from p2p_diloco.sim.decoupled import DecoupledRun, simulate_decoupled, split_chips
from p2p_diloco.sim.failure_model import CALIBRATED, PAPER_CHIPS, PAPER_GOODPUT, FailureModel
from p2p_diloco.sim.jobs import JobRun, simulate_elastic_job, simulate_restart_job

TARGET_FAILURES = 20_000  # default horizon: about this many chip failures in the cluster
MIN_HOURS, MAX_HOURS = 24.0, 2_000.0
MAX_FAILURES = 2_000_000  # refuse horizons that would take minutes
MAX_LEARNERS = 4096  # each learner is simulated on its own; the paper uses 2-16
MAX_DELTAS = 250_000  # the send quantum grows beyond this many deltas so a call stays fast

VARIANTS = ("dp", "elastic_dp", "decoupled")


def default_hours(chips: int, model: FailureModel = CALIBRATED) -> float:
    """A horizon with about `TARGET_FAILURES` failures, within [MIN_HOURS, MAX_HOURS]."""
    failures_per_hour = chips * model.chip_failure_rate * 3600.0
    return min(MAX_HOURS, max(MIN_HOURS, TARGET_FAILURES / failures_per_hour))


def validate(learners: int, chips: int, mtbf_years: float, hours: float | None) -> None:
    """Raise `ConfigError` naming the bad argument and the fix."""
    if not isinstance(learners, int) or learners < 1:
        raise ConfigError(f"--learners (M) must be an integer >= 1, got {learners!r}")
    if learners > MAX_LEARNERS:
        raise ConfigError(f"--learners (M) must be <= {MAX_LEARNERS} for this simulator, got {learners}")
    if not isinstance(chips, int) or chips < learners:
        raise ConfigError(
            f"--chips (N) must be an integer >= --learners (M={learners}): every learner needs a chip, "
            f"got {chips!r}"
        )
    if not (isinstance(mtbf_years, int | float) and math.isfinite(mtbf_years) and mtbf_years > 0):
        raise ConfigError(f"--mtbf-years must be a finite number > 0, got {mtbf_years!r}")
    if hours is not None and not (isinstance(hours, int | float) and math.isfinite(hours) and hours > 0):
        raise ConfigError(f"--hours must be a finite number > 0, got {hours!r}")


def run_simulation(
    learners: int,
    chips: int,
    *,
    mtbf_years: float = 1.0,
    hours: float | None = None,
    seed: int = 0,
    model: FailureModel = CALIBRATED,
) -> dict[str, Any]:
    """Simulate `chips` chips for `hours` (default: `default_hours`) and compare the three variants.

    Returns ``{"dp": {...}, "elastic_dp": {...}, "decoupled": {...}, "params": {...}}``; each variant
    has "goodput" (useful chip-time / (chips x wall time)) and "uptime" (fraction of wall time the
    global model was advancing) as fractions, plus counters. Deterministic for a given seed.
    """
    validate(learners, chips, mtbf_years, hours)
    model = dataclasses.replace(model, mtbf_years=float(mtbf_years))
    hours = checked_hours(chips, hours, model)
    horizon = hours * 3600.0
    send_seconds = max(model.send_seconds, learners * horizon / MAX_DELTAS)
    model = dataclasses.replace(model, send_seconds=send_seconds)

    dp = simulate_restart_job(chips, horizon, model, random.Random(f"{seed}:dp"))
    elastic = simulate_elastic_job(chips, horizon, model, random.Random(f"{seed}:elastic_dp"))
    decoupled = simulate_decoupled(learners, chips, horizon, model, seed)
    sizes = split_chips(chips, learners)
    result: dict[str, Any] = {
        "dp": dp_summary(dp),
        "elastic_dp": elastic_summary(elastic),
        "decoupled": decoupled_summary(decoupled),
        "params": {
            "learners": learners,
            "chips": chips,
            "chips_per_learner": [min(sizes), max(sizes)],
            "mtbf_years": float(mtbf_years),
            "hours": hours,
            "seed": seed,
            "model": model.to_dict(),
        },
    }
    paper = paper_reference(learners, chips, mtbf_years)
    if paper:
        result["paper"] = paper
    return result


def checked_hours(chips: int, hours: float | None, model: FailureModel) -> float:
    """The horizon in hours (`default_hours` when None); `ConfigError` if it means over `MAX_FAILURES`."""
    hours = default_hours(chips, model) if hours is None else float(hours)
    horizon = hours * 3600.0
    expected_failures = chips * model.chip_failure_rate * horizon
    if expected_failures > MAX_FAILURES:
        raise ConfigError(
            f"{chips} chips over {hours:g} h means about {expected_failures:,.0f} failures; "
            f"use --hours <= {hours * MAX_FAILURES / expected_failures:.4g} (or leave it out)"
        )
    return hours


def dp_summary(dp: JobRun) -> dict[str, Any]:
    return {
        "goodput": dp.goodput,
        "uptime": dp.uptime,
        "failures": dp.failures,
        "restarts": dp.disruptive_failures,
    }


def elastic_summary(elastic: JobRun) -> dict[str, Any]:
    return {
        "goodput": elastic.goodput,
        "uptime": elastic.uptime,
        "failures": elastic.failures,
        "reconfigurations": elastic.reconfigurations,
    }


def decoupled_summary(decoupled: DecoupledRun) -> dict[str, Any]:
    """The decoupled run's fractions and counters, its failures summed over the learners."""
    cluster_seconds = decoupled.chips * decoupled.horizon
    return {
        "goodput": decoupled.goodput,
        "uptime": decoupled.uptime,
        "failures": sum(r.failures for r in decoupled.learners),
        "reconfigurations": sum(r.reconfigurations for r in decoupled.learners),
        "learner_goodput_min": min(r.goodput for r in decoupled.learners),
        "deltas_sent": decoupled.deltas_sent,
        "deltas_rejected": decoupled.deltas_rejected,
        "reject_reasons": dict(sorted(decoupled.reject_reasons.items())),
        "rounds_merged": decoupled.rounds_merged,
        "mean_contributors_per_round": decoupled.contributors_per_round,
        "lost_fraction": decoupled.lost_chip_seconds / cluster_seconds,
        "in_flight_fraction": decoupled.in_flight_chip_seconds / cluster_seconds,
    }


def paper_reference(learners: int, chips: int, mtbf_years: float) -> dict[str, float]:
    """The paper's goodput fractions for this cell, if the table has it (MTBF 1 year)."""
    if mtbf_years != 1.0 or chips not in PAPER_CHIPS:
        return {}
    col = PAPER_CHIPS.index(chips)
    ref = {"dp": PAPER_GOODPUT["dp"][col] / 100, "elastic_dp": PAPER_GOODPUT["elastic_dp"][col] / 100}
    row = PAPER_GOODPUT.get(f"decoupled M={learners}")
    if row is not None:
        ref["decoupled"] = row[col] / 100
    return ref


def format_table(result: dict[str, Any]) -> str:
    """A readable summary of `run_simulation`'s result."""
    p = result["params"]
    paper = result.get("paper", {})
    lo, hi = p["chips_per_learner"]
    per_learner = f"{lo}" if lo == hi else f"{lo}-{hi}"
    labels = {
        "dp": "data-parallel, no elasticity",
        "elastic_dp": "elastic data-parallel",
        "decoupled": f"Decoupled DiLoCo, M={p['learners']} x {per_learner} chips",
    }
    lines = [
        f"{p['chips']:,} chips, chip MTBF {p['mtbf_years']:g} y, {p['hours']:.1f} simulated hours, "
        f"seed {p['seed']}",
        "",
        f"{'variant':<44} {'goodput':>8} {'uptime':>8} {'paper':>7}",
    ]
    for v in VARIANTS:
        ref = f"{paper[v] * 100:.0f}%" if v in paper else "-"
        r = result[v]
        lines.append(f"{labels[v]:<44} {r['goodput'] * 100:7.1f}% {r['uptime'] * 100:7.1f}% {ref:>7}")
    d = result["decoupled"]
    lines += [
        "",
        f"decoupled: {d['rounds_merged']:,} fragment rounds merged, {d['mean_contributors_per_round']:.2f} "
        f"learners per round, {d['deltas_rejected']:,} of {d['deltas_sent']:,} deltas rejected",
    ]
    return "\n".join(lines)


def cli_simulate(args: argparse.Namespace) -> int:
    """Entry point of `p2p-diloco simulate` (parser in p2p_diloco.cli)."""
    result = run_simulation(
        args.learners, args.chips, mtbf_years=args.mtbf_years, hours=args.hours, seed=args.seed
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(format_table(result))
    return 0
