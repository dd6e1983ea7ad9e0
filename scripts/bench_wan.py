#!/usr/bin/env python
"""WAN benchmark: learner compute utilization, bytes per parameter per round and update latency over
emulated 100 ms RTT / 20 Mbit/s links, for p2p_diloco and the hivemind.Optimizer baseline (needs root).

    sudo .venv/bin/python scripts/bench_wan.py --out bench-out [--learners 4] [--rtt-ms 100] [--rate-mbit 20]
        [--duration 90] [--manifest peers/demo.toml] [--systems decoupled,baseline]
        [--params 9M] [--batch-size B] [--inner-steps H]

Systems: ``baseline`` (hivemind.Optimizer), ``decoupled`` (the manifest's codec) and
``decoupled:CODEC[:DENSITY]`` (the same run with ``[wire] codec``/``density`` replaced, e.g.
``decoupled:topk-int8:0.03``). ``--params`` replaces the manifest's model by a byte GPT of about that
size (``gpt_config_for``), so that dense deltas fill the links; ``--batch-size`` and ``--inner-steps``
replace ``[diloco] batch_size`` and ``inner_steps``; ``--timing wan`` (the default) replaces heartbeat
and lease times by ones that hold on 100 ms links (``WAN_TIMING``), ``--timing manifest`` keeps them. Every system runs from the manifest written to its
work folder (``run.toml``).

Each system runs on a fresh `WanEmulator`: a bootstrap and N learners, each in its own namespace, every
access link with one-way delay RTT/4 (so any two peers are RTT apart) and the given rate each way.
Learners train flat out on the CPU, or emulate a device with ``--min-step-time S`` (a step then takes and
counts as at least S seconds, leaving the CPU to the network threads as a GPU would). After a warm-up
(every learner reported progress and the global model moved) and ``--settle`` seconds more (so that the
work not yet merged has reached its steady level), a window of ``--duration`` seconds is measured from
the peers' ``events.jsonl``:

* utilization: compute seconds (time inside inner steps) / wall seconds of the window, per learner;
* bytes per parameter per round, up and down: payload bytes (the progress events' transport counters)
  and wire bytes (the learner's access-link interface counters: all traffic incl. DHT, TLS, TCP/IP),
  divided by the rounds in the window and the parameter count. A round is one update of every
  fragment (published updates / P) for p2p_diloco, one global optimizer step for the baseline;
* useful utilization: utilization x the share of compute whose delta was merged (``merged_fraction``);
  a p2p_diloco learner never waits on the network, so a saturated link shows up here and in
* steps per merged delta: the learner's inner steps in the window / the updates in the window that name
  it as a contributor; H/P when every due delta goes out and is merged at once, more when deltas wait
  ("tau reached") behind a slow link;
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
import tomllib
from pathlib import Path

from p2p_diloco.config import RunManifest
from p2p_diloco.demo.accounting import counters_in_window
from p2p_diloco.model.gpt import build_model, gpt_config_for, parse_parameter_count
from p2p_diloco.net.identity import peer_id_of, write_identity
from p2p_diloco.node.state import read_events
from p2p_diloco.wan import LinkSpec, PeerSpec, WanEmulator, environment_problem

REPO_ROOT = Path(__file__).resolve().parents[1]
DECOUPLED, BASELINE = "decoupled", "baseline"
START_TIMEOUT = 180.0
WARMUP_TIMEOUT = 240.0
STOP_TIMEOUT = 60.0
# [timing] for links of 100 ms RTT on a loaded machine (--timing wan, the default): with the demo's 6 s
# lease, renewals (a DHT store across the emulated links) often landed after the lease had lapsed, and
# every lapse cost a failover and the deltas in flight to the old holder (bench_wan at 9M parameters).
WAN_TIMING = {
    "heartbeat_period": 2.0,
    "heartbeat_ttl": 10.0,
    "lease_ttl": 20.0,
    "claim_grace": 4.0,
    "lease_margin": 1.0,
}


class Runner:
    """One system on one emulator: bootstrap, learners, their logs and state directories."""

    def __init__(self, system: str, args: argparse.Namespace, workdir: Path, manifest: Path):
        self.system, self.args, self.workdir, self.manifest = system, args, workdir, manifest
        self.peer_ids: dict[str, str] = {}
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
            self.peer_ids[name] = peer_id_of(identity)
            common = [
                str(self.manifest), "--initial-peers", bootstrap, "--identity", str(identity),
                "--state-dir", str(self.state_dirs[name]), "--listen", f"/ip4/{self.wan.address(name)}/tcp/0",
                "--progress-every", "1", "--threads", str(self.args.threads),
                "--min-step-time", str(self.args.min_step_time),
            ]  # fmt: skip
            if self.system != BASELINE:
                self.spawn(name, [*cli, "join", *common, "--persist-every", "30"])
            else:
                self.spawn(name, [*cli, "baseline-worker", *common, "--learners", str(self.args.learners)])

    def events(self, name: str) -> list[dict]:
        return read_events(self.state_dirs[name])

    def warmed_up(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.logs[name]}")
        moved = "global_step" if self.system == BASELINE else "published"
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


def measure(runner: Runner, manifest: RunManifest, params: int, start: float, end: float, wire: dict) -> dict:
    wall, fragments = end - start, manifest.diloco.fragments
    per_learner, arrivals = {}, []
    events = {n: runner.events(n) for n in runner.names}
    in_window = {n: [e for e in ev if start <= (e.get("t") or 0) <= end] for n, ev in events.items()}
    decoupled = runner.system != BASELINE
    published: dict[tuple[int, int], float] = {}
    merged_deltas = dict.fromkeys(runner.names, 0)
    if decoupled:
        by_peer_id = {pid: name for name, pid in runner.peer_ids.items()}
        for ev in in_window.values():
            for e in ev:
                if e["event"] == "published" and (e["fragment"], e["version"]) not in published:
                    published[(e["fragment"], e["version"])] = e["t"]
                    for contributor in set(e.get("contributors") or ()):
                        if contributor in by_peer_id:
                            merged_deltas[by_peer_id[contributor]] += 1
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
        steps = c["tokens"] / (manifest.diloco.batch_size * manifest.model.block_size)
        merged_fraction = c["compute_merged"] / c["compute_seconds"] if c["compute_seconds"] > 0 else None
        utilization = (c["compute_seconds"] + c["paced_seconds"]) / wall
        per_learner[name] = {
            "role": max(set(roles), key=roles.count) if roles and roles[0] else "learner",
            # a paced learner (join) counts its paced steps as compute; a paced baseline worker logs the
            # sleep separately as paced_seconds (emulated device time too)
            "utilization": utilization,
            "blocked_fraction": c["blocked_seconds"] / wall,
            "merged_fraction": merged_fraction,
            "useful_utilization": utilization * min(1.0, merged_fraction) if merged_fraction is not None else None,
            "tokens": c["tokens"],
            "inner_steps": steps,
            "merged_deltas": merged_deltas[name] if decoupled else None,
            "steps_per_merged_delta": steps / merged_deltas[name] if decoupled and merged_deltas[name] else None,
            "payload_bytes_per_param_per_round": {"up": c["bytes_sent"] / per_round, "down": c["bytes_received"] / per_round},
            "wire_bytes_per_param_per_round": {"up": wire[name]["sent"] / per_round, "down": wire[name]["received"] / per_round},
        }  # fmt: skip
    learners_only = [v for v in per_learner.values() if v["role"] != "synchronizer"] or list(
        per_learner.values()
    )
    useful = [v["useful_utilization"] for v in per_learner.values() if v["useful_utilization"] is not None]
    return {
        "wall_seconds": wall,
        "rounds": rounds,
        "nominal_steps_per_delta": manifest.diloco.steps_per_fragment if decoupled else None,
        "useful_utilization_mean": statistics.mean(useful) if useful else None,
        "useful_utilization_min": min(useful) if useful else None,
        "utilization_mean": statistics.mean(v["utilization"] for v in per_learner.values()),
        "utilization_min": min(v["utilization"] for v in per_learner.values()),
        "utilization_mean_non_synchronizer": statistics.mean(v["utilization"] for v in learners_only),
        "publish_to_arrival_seconds": _percentiles(arrivals) if decoupled else None,
        "per_learner": per_learner,
    }


def system_manifest(system: str, args: argparse.Namespace, workdir: Path) -> Path:
    """Write the manifest `system` runs from (module docstring) to `workdir/run.toml`."""
    raw = tomllib.loads(args.manifest.read_text())
    if args.params:
        model = gpt_config_for(args.params)
        raw["model"] = {k: getattr(model, k) for k in ("n_layer", "n_head", "n_embd", "block_size")}
    diloco = raw.setdefault("diloco", {})
    for key, value in (("batch_size", args.batch_size), ("inner_steps", args.inner_steps)):
        if value is not None:
            diloco[key] = value
    if args.timing == "wan":
        raw["timing"] = raw.get("timing", {}) | WAN_TIMING
    _, _, codec = system.partition(":")
    if codec:
        name, _, density = codec.partition(":")
        raw.setdefault("wire", {})["codec"] = name
        if density:
            raw["wire"]["density"] = float(density)
    path = workdir / "run.toml"
    path.write_text(toml_text(raw))
    RunManifest.load(path)  # a wrong variant fails here, with the manifest's own message
    return path


def toml_text(raw: dict) -> str:
    """TOML for a manifest: top-level scalars and lists, then one table per section."""

    def value(v: object) -> str:
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)  # str, int, float and bool are TOML as JSON writes them

    lines = [f"{k} = {value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for section, table in raw.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]", *(f"{k} = {value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def run_system(system: str, args: argparse.Namespace) -> dict:
    workdir = args.out / f"{system.replace(':', '_')}-run"
    workdir.mkdir(parents=True, exist_ok=True)
    manifest_path = system_manifest(system, args, workdir)
    manifest = RunManifest.load(manifest_path)
    params = sum(p.numel() for p in build_model(manifest.model).parameters())
    runner = Runner(system, args, workdir, manifest_path)
    try:
        runner.start()
        deadline = time.monotonic() + WARMUP_TIMEOUT
        while not runner.warmed_up():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: no progress within {WARMUP_TIMEOUT:.0f} s; logs in {workdir}")
            time.sleep(1.0)
        # every learner's unmerged work (steps since each fragment's last send, deltas in flight) reaches
        # its steady level before the window opens; measured from the first update, that backlog would
        # still be growing and the merged share of the window would read low by its growth
        time.sleep(args.settle)
        before = {n: runner.wan.link_counters(n) for n in runner.names}
        start = time.time()
        print(f"{system}: warmed up; measuring {args.duration:.0f} s", file=sys.stderr, flush=True)
        time.sleep(args.duration)  # the measurement window itself (wall time is what is measured)
        end = time.time()
        after = {n: runner.wan.link_counters(n) for n in runner.names}
        time.sleep(2.0)  # let the last progress events of the window land
        wire = {n: {k: after[n][k] - before[n][k] for k in ("sent", "received")} for n in runner.names}
        result = measure(runner, manifest, params, start, end, wire)
        result["manifest"] = manifest.to_dict() | {"parameters": params}
        return result
    finally:
        runner.stop()


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s, r in report["systems"].items() if isinstance(r, dict) and "per_learner" in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / max(1, len(systems))
    learners = report["config"]["learners"]
    for k, system in enumerate(systems):
        result = report["systems"][system]
        per = result["per_learner"]
        names = list(per)
        xs = [i + k * width for i in range(len(names))]
        bars = axes[0].bar(xs, [per[n]["utilization"] for n in names], width, alpha=0.35)
        useful = [per[n]["useful_utilization"] or 0.0 for n in names]
        axes[0].bar(xs, useful, width, color=bars[0].get_facecolor()[:3], label=system)
        steps = [per[n]["steps_per_merged_delta"] or 0.0 for n in names]
        axes[1].bar(xs, steps, width, label=system)
        up = [per[n]["wire_bytes_per_param_per_round"]["up"] for n in names]
        down = [per[n]["wire_bytes_per_param_per_round"]["down"] for n in names]
        axes[2].bar(xs, up, width / 2, label=f"{system} up")
        axes[2].bar([x + width / 2 for x in xs], down, width / 2, label=f"{system} down")
        if result.get("nominal_steps_per_delta"):
            axes[1].axhline(result["nominal_steps_per_delta"], color="grey", linestyle=":", linewidth=1)
    for ax in axes:
        ax.set_xticks(range(learners), [f"l{i + 1}" for i in range(learners)])
    axes[0].legend(fontsize=7, loc="lower left")
    axes[1].legend(fontsize=7, loc="upper right")
    axes[2].legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    axes[0].set_ylabel("utilization: light = inner-step time / wall,\nsolid = x share of compute merged")
    axes[0].set_ylim(0, 1.05)
    axes[0].axhline(0.99, color="grey", linestyle=":", linewidth=1)
    axes[1].set_ylabel("inner steps per merged delta (dotted: H/P)")
    axes[2].set_ylabel("wire bytes per parameter per round")
    axes[2].set_yscale("log")
    cfg = report["config"]
    fig.suptitle(
        f"{cfg['learners']} learners, {cfg['rtt_ms']:.0f} ms RTT, {cfg['rate_mbit']:.0f} Mbit/s per link, "
        f"{cfg['parameters'] / 1e6:.1f}M parameters"
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
    parser.add_argument(
        "--systems",
        default=f"{DECOUPLED},{BASELINE}",
        help="comma-separated: baseline, decoupled, decoupled:CODEC[:DENSITY] (e.g. decoupled:topk-int8:0.03)",
    )
    parser.add_argument("--params", help="replace the manifest's model by a byte GPT of about this size (9M)")
    parser.add_argument(
        "--settle", type=float, default=30.0, help="seconds between warm-up (first update) and the window"
    )
    parser.add_argument("--batch-size", type=int, help="replace [diloco] batch_size")
    parser.add_argument(
        "--timing",
        choices=("wan", "manifest"),
        default="wan",
        help="wan: heartbeats and leases for 100 ms links (WAN_TIMING); manifest: the manifest's [timing]",
    )
    parser.add_argument("--inner-steps", type=int, help="replace [diloco] inner_steps (H)")
    args = parser.parse_args()
    try:
        args.params = parse_parameter_count(args.params) if args.params else None
    except ValueError as exc:
        parser.error(f"--params: {exc}")
    systems = args.systems.split(",")
    for system in systems:
        if system != BASELINE and system.split(":")[0] != DECOUPLED:
            parser.error(
                f"--systems: unknown system {system!r}; use baseline, decoupled or decoupled:CODEC[:DENSITY]"
            )
    if problem := environment_problem():
        print(f"bench_wan: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.manifest = args.manifest.resolve()
    check_dir = args.out / "manifest-check"
    check_dir.mkdir(exist_ok=True)
    for system in systems:  # every variant's manifest is valid before anything starts
        try:
            manifest = RunManifest.load(system_manifest(system, args, check_dir))
        except ValueError as exc:  # ConfigError included
            parser.error(f"--systems {system}: {exc}")
    params = sum(p.numel() for p in build_model(manifest.model).parameters())
    report: dict = {
        "config": {
            "learners": args.learners, "rtt_ms": args.rtt_ms, "rate_mbit": args.rate_mbit,
            "duration_s": args.duration, "manifest": str(args.manifest), "parameters": params,
            "fragments": manifest.diloco.fragments, "threads": args.threads, "cpu_cores": _cores(),
            "min_step_time": args.min_step_time, "batch_size": manifest.diloco.batch_size,
            "inner_steps": manifest.diloco.inner_steps, "block_size": manifest.model.block_size,
            "timing": args.timing, "settle_s": args.settle,
        },
        "notes": [
            "utilization = seconds inside inner steps / wall seconds of the window; with --min-step-time a step "
            "counts as max(min_step_time, its CPU time) (emulated device); the baseline sleeps only what its "
            "step including the all-reduce left of min_step_time, counted as compute",
            "a round = one update of every fragment (decoupled) or one global optimizer step (baseline)",
            "publish_to_arrival excludes quorum -> publish (the grace window): quorum time is not logged",
            "useful_utilization = utilization x merged_fraction (compute whose delta reached the global model)",
            "steps_per_merged_delta = inner steps in the window / updates in the window naming the learner",
        ],
        "systems": {},
    }  # fmt: skip
    for system in systems:
        if system == BASELINE and not _has_baseline():
            report["systems"][system] = {
                "todo": "p2p-diloco baseline-worker is not available in this checkout"
            }
            continue
        started = time.monotonic()
        report["systems"][system] = run_system(system, args)
        report["systems"][system]["bench_seconds"] = time.monotonic() - started
        (args.out / "wan.json").write_text(json.dumps(report, indent=1))
    (args.out / "wan.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "wan.png")
    print(
        json.dumps(
            {
                s: {k: v for k, v in r.items() if k not in ("per_learner", "manifest")}
                for s, r in report["systems"].items()
            },
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
