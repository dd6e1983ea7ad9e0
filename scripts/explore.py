#!/usr/bin/env python3
"""Explore seeds of the swarm in a bottle (`p2p_diloco.sim.bottle`): each seed is one short simulated run
with its own faults; print each failing seed's broken rule, the virtual time and the command that
replays it with the full trace.

    scripts/explore.py --seeds 0-199                    # many seeds, default scenario (5 nodes, 1 shard)
    scripts/explore.py --seeds 0-49 --nodes 8 --shards 4 --faults kill,freeze,partition
    scripts/explore.py --replay 17 --trace trace.txt    # one seed, its whole trace to a file
    scripts/explore.py --seeds 0-19 --jobs 2 --out DIR  # two processes; DIR/explore.json (+ .png)

A run is deterministic for its seed and scenario whatever the machine or the process; this script
fixes PYTHONHASHSEED (re-executing itself if needed) so that a replay matches what failed.
Exit status: 0 when every seed held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path

if os.environ.get("PYTHONHASHSEED") != "0":  # one hash seed everywhere: a replay is the same run
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p_diloco.sim.bottle.faults import Kind  # noqa: E402
from p2p_diloco.sim.bottle.run import Result, Scenario, simulate  # noqa: E402


def seed_range(text: str) -> list[int]:
    """'0-199' or '7' or '1,5,9-12'."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            seeds.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds {text!r}: expected A-B, N or a comma list of them"
        ) from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: no seed in that range")
    return seeds


def kinds(text: str) -> tuple[Kind, ...]:
    try:
        return tuple(Kind(k.strip()) for k in text.split(",") if k.strip())
    except ValueError:
        known = ", ".join(k.value for k in Kind)
        raise argparse.ArgumentTypeError(f"--faults {text!r}: each must be one of {known}") from None


def scenario_of(args: argparse.Namespace) -> Scenario:
    return Scenario(
        nodes=args.nodes,
        shards=args.shards,
        faults=args.fault_count,
        kinds=args.faults,
        fault_window=args.window,
    )


def replay_command(seed: int, args: argparse.Namespace) -> str:
    faults = ",".join(k.value for k in args.faults)
    return (
        f"scripts/explore.py --replay {seed} --nodes {args.nodes} --shards {args.shards} "
        f"--fault-count {args.fault_count} --window {args.window:g} --faults {faults} --trace seed-{seed}.txt"
    )


def run_one(seed: int, scenario: Scenario) -> Result:
    return simulate(seed, scenario)


def report_line(result: Result, args: argparse.Namespace) -> str:
    head = f"seed {result.seed}: "
    if result.ok:
        return (
            head + f"ok in {result.wall_seconds:.1f} s ({result.virtual_seconds:.0f} virtual s), "
            f"versions {list(result.versions)}, {result.claims} claims, {result.published} updates"
        )
    v = result.violation
    return (
        head + f"FAILED {v.rule} at t={v.t:.3f}: {v.detail}\n    replay: {replay_command(result.seed, args)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seeds", type=seed_range, help="seeds to run: A-B, N, or a comma list")
    which.add_argument("--replay", type=int, help="one seed, with its full trace (--trace FILE, else stdout)")
    parser.add_argument("--nodes", type=int, default=Scenario.nodes)
    parser.add_argument("--shards", type=int, default=Scenario.shards)
    parser.add_argument("--fault-count", type=int, default=Scenario.faults, help="faults per run")
    parser.add_argument("--window", type=float, default=Scenario.fault_window, help="fault window, virtual s")
    parser.add_argument("--faults", type=kinds, default=tuple(Kind), help="fault kinds (comma list)")
    parser.add_argument("--jobs", type=int, default=1, help="processes running seeds side by side")
    parser.add_argument("--trace", type=Path, help="--replay: write the trace here")
    parser.add_argument("--out", type=Path, help="write explore.json (every seed's outcome) here")
    args = parser.parse_args(argv)
    try:
        scenario = scenario_of(args)
    except ValueError as exc:
        parser.error(str(exc))

    if args.replay is not None:
        result = simulate(args.replay, scenario)
        if args.trace:
            args.trace.write_text(result.trace_text)
        else:
            sys.stdout.write(result.trace_text)
        for fault in result.faults:
            print(f"  fault: {fault.describe()}", file=sys.stderr)
        print(report_line(result, args), file=sys.stderr)
        return 0 if result.ok else 1

    started = time.perf_counter()
    results: list[Result] = []
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for result in pool.map(run_one, args.seeds, [scenario] * len(args.seeds)):
            results.append(result)
            print(report_line(result, args), flush=True)
    failed = [r for r in results if not r.ok]
    wall = time.perf_counter() - started
    per_seed = sum(r.wall_seconds for r in results) / len(results)
    print(
        f"{len(results) - len(failed)} passed, {len(failed)} failed ({wall:.0f} s, {per_seed:.1f} s per seed)"
    )
    if args.out:
        write_report(args.out, results, scenario, wall)
    return 1 if failed else 0


def write_report(out: Path, results: list[Result], scenario: Scenario, wall: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "seed": r.seed,
            "ok": r.ok,
            "rule": str(r.violation.rule) if r.violation else None,
            "t": r.violation.t if r.violation else None,
            "detail": r.violation.detail if r.violation else None,
            "wall_seconds": round(r.wall_seconds, 2),
            "virtual_seconds": r.virtual_seconds,
            "versions": list(r.versions),
            "claims": r.claims,
            "updates": r.published,
            "trace_digest": r.trace_digest,
            "faults": [f.describe() for f in r.faults],
        }
        for r in results
    ]
    summary = {"scenario": repr(scenario), "wall_seconds": round(wall, 1), "seeds": rows}
    (out / "explore.json").write_text(json.dumps(summary, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    ax.bar(
        [r["seed"] for r in rows],
        [r["wall_seconds"] for r in rows],
        color=["tab:green" if r["ok"] else "tab:red" for r in rows],
    )
    ax.set_xlabel("seed")
    ax.set_ylabel("wall seconds")
    ax.set_title("explore: wall time per seed (red: a rule broke)")
    fig.tight_layout()
    fig.savefig(out / "explore.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())
