#!/usr/bin/env python
"""WAN benchmark: learner compute utilization, bytes per parameter per round and update latency over
emulated 100 ms RTT / 20 Mbit/s links, for p2p_diloco and the hivemind.Optimizer baseline (needs root).

    sudo .venv/bin/python scripts/bench_wan.py --out bench-out [--learners 4] [--rtt-ms 100] [--rate-mbit 20]
        [--duration 90] [--manifest peers/demo.toml] [--systems decoupled,baseline]

Each system runs on a fresh `WanEmulator`: a bootstrap and N learners, each in its own namespace, every
access link with one-way delay RTT/4 (so any two peers are RTT apart) and the given rate each way.
Learners train flat out on the CPU, or emulate a device with ``--min-step-time S`` (a step then takes and
counts as at least S seconds, leaving the CPU to the network threads as a GPU would). After a warm-up (every learner reported progress and the global model
moved), a window of ``--duration`` seconds is measured from the peers' ``events.jsonl``:

* utilization: compute seconds (time inside inner steps) / wall seconds of the window, per learner;
* bytes per parameter per round, up and down: payload bytes (the progress events' transport counters)
  and wire bytes (the learner's access-link interface counters: all traffic incl. DHT, TLS, TCP/IP),
  divided by the rounds in the window and the parameter count. A round is one update of every
  fragment (published updates / P) for p2p_diloco, one global optimizer step for the baseline;
* publish -> arrival: seconds from the synchronizer's ``published`` event to each learner's ``applied``
  event of the same (fragment, version). The synchronizer does not log when quorum was reached, so the
  quorum -> publish part (the grace window) is not included (noted in the JSON).

Writes DIR/wan.json and DIR/wan.png.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from p2p_diloco.config import RunManifest
from p2p_diloco.demo.accounting import counters_in_window
from p2p_diloco.model.gpt import build_model
from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.state import read_events
from p2p_diloco.wan import LinkSpec, PeerSpec, WanEmulator, environment_problem

REPO_ROOT = Path(__file__).resolve().parents[1]
DECOUPLED, BASELINE = "decoupled", "baseline"
START_TIMEOUT = 180.0
WARMUP_TIMEOUT = 240.0
STOP_TIMEOUT = 60.0


class Runner:
    """One system on one emulator: bootstrap, learners, their logs and state directories."""

    def __init__(self, system: str, args: argparse.Namespace, workdir: Path):
        self.system, self.args, self.workdir = system, args, workdir
        self.names = [f"l{i + 1}" for i in range(args.learners)]
        link = LinkSpec(delay_ms=args.rtt_ms / 4, rate_mbit=args.rate_mbit)
        self.wan = WanEmulator([PeerSpec("boot", link), *(PeerSpec(n, link) for n in self.names)])
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.state_dirs = {n: workdir / f"state-{n}" for n in self.names}

    def spawn(self, peer: str, argv: list[str]) -> None:
        self.logs[peer] = self.workdir / f"{peer}.log"
        with open(self.logs[peer], "wb") as log:
            self.procs[peer] = self.wan.spawn(peer, argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)

    def wait_line(self, peer: str, prefix: str) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            for line in self.logs[peer].read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
            if self.procs[peer].poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"{peer} did not print {prefix!r}; see {self.logs[peer]}")

    def start(self) -> None:
        self.wan.start()
        cli = [sys.executable, "-m", "p2p_diloco"]
        self.spawn("boot", [*cli, "bootstrap", "--listen", f"/ip4/{self.wan.address('boot')}/tcp/31337"])
        bootstrap = self.wait_line("boot", "bootstrap address: ").removeprefix("bootstrap address: ").strip()
        for name in self.names:
            identity = self.workdir / f"{name}.key"
            write_identity(identity, force=True)
            common = [
                str(self.args.manifest), "--initial-peers", bootstrap, "--identity", str(identity),
                "--state-dir", str(self.state_dirs[name]), "--listen", f"/ip4/{self.wan.address(name)}/tcp/0",
                "--progress-every", "1", "--threads", str(self.args.threads),
                "--min-step-time", str(self.args.min_step_time),
            ]  # fmt: skip
            if self.system == DECOUPLED:
                self.spawn(name, [*cli, "join", *common, "--persist-every", "30"])
            else:
                self.spawn(name, [*cli, "baseline-worker", *common, "--learners", str(self.args.learners)])

    def events(self, name: str) -> list[dict]:
        return read_events(self.state_dirs[name])

    def warmed_up(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.logs[name]}")
        moved = "published" if self.system == DECOUPLED else "global_step"
        every_progress = all(any(e["event"] == "progress" for e in self.events(n)) for n in self.names)
        return every_progress and any(e["event"] == moved for n in self.names for e in self.events(n))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        self.wan.teardown()


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "median": None, "p90": None, "max": None}
    s = sorted(values)
    return {"count": len(s), "median": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))], "max": s[-1]}


def measure(runner: Runner, params: int, fragments: int, start: float, end: float, wire: dict) -> dict:
    wall = end - start
    per_learner, arrivals = {}, []
    events = {n: runner.events(n) for n in runner.names}
    in_window = {n: [e for e in ev if start <= (e.get("t") or 0) <= end] for n, ev in events.items()}
    if runner.system == DECOUPLED:
        published = {
            (e["fragment"], e["version"]): e["t"]
            for ev in in_window.values()
            for e in ev
            if e["event"] == "published"
        }
        rounds = len(published) / fragments
        for ev in events.values():
            for e in ev:
                key = (e.get("fragment"), e.get("version"))
                if e["event"] == "applied" and key in published:
                    arrivals.append(e["t"] - published[key])
    else:
        epochs = [e["epoch"] for ev in in_window.values() for e in ev if e["event"] == "global_step"]
        rounds = float(max(epochs) - min(epochs) + 1) if epochs else 0.0
    for name in runner.names:
        c = counters_in_window(events[name], start, end)
        roles = [e.get("role") for e in in_window[name] if e["event"] == "progress"]
        per_round = max(rounds, 1e-9) * params
        per_learner[name] = {
            "role": max(set(roles), key=roles.count) if roles and roles[0] else "learner",
            # a paced learner (join) counts its paced steps as compute; a paced baseline worker logs the
            # sleep separately as paced_seconds (emulated device time too)
            "utilization": (c["compute_seconds"] + c["paced_seconds"]) / wall,
            "blocked_fraction": c["blocked_seconds"] / wall,
            "merged_fraction": c["compute_merged"] / c["compute_seconds"] if c["compute_seconds"] > 0 else None,
            "tokens": c["tokens"],
            "payload_bytes_per_param_per_round": {"up": c["bytes_sent"] / per_round, "down": c["bytes_received"] / per_round},
            "wire_bytes_per_param_per_round": {"up": wire[name]["sent"] / per_round, "down": wire[name]["received"] / per_round},
        }  # fmt: skip
    learners_only = [v for v in per_learner.values() if v["role"] != "synchronizer"] or list(
        per_learner.values()
    )
    return {
        "wall_seconds": wall,
        "rounds": rounds,
        "utilization_mean": statistics.mean(v["utilization"] for v in per_learner.values()),
        "utilization_min": min(v["utilization"] for v in per_learner.values()),
        "utilization_mean_non_synchronizer": statistics.mean(v["utilization"] for v in learners_only),
        "publish_to_arrival_seconds": _percentiles(arrivals) if runner.system == DECOUPLED else None,
        "per_learner": per_learner,
    }


def run_system(system: str, args: argparse.Namespace, params: int, fragments: int) -> dict:
    workdir = args.out / f"{system}-run"
    workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(system, args, workdir)
    try:
        runner.start()
        deadline = time.monotonic() + WARMUP_TIMEOUT
        while not runner.warmed_up():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: no progress within {WARMUP_TIMEOUT:.0f} s; logs in {workdir}")
            time.sleep(1.0)
        before = {n: runner.wan.link_counters(n) for n in runner.names}
        start = time.time()
        print(f"{system}: warmed up; measuring {args.duration:.0f} s", file=sys.stderr, flush=True)
        time.sleep(args.duration)  # the measurement window itself (wall time is what is measured)
        end = time.time()
        after = {n: runner.wan.link_counters(n) for n in runner.names}
        time.sleep(2.0)  # let the last progress events of the window land
        wire = {n: {k: after[n][k] - before[n][k] for k in ("sent", "received")} for n in runner.names}
        return measure(runner, params, fragments, start, end, wire)
    finally:
        runner.stop()


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [
        s
        for s in report["systems"]
        if isinstance(report["systems"][s], dict) and "per_learner" in report["systems"][s]
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        per = report["systems"][system]["per_learner"]
        names = list(per)
        xs = [i + k * width for i in range(len(names))]
        axes[0].bar(xs, [per[n]["utilization"] for n in names], width, label=system)
        up = [per[n]["wire_bytes_per_param_per_round"]["up"] for n in names]
        down = [per[n]["wire_bytes_per_param_per_round"]["down"] for n in names]
        axes[1].bar(xs, up, width / 2, label=f"{system} up")
        axes[1].bar([x + width / 2 for x in xs], down, width / 2, label=f"{system} down")
    for ax in axes:
        ax.set_xticks(
            range(report["config"]["learners"]), [f"l{i + 1}" for i in range(report["config"]["learners"])]
        )
        ax.legend(fontsize=8)
    axes[0].set_ylabel("compute utilization (inner-step time / wall)")
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylabel("wire bytes per parameter per round")
    cfg = report["config"]
    fig.suptitle(
        f"{cfg['learners']} learners, {cfg['rtt_ms']:.0f} ms RTT, {cfg['rate_mbit']:.0f} Mbit/s per link"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--rtt-ms", type=float, default=100.0)
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=90.0, help="measured seconds per system")
    parser.add_argument("--manifest", type=Path, default=REPO_ROOT / "peers" / "demo.toml")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--min-step-time",
        type=float,
        default=0.0,
        help="emulate a device with this step time (0: train flat out on the CPU)",
    )
    parser.add_argument("--systems", default=f"{DECOUPLED},{BASELINE}")
    args = parser.parse_args()
    if problem := environment_problem():
        print(f"bench_wan: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.manifest = args.manifest.resolve()
    manifest = RunManifest.load(args.manifest)
    params = sum(p.numel() for p in build_model(manifest.model).parameters())
    report: dict = {
        "config": {
            "learners": args.learners, "rtt_ms": args.rtt_ms, "rate_mbit": args.rate_mbit,
            "duration_s": args.duration, "manifest": str(args.manifest), "parameters": params,
            "fragments": manifest.diloco.fragments, "threads": args.threads, "cpu_cores": _cores(),
            "min_step_time": args.min_step_time,
        },
        "notes": [
            "utilization = seconds inside inner steps / wall seconds of the window; with --min-step-time a step "
            "counts as max(min_step_time, its CPU time) (emulated device); the baseline sleeps only what its "
            "step including the all-reduce left of min_step_time, counted as compute",
            "a round = one update of every fragment (decoupled) or one global optimizer step (baseline)",
            "publish_to_arrival excludes quorum -> publish (the grace window): quorum time is not logged",
        ],
        "systems": {},
    }  # fmt: skip
    for system in args.systems.split(","):
        if system == BASELINE and not _has_baseline():
            report["systems"][system] = {
                "todo": "p2p-diloco baseline-worker is not available in this checkout"
            }
            continue
        started = time.monotonic()
        report["systems"][system] = run_system(system, args, params, manifest.diloco.fragments)
        report["systems"][system]["bench_seconds"] = time.monotonic() - started
        (args.out / "wan.json").write_text(json.dumps(report, indent=1))
    (args.out / "wan.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "wan.png")
    print(
        json.dumps(
            {s: {k: v for k, v in r.items() if k != "per_learner"} for s, r in report["systems"].items()},
            indent=1,
        )
    )
    return 0


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _has_baseline() -> bool:
    try:
        import p2p_diloco.baseline.worker  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
