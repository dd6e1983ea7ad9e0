#!/usr/bin/env python
"""Goodput benchmark: `p2p-diloco demo --chaos --compare` over several seeds, one table.

    scripts/bench_goodput.py --out DIR [--seeds 0 1 2] [--duration 180] [--learners 4]
                             [--compare dp|diloco|all] [--no-baseline] [--hot-spares]
    scripts/bench_goodput.py --out DIR --tabulate     # the table again from DIR's reports, no runs

Each seed runs the decoupled swarm and (unless --no-baseline) the baselines `--compare` names under the
same seeded chaos schedule and time budget, in DIR/seed-S/: dp (default; the hivemind.Optimizer
baseline, rows "baseline"), diloco (synchronous DiLoCo on hivemind, rows "diloco") or all.
Writes DIR/goodput.json (rows per seed and system with where the rest of the slot time went: blocked,
down incl. restarts, computed but unmerged; the stall per synchronizer kill, worst and median, and the
time from each kill to the first delta the new holder accepted (`p2p_diloco.demo.stalls`); means;
the goals, each reported met or missed) and DIR/goodput.png. The timing goals live here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from p2p_diloco.demo import stalls

GOALS = {  # issue #15, with the synchronizer SIGKILLed twice per run
    "decoupled_goodput_mean_min": 0.95,
    "decoupled_uptime_mean_min": 0.98,  # the global model advanced within the last nominal round
    "stall_worst_max_seconds": 3.0,  # per synchronizer kill, over every kill of every seed
    "stall_median_max_seconds": 2.0,
}
FIELDS = ("goodput", "uptime", "final_eval_loss", "tokens", "failovers")
BREAKDOWN = ("compute_fraction", "blocked_fraction", "down_fraction", "unmerged_fraction")
BASELINES = ("baseline", "diloco")  # report.json sections: elastic data parallel, synchronous DiLoCo
SYSTEMS_OF = ("dp", "diloco", "all")  # --compare values (p2p-diloco demo --compare)
STALLS = ("worst_stall", "median_stall", "worst_to_first_accept", "median_to_first_accept")


def run_seed(seed: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "p2p_diloco", "demo", "--chaos", "--learners", str(args.learners),
           "--duration", str(args.duration), "--seed", str(seed), "--out", str(out)]  # fmt: skip
    if not args.no_baseline:
        cmd += ["--compare", args.compare]
    if args.hot_spares:
        cmd.append("--hot-spares")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / "report.json").read_text())


def restart_seconds(timeline: dict) -> list[float]:
    """Launch-to-up seconds of every restart (a launch after a kill) in a report's timeline."""
    out = []
    for marks in timeline.values():
        killed, launched = False, None
        for t, what in marks:
            if what == "kill":
                killed = True
            elif what == "launch" and killed:
                launched = t
            elif what == "up" and launched is not None:
                out.append(t - launched)
                killed, launched = False, None
    return out


def loss_breakdown(report: dict) -> dict:
    """Where slot time went besides merged compute (fractions of learners x wall), when the report says."""
    if "compute_fraction" not in report:
        return {}
    compute, blocked = report["compute_fraction"], report["blocked_fraction"]
    restarts = restart_seconds(report.get("timeline", {}))
    return {
        "compute_fraction": compute,
        "blocked_fraction": blocked,
        "down_fraction": max(0.0, 1.0 - compute - blocked),  # scheduled down time, restarts, catch-up
        "unmerged_fraction": compute - report["goodput"],  # computed, not (yet) merged in the window
        "restart_seconds": restarts,
    }


def stall_rows(report: dict) -> list[dict]:
    """The report's stall rows per synchronizer kill; for reports made before it had them, the stalls
    again from its advances and kills (without the time to the first accepted delta)."""
    if "stalls" in report:
        return report["stalls"]
    return stalls.sync_kill_stalls(report["kills"], report["advances"], [], end=report["wall_seconds"])


