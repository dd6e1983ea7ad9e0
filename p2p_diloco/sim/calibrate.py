"""Re-fit the failure model on the paper's two baseline rows, and compare all 30 cells with the paper.

    python -m p2p_diloco.sim.calibrate            # 30-cell table: simulated vs paper (about a minute)
    python -m p2p_diloco.sim.calibrate --fit      # re-fit the baseline constants first, print them
    python -m p2p_diloco.sim.calibrate --markdown # the table as Markdown (docs/failure_model.md)

The fit minimises the sum of squared goodput errors (in points) over the five cells of one baseline
row with a small Nelder-Mead search, on the same horizons `run_simulation` uses by default.
`dp` fits (restart_seconds, checkpoint_seconds); `elastic_dp` fits (shrink_seconds, grow_seconds,
join_wait_seconds). The decoupled rows are never used: they are predictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Callable, Sequence

from p2p_diloco.sim.failure_model import (
    CALIBRATED,
    PAPER_CHIPS,
    PAPER_GOODPUT,
    PAPER_LEARNERS,
    FailureModel,
)
from p2p_diloco.sim.goodput import default_hours, run_simulation
from p2p_diloco.sim.jobs import simulate_elastic_job, simulate_restart_job

FIT_PARAMETERS = {
    "dp": ("restart_seconds", "checkpoint_seconds"),
    "elastic_dp": ("shrink_seconds", "grow_seconds", "join_wait_seconds"),
}


def baseline_goodput(model: FailureModel, variant: str, chips: int, seed: int | str = 0) -> float:
    """Goodput (%) of one baseline variant, with the same seeds and horizon as `run_simulation`."""
    horizon = default_hours(chips, model) * 3600.0
    if variant == "dp":
        run = simulate_restart_job(chips, horizon, model, random.Random(f"{seed}:dp"))
    else:
        run = simulate_elastic_job(chips, horizon, model, random.Random(f"{seed}:elastic_dp"))
    return 100.0 * run.goodput


def row_error(model: FailureModel, variant: str, seed: int | str = 0) -> float:
    """Sum of squared differences (points) between simulated and paper goodput over the row."""
    paper = PAPER_GOODPUT[variant]
    return sum((baseline_goodput(model, variant, n, seed) - p) ** 2 for n, p in zip(PAPER_CHIPS, paper))


def nelder_mead(
    f: Callable[[list[float]], float], x0: Sequence[float], step: Sequence[float], iters: int = 120
) -> list[float]:
    """Minimise `f` from `x0` (simplex edges `step`); enough for 2-3 smooth parameters."""
    simplex = [list(x0)] + [
        [x + (s if j == i else 0.0) for j, x in enumerate(x0)] for i, s in enumerate(step)
    ]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = [sum(c) / (len(simplex) - 1) for c in zip(*simplex[:-1])]
        worst = simplex[-1]

        def towards(a: float, centroid: list[float] = centroid, worst: list[float] = worst) -> list[float]:
            return [c + a * (w - c) for c, w in zip(centroid, worst)]

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best point
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p)] for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def fit_baselines(model: FailureModel = CALIBRATED, seed: int | str = 0) -> FailureModel:
    """`model` with the baseline constants re-fitted on the paper's dp and elastic_dp rows."""
    for variant, names in FIT_PARAMETERS.items():
        start = [getattr(model, name) for name in names]

        def loss(
            x: list[float], names: tuple[str, ...] = names, variant: str = variant, base: FailureModel = model
        ) -> float:
            if any(v < 0 for v in x):
                return 1e9
            candidate = dataclasses.replace(base, **dict(zip(names, x)))
            return row_error(candidate, variant, seed)

        best = nelder_mead(loss, start, [max(1.0, 0.2 * v) for v in start])
        model = dataclasses.replace(model, **{n: round(v, 1) for n, v in zip(names, best)})
    return model


def compare(model: FailureModel = CALIBRATED, seed: int = 0) -> list[tuple[str, int, float, int]]:
    """(row, chips, simulated %, paper %) for all 30 cells, with `run_simulation`'s defaults."""
    cells: list[tuple[str, int, float, int]] = []
    for col, chips in enumerate(PAPER_CHIPS):
        for learners in PAPER_LEARNERS:
            result = run_simulation(learners, chips, seed=seed, model=model)
            if learners == PAPER_LEARNERS[0]:
                for variant in ("dp", "elastic_dp"):
                    cells.append(
                        (variant, chips, 100 * result[variant]["goodput"], PAPER_GOODPUT[variant][col])
                    )
            row = f"decoupled M={learners}"
            cells.append((row, chips, 100 * result["decoupled"]["goodput"], PAPER_GOODPUT[row][col]))
    return cells


def format_comparison(cells: list[tuple[str, int, float, int]], markdown: bool = False) -> str:
    """One line per row: simulated (paper) for each chip count, and the largest absolute difference."""
    rows = list(PAPER_GOODPUT)
    by_cell = {(r, n): (s, p) for r, n, s, p in cells}
    heads = [f"{n // 1000}k" if n < 1_000_000 else f"{n / 1e6:g}M" for n in PAPER_CHIPS]
    lines = []
    if markdown:
        lines.append("| row | " + " | ".join(heads) + " | max abs diff |")
        lines.append("| --- |" + " --- |" * (len(heads) + 1))
    else:
        lines.append(f"{'row':<16}" + "".join(f"{h:>14}" for h in heads) + f"{'max|diff|':>11}")
    for r in rows:
        pairs = [by_cell[(r, n)] for n in PAPER_CHIPS]
        worst = max(abs(s - p) for s, p in pairs)
        texts = [f"{s:.1f} ({p})" for s, p in pairs]
        if markdown:
            lines.append(f"| {r} | " + " | ".join(texts) + f" | {worst:.1f} |")
        else:
            lines.append(f"{r:<16}" + "".join(f"{t:>14}" for t in texts) + f"{worst:>11.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m p2p_diloco.sim.calibrate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--fit", action="store_true", help="re-fit the baseline constants first")
    parser.add_argument("--markdown", action="store_true", help="print the comparison as a Markdown table")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = CALIBRATED
    if args.fit:
        model = fit_baselines(model, seed=args.seed)
        for names in FIT_PARAMETERS.values():
            for name in names:
                print(f"{name} = {getattr(model, name)}  (was {getattr(CALIBRATED, name)})")
    print(format_comparison(compare(model, seed=args.seed), markdown=args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
