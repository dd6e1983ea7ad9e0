"""`p2p-diloco demo`: the main job. For now it runs the in-process swarm (many peers in one process,
fake clock, real training of the tiny GPT on the embedded corpus), optionally with a seeded chaos
schedule that kills learners and the current synchronizer, and writes a report with plots.

`--duration` is fake (simulated) seconds at one inner step per second for the fastest learner.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from p2p_diloco.config import ConfigError, RunManifest
from p2p_diloco.swarm.inprocess import Crash, InProcessSwarm, SwarmReport, SwarmSpec

SPEEDS = (1.0, 1.0, 1.5, 2.0)


def chaos_schedule(learners: int, duration: float, seed: int) -> tuple[Crash, ...]:
    """Seeded crashes: the synchronizer dies at 1/4 and 5/8 of the run, a random learner in between;
    each comes back after 10-25 s."""
    rng = random.Random(seed)
    crashes = [
        Crash(-1, round(0.25 * duration, 1), round(rng.uniform(10, 25), 1)),
        Crash(
            rng.randrange(learners),
            round(rng.uniform(0.35, 0.5) * duration, 1),
            round(rng.uniform(10, 25), 1),
        ),
        Crash(-1, round(0.625 * duration, 1), round(rng.uniform(10, 25), 1)),
    ]
    return tuple(crashes)


def cli_demo(args: argparse.Namespace) -> int:
    if args.learners < 2:
        raise ConfigError("--learners must be at least 2 for a swarm")
    if args.duration <= 0:
        raise ConfigError("--duration must be > 0 seconds")
    if args.compare:
        raise ConfigError("--compare (the hivemind.Optimizer baseline) is not implemented yet")
    torch.set_num_threads(1)
    manifest = RunManifest.load(Path(__file__).resolve().parent.parent / "peers" / "demo.toml")
    crashes = chaos_schedule(args.learners, args.duration, args.seed) if args.chaos else ()
    speeds = tuple(SPEEDS[i % len(SPEEDS)] for i in range(args.learners))
    spec = SwarmSpec(
        manifest=manifest,
        learners=args.learners,
        step_times=speeds,
        duration=args.duration,
        crashes=crashes,
        eval_every=max(5.0, args.duration / 10),
        seed=args.seed,
    )
    print(f"in-process swarm: {args.learners} learners, step times {speeds} s, {args.duration:.0f} fake s")
    for c in crashes:
        who = "the synchronizer" if c.learner == -1 else f"learner-{c.learner}"
        print(f"  chaos: {who} dies at {c.at:.0f} s, back after {c.down:.0f} s")
    start = time.perf_counter()
    report = InProcessSwarm(spec, log=None).run()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = report.to_dict()
    result["wall_seconds"] = time.perf_counter() - start
    result["schedule"] = [c.__dict__ for c in crashes]
    (out / "report.json").write_text(json.dumps(result, indent=2))
    plot(report, out / "report.png")
    print_report(report, out)
    return 0


def print_report(report: SwarmReport, out: Path) -> None:
    first = report.eval_curve[0][2]
    print(f"eval loss {first:.3f} -> {report.final_eval_loss:.3f} after {report.tokens} tokens")
    print(f"fragment versions {report.versions}; replicas identical: {report.digests_equal}")
    print(f"goodput {report.goodput:.3f} (inner-step time whose work was merged / learners x wall time)")
    print(f"crashes (fake s, learner): {report.crashes}")
    print(f"synchronizer terms: {[(round(t, 1), who, term) for t, who, term in report.terms]}")
    print(f"bytes sent (all peers): {report.bytes_sent}")
    for s in report.learners:
        print(
            f"  {s.peer_id}: {s.steps} steps at {s.step_time} s/step, merged {s.steps_merged:.0f}, "
            f"crashes {s.crashes}"
        )
    print(f"report: {out / 'report.json'}, plot: {out / 'report.png'}")


def plot(report: SwarmReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ts, _, losses = zip(*report.eval_curve)
    a.plot(ts, losses, marker="o")
    a.set_xlabel("fake seconds")
    a.set_ylabel("global model eval loss")
    if report.version_curve:
        vt, vv = zip(*report.version_curve)
        b.step(vt, vv, where="post")
    for t, who, term in report.terms:
        b.axvline(t, color="red", alpha=0.4)
        b.text(t, 0, f" term {term}\n {who}", fontsize=7, color="red")
    for t, who in report.crashes:
        for ax in (a, b):
            ax.axvline(t, color="black", linestyle=":", alpha=0.6)
        b.text(t, b.get_ylim()[1] * 0.9, f" kill learner-{who}", fontsize=7)
    b.set_xlabel("fake seconds")
    b.set_ylabel("sum of fragment versions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