def goals_met(rows: list[dict], kills: list[dict]) -> dict:
    """Each goal met (True), missed (False) or not measured (None); `kills`: every stall row pooled."""
    decoupled = [r for r in rows if r["system"] == "decoupled"]
    goodput = [r["goodput"] for r in decoupled]
    uptime = [r["uptime"] for r in decoupled]
    pooled = [k["stall"] for k in kills]
    return {
        "decoupled_goodput_mean": statistics.mean(goodput) >= GOALS["decoupled_goodput_mean_min"]
        if goodput
        else None,
        "decoupled_goodput_every_seed": min(goodput) >= GOALS["decoupled_goodput_mean_min"]
        if goodput
        else None,
        "decoupled_uptime_mean": statistics.mean(uptime) >= GOALS["decoupled_uptime_mean_min"]
        if uptime
        else None,
        "stall_worst": max(pooled) <= GOALS["stall_worst_max_seconds"] if pooled else None,
        "stall_median": statistics.median(pooled) <= GOALS["stall_median_max_seconds"] if pooled else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--no-baseline", action="store_true", help="decoupled only")
    parser.add_argument(
        "--compare",
        choices=SYSTEMS_OF,
        default="dp",
        help="baselines to run: dp (elastic data parallel, rows 'baseline'), diloco (synchronous DiLoCo), all",
    )
    parser.add_argument(
        "--hot-spares",
        action="store_true",
        help="killed decoupled learners come back through a prepared hot spare (demo --hot-spares)",
    )
    parser.add_argument(
        "--tabulate", action="store_true", help="run nothing: rebuild the table from DIR/seed-S/report.json"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, kills = [], []
    for seed in args.seeds:
        seed_dir = out / f"seed-{seed}"
        if args.tabulate:
            if not (seed_dir / "report.json").is_file():
                parser.error(f"--tabulate: no {seed_dir / 'report.json'}; run without --tabulate first")
            report = json.loads((seed_dir / "report.json").read_text())
        else:
            report = run_seed(seed, args, seed_dir)
        for system in ("decoupled", *BASELINES):
            if system in report:
                r = report[system]
                row = {"seed": seed, "system": system, **{f: r[f] for f in FIELDS}}
                row["mb_sent_per_learner"] = r["bytes_mean"]["sent"] / 1e6
                row["mb_received_per_learner"] = r["bytes_mean"]["received"] / 1e6
                row["kills"] = len([k for k in r["kills"] if "skipped" not in k])
                row.update(loss_breakdown(r))
                if system == "decoupled":
                    mine = stall_rows(r)
                    row.update({k: stalls.stall_summary(mine)[k] for k in ("sync_kills", *STALLS)})
                    row["stalls"] = mine
                    kills += [{"seed": seed, **k} for k in mine]
                rows.append(row)
    means = {}
    for system in sorted({r["system"] for r in rows}):
        mine = [r for r in rows if r["system"] == system]
        means[system] = {
            f: statistics.mean(r[f] for r in mine if r.get(f) is not None)
            for f in ("goodput", "uptime", "final_eval_loss", "mb_sent_per_learner", *BREAKDOWN, *STALLS)
            if any(r.get(f) is not None for r in mine)
        }
    pooled = [k["stall"] for k in kills]
    accepts = [k["to_first_accept"] for k in kills if k.get("to_first_accept") is not None]
    over_kills = {
        "sync_kills": len(kills),
        "worst_stall": max(pooled, default=None),
        "median_stall": statistics.median(pooled) if pooled else None,
        "worst_to_first_accept": max(accepts, default=None),
        "median_to_first_accept": statistics.median(accepts) if accepts else None,
    }
    met = goals_met(rows, kills)
    result = {"args": vars(args), "goals": GOALS, "goals_met": met, "rows": rows, "means": means,
              "sync_kills": over_kills}  # fmt: skip
    (out / "goodput.json").write_text(json.dumps(result, indent=1))
    print(
        f"{'seed':>4} {'system':10} {'goodput':>8} {'uptime':>7} {'loss':>6} {'failovers':>9} {'MB sent':>8}"
        f" {'blocked':>7} {'down':>6} {'unmerged':>8} {'stall max':>9} {'stall med':>9} {'accept max':>10}"
        f" {'accept med':>10}"
    )
    for r in rows:
        loss = "n/a" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.3f}"
        rest = " ".join(
            f"{r[f]:{w}.3f}" if r.get(f) is not None else f"{'n/a':>{w}}"
            for f, w in (("blocked_fraction", 7), ("down_fraction", 6), ("unmerged_fraction", 8))
        )
        rest += " " + " ".join(
            f"{r[f]:{w}.1f}" if r.get(f) is not None else f"{'n/a':>{w}}"
            for f, w in zip(STALLS, (9, 9, 10, 10), strict=True)
        )
        print(f"{r['seed']:>4} {r['system']:10} {r['goodput']:8.3f} {r['uptime']:7.3f} {loss:>6} "
              f"{r['failovers']:9d} {r['mb_sent_per_learner']:8.1f} {rest}")  # fmt: skip
    print(
        f"means: {json.dumps(means)}\nsynchronizer kills: {json.dumps(over_kills)}\ngoals: {GOALS} met: {met}"
    )
    plot(rows, out / "goodput.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    systems = sorted({r["system"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    width = 0.8 / max(1, len(systems))
    for ax, field in zip(axes, ("goodput", "uptime"), strict=True):
        for k, system in enumerate(systems):
            values = [
                next((r[field] for r in rows if r["seed"] == s and r["system"] == system), 0) for s in seeds
            ]
            ax.bar([i + k * width for i in range(len(seeds))], values, width, label=system)
        ax.set_xticks(
            [i + width * (len(systems) - 1) / 2 for i in range(len(seeds))], [f"seed {s}" for s in seeds]
        )
        ax.set_ylim(0, 1)
        ax.set_title(field)
        ax.legend()
    axes[0].axhline(GOALS["decoupled_goodput_mean_min"], color="red", linestyle=":")
    axes[1].axhline(GOALS["decoupled_uptime_mean_min"], color="red", linestyle=":")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
