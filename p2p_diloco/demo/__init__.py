"""`p2p-diloco demo`: the main job. Real processes on 127.0.0.1: a bootstrap node and N `join` learners
from `peers/demo.toml` train the tiny GPT; `--chaos` SIGKILLs the synchronizer (twice) and a learner
from a seeded schedule and restarts them, with one throttled learner; `--compare` then runs baselines
under the same schedule and time budget (`COMPARE`): ``dp``, the lock-step baseline (`p2p-diloco
baseline-worker`, elastic data-parallel on `hivemind.Optimizer`; a bare `--compare` means it, as it always
did; section "baseline" of the report), ``diloco``, synchronous DiLoCo on hivemind (`baseline-worker
--mode diloco`; section "diloco"), or ``all``. `--chaos-every S` instead injects a seeded fault about every S
seconds for the whole run (SIGSTOPs and bootstrap restarts included), then checks replicas, no loss and
resume. `--hot-spares` keeps a prepared `join --standby` per learner slot that a restart promotes instead of
starting cold (`node.standby`; the down time of the schedule is kept, only the cold start goes). Writes
``report.json`` and PNGs to ``--out``.

Modules: `chaos` (the schedules), `orchestrator` (processes), `faults` (the long schedule's executor),
`endgame` (the long run's end checks), `accounting` (goodput, uptime: pure), `stalls` (stalls around
synchronizer kills: pure), `checks` (no state lost: pure), `report` (numbers, plots), `live` (progress
view). The in-process swarm is `p2p-diloco swarm`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from p2p_diloco.demo.chaos import Schedule, calm_schedule, chaos_schedule, long_chaos_schedule
from p2p_diloco.errors import ConfigError

DEMO_MANIFEST = Path(__file__).resolve().parents[1] / "peers" / "demo.toml"  # package data
COMPARE = {"dp": ("baseline",), "diloco": ("diloco",), "all": ("baseline", "diloco")}  # --compare: systems


def compared_systems(args: argparse.Namespace) -> tuple[str, ...]:
    """The baseline systems `--compare` (and the old `--baseline hivemind`) ask for; `ConfigError` names
    the allowed values for anything else."""
    compare = getattr(args, "compare", None)
    if compare is True:  # a namespace built by hand with the old boolean flag
        compare = "dp"
    baseline = getattr(args, "baseline", None)
    if baseline is not None and baseline != "hivemind":
        raise ConfigError(f"--baseline {baseline}: the only baseline is 'hivemind' (or use --compare)")
    if compare in (None, False):
        return COMPARE["dp"] if baseline else ()
    if compare not in COMPARE:
        raise ConfigError(f"--compare {compare}: choose one of {', '.join(COMPARE)} (a bare --compare is dp)")
    return COMPARE[compare]


def run_system(
    system: str, args: argparse.Namespace, schedule: Schedule, out: Path, period: float | None = None
) -> dict[str, Any]:
    from p2p_diloco.config import RunManifest
    from p2p_diloco.demo.live import LiveView
    from p2p_diloco.demo.orchestrator import SwarmRun
    from p2p_diloco.demo.report import summarize_record

    manifest_path = Path(args.manifest) if getattr(args, "manifest", None) else DEMO_MANIFEST
    workdir = out / f"work-{system}"
    if workdir.exists():
        shutil.rmtree(workdir)
    view = LiveView(system)
    run = SwarmRun(
        system,
        manifest_path,
        args.learners,
        schedule,
        workdir,
        on_tick=view.update,
        eval_every=max(10.0, args.duration / 8),
        hot_spares=getattr(args, "hot_spares", False),
    )
    print(f"{system}: starting a bootstrap node and {args.learners} workers (logs in {workdir})", flush=True)
    try:
        record = run.run()
    finally:
        view.close()
    return summarize_record(record, RunManifest.load(manifest_path), period)


def build_schedule(args: argparse.Namespace) -> Schedule:
    every = getattr(args, "chaos_every", None)
    if every is not None:
        if every <= 0:
            raise ConfigError("--chaos-every must be > 0 seconds")
        return long_chaos_schedule(
            args.learners, args.duration, args.seed, every, slow_step_time=args.slow_step_time
        )
    if args.chaos:
        return chaos_schedule(args.learners, args.duration, args.seed, slow_step_time=args.slow_step_time)
    return calm_schedule(args.duration, args.seed)


def cli_demo(args: argparse.Namespace) -> int:
    if args.learners < 2:
        raise ConfigError("--learners must be at least 2 for a swarm")
    if args.duration <= 0:
        raise ConfigError("--duration must be > 0 seconds")
    baselines = compared_systems(args)
    schedule = build_schedule(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fault in schedule.faults:
        print(f"chaos: {fault.action} at {fault.at:.0f} s, back after {fault.down:.0f} s", flush=True)
    if schedule.every:
        print(
            f"chaos: a fault about every {schedule.every:.0f} s ({len(schedule.faults)} in all)", flush=True
        )
    if schedule.slow_learner is not None:
        print(
            f"chaos: learner-{schedule.slow_learner} throttled to {schedule.slow_step_time} s/step",
            flush=True,
        )
    started = time.time()
    report: dict[str, Any] = {
        "schedule": schedule.to_dict(),
        "hot_spares": getattr(args, "hot_spares", False),
    }
    report["decoupled"] = run_system("decoupled", args, schedule, out)
    for system in baselines:
        period = report["decoupled"]["nominal_round_seconds"] if "decoupled" in report else None
        report[system] = run_system(system, args, schedule, out, period)
    report["wall_seconds"] = time.time() - started
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    from p2p_diloco.demo.report import plot_all, print_summary

    plot_all(report, out)
    print_summary(report, out)
    return 0
