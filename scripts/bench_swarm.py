#!/usr/bin/env python
"""Swarm-size benchmark (issue #29 item 4): what each peer carries per merged update as the swarm grows.

    .venv/bin/python scripts/bench_swarm.py --learners 4,8,16 --shards 1,4 --out docs/results/swarm
    .venv/bin/python scripts/bench_swarm.py --inprocess 16,64,256,1024 --shards 1,4 --real-upto 64 \
        --out docs/results/swarm-model
    .venv/bin/python scripts/bench_swarm.py --inprocess 64,256,1024 --shards 4 --peers-per-shard 16 \
        --real-upto 0 --out docs/results/swarm-scaled        # also S grown with the swarm (S = M / 16)
    .venv/bin/python scripts/bench_swarm.py --tabulate --out DIR      # measures and figures again from DIR
    .venv/bin/python scripts/bench_swarm.py --inprocess 1 --tabulate --out DIR   # the same, in-process
    .venv/bin/python scripts/bench_swarm.py --sim-peers 16,64,256 --sim-profile 64 --out docs/results/scale

Once relaying has landed, add `--set diloco.fanout=3` to the real-process command (the figures then take
that fan-out as the target and read the peers' relay counters). The real grid takes about 12 minutes on a
quiet machine (startup of 16 processes included); `--real-upto 64` adds several minutes (the real in-process
swarm at 64 peers costs 9-21 s of wall time per fake second on a loaded 2-core machine).

Real processes (`--learners`): per configuration (learners N, synchronizer shards S) a bootstrap node and
N `p2p-diloco join` learners on 127.0.0.1 (`demo.workers.Workers`, the demo's process management), each
paced with `--min-step-time` (default 0.5 s, so the CPU is not the limit), train the demo's tiny GPT from
a manifest generated into OUT/n{N}-s{S}/manifest.toml: peers/demo.toml with batch 8, `[diloco]
synchronizer_shards = S` when S > 1, and any `--set SECTION.KEY=VALUE` (e.g. `--set diloco.fanout=3` once
that knob exists). After all are up and `--warmup` seconds more, `--duration` seconds are measured from
the peers' events (`demo.spread`): per peer bytes sent and received per merged update, the busiest peer,
the publishers' fan-out (bytes sent per update / update size), propagation publish -> applied on the last
peer (p50, p99), goodput (paced time counted as compute). A configuration the code rejects (e.g. S > 1
before shards exist) is recorded as skipped with the reason. No per-peer rate limits: the WAN emulator
(scripts/wan_emulator.py) needs root and network namespaces; loopback is unlimited here.

In-process (`--inprocess`): see `sim.dissemination` for what it runs and why (module docstring there).

Simulated peers (`--sim-peers`, issue #40 item 3): per size M a clean run of M whole nodes (real `Peer`,
`Learner`, `StateDir`) in the swarm in a bottle with S = max(1, M // 16) shards and the default link model,
`--sim-warmup` + `--sim-window` (measured) + `--sim-quiet` virtual seconds; OUT/sim_peers.json and
OUT/sim_peers.png (`sim.bottle.scale`, whose docstring defines each field). `--sim-wall-budget` stops a
size that takes longer (its cost per virtual second is still recorded); `--sim-profile M` writes
OUT/profile_M.txt (cProfile of the measured window, top functions by cumulative and own time); each row's
detail gives the garbage collector's CPU seconds in the window apart.

Writes OUT/swarm.json and OUT/swarm.png (real processes), OUT/inprocess.json and OUT/inprocess.png.
The done-means ratios of issue #29 are printed and stored under "figures" (each: value, target, met).
Measured on a shared 2-core machine the timings are noisy; rerun on a quiet one for the final figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.demo import spread  # noqa: E402
from p2p_diloco.demo import workers as demo_workers  # noqa: E402
from p2p_diloco.demo.accounting import summarize  # noqa: E402
from p2p_diloco.demo.chaos import calm_schedule  # noqa: E402
from p2p_diloco.demo.workers import DECOUPLED, Workers, stop_slots  # noqa: E402
from p2p_diloco.errors import ConfigError  # noqa: E402
from p2p_diloco.node.state import read_events  # noqa: E402
from p2p_diloco.sim.dissemination import fragment_frame_bytes  # noqa: E402

DEMO_MANIFEST = ROOT / "peers" / "demo.toml"
BENCH_DEFAULTS = {"diloco.batch_size": 8}  # lighter steps: 17 processes share the CPU


# ---- the manifest ---------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to TOML")


def dump_toml(data: dict[str, Any]) -> str:
    """TOML for a manifest: top-level scalars, then one table per section (nested tables dotted)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]

    def table(name: str, body: dict[str, Any]) -> None:
        lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in body.items() if not isinstance(v, dict))
        for k, v in body.items():
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    for k, v in data.items():
        if isinstance(v, dict):
            table(k, v)
    return "\n".join(lines) + "\n"


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def bench_manifest(base: Path, shards: int, overrides: dict[str, Any], run_id: str) -> str:
    data = tomllib.loads(base.read_text())
    data["run_id"] = run_id
    settings = dict(BENCH_DEFAULTS) | overrides
    if shards != 1:
        settings["diloco.synchronizer_shards"] = shards
    for dotted, value in settings.items():
        *sections, key = dotted.split(".")
        table = data
        for section in sections:
            table = table.setdefault(section, {})
        table[key] = value
    return dump_toml(data)


# ---- one configuration of real processes ------------------------------------------------------------


class PacedWorkers(Workers):
    """The demo's processes, every learner paced to `step_time` seconds a step."""

    def __init__(self, manifest_path: Path, learners: int, workdir: Path, step_time: float):
        super().__init__(DECOUPLED, manifest_path, learners, calm_schedule(0.0, 0), workdir)
        self.step_time = step_time

    def worker_cmd(self, slot) -> list[str]:
        return [*super().worker_cmd(slot), "--min-step-time", str(self.step_time)]


def run_config(learners: int, shards: int, args: argparse.Namespace) -> dict[str, Any]:
    workdir = args.out / f"n{learners}-s{shards}"
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    manifest_path = workdir / "manifest.toml"
    manifest_path.write_text(
        bench_manifest(args.manifest, shards, args.overrides, f"bench-n{learners}-s{shards}")
    )
    row: dict[str, Any] = {"learners": learners, "shards": shards, "workdir": str(workdir)}
    try:
        workers = PacedWorkers(manifest_path, learners, workdir, args.min_step_time)
    except ConfigError as exc:
        return row | {"skipped": f"manifest rejected: {exc}"}
    # many processes start at once on a small shared machine: give them longer than the demo's 120 s
    demo_workers.START_TIMEOUT = max(demo_workers.START_TIMEOUT, 60.0 + 15.0 * learners)
    print(
        f"n={learners} s={shards}: starting a bootstrap node and {learners} learners ({workdir})", flush=True
    )
    started = time.time()
    try:
        workers.start_bootstrap()
        workers.start_slots()
        workers.wait_until_up()
        up = time.time()
        start, end = up + args.warmup, up + args.warmup + args.duration
        cpu_at_start = None
        while (now := time.time()) < end:
            workers.poll_events(now)
            if cpu_at_start is None and now >= start:
                cpu_at_start = process_cpu(workers.slots)
            time.sleep(0.5)
        row["cpu_per_peer"] = cpu_per_peer(cpu_at_start, process_cpu(workers.slots), end - start, learners)
        stop_slots(workers.slots)
        for slot in workers.slots:
            slot.tail.poll()
    finally:
        workers.kill_all()
    events = {slot.name: slot.tail.events for slot in workers.slots}
    row |= {"startup_seconds": up - started, "window": [start, end], "window_seconds": end - start}
    row |= analyze(events, start, end, fragment_frame_bytes(workers.manifest))
    prop = row["propagation"]
    print(
        f"n={learners} s={shards}: {row['merged_updates']} merged updates, busiest "
        f"{_kb(row['busiest_bytes_per_update'])} per update, update {_kb(row['update_bytes'])}, "
        f"fan-out {_num(row['publisher_fanout_max'])}, propagation p50 {_num(prop['p50'])} s "
        f"p99 {_num(prop['p99'])} s, goodput {row['goodput']:.2f}, claims {row['claims']} "
        f"({row['terms_held_twice']} terms held twice), relay hops "
        f"{row['relay'].get('max_hop', '-')}, CPU s/s per peer {row['cpu_per_peer']}",
        flush=True,
    )
    return row


def analyze(events: dict[str, list], start: float, end: float, update_bytes: int) -> dict[str, Any]:
    """The measures of one configuration from its peers' events in the window (`demo.spread`)."""
    books = summarize(events, start=start, end=end, paced_as_compute=True)
    return {
        "goodput": books["goodput"],
        "propagation": spread.propagation(events, start, end),
        "relay": spread.relay_counts(events, start, end),
        **spread.traffic(events, start, end, update_bytes),
    }


def reanalyze(row: dict[str, Any]) -> dict[str, Any]:
    """`row` measured again from its work directory's event logs (--tabulate), when both are still there."""
    workdir = Path(row.get("workdir", ""))
    if "window" not in row or not workdir.is_dir():
        return row
    events = {d.name.removeprefix("state-"): read_events(d) for d in sorted(workdir.glob("state-*"))}
    return row | analyze(events, *row["window"], row["update_bytes"])


def _kb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e3:.1f} kB"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# ---- the figures of issue #29 ----------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _figure(value: float | None, target: float, what: str) -> dict[str, Any]:
    return {"value": value, "target": target, "met": value is not None and value <= target, "what": what}


def process_cpu(slots) -> dict[str, float]:  # noqa: ANN001 - demo.workers slots
    """CPU seconds so far of the learners' processes, by kind: the peer (`p2p-diloco join`), its DHT
    child (python) and the p2pd daemons either starts."""
    import psutil  # hivemind's dependency; only this measurement needs it

    totals = {"peer": 0.0, "dht": 0.0, "p2pd": 0.0}
    for slot in slots:
        if slot.proc is None:
            continue
        try:
            root = psutil.Process(slot.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in tree:
            try:
                kind = "p2pd" if "p2pd" in proc.name() else ("peer" if proc.pid == root.pid else "dht")
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            totals[kind] += times.user + times.system
    return totals


def cpu_per_peer(
    before: dict[str, float] | None, after: dict[str, float], seconds: float, learners: int
) -> dict[str, float] | None:
    """CPU seconds per wall second per learner, by process kind, over the measured window."""
    if before is None or seconds <= 0:
        return None
    return {kind: (after[kind] - before[kind]) / seconds / learners for kind in after}


def real_figures(rows: list[dict[str, Any]], fanout: int | None) -> dict[str, Any]:
    """Busiest 16 vs 4 (<= 1.5x), publisher fan-out (<= fanout + 1), p99 at 16 over p50 at 4 (<= 3x),
    for every S measured at both sizes."""
    by = {(r["learners"], r["shards"]): r for r in rows if "skipped" not in r}
    sizes = sorted({n for n, _ in by})
    if len(sizes) < 2:
        return {}
    small, big = sizes[0], sizes[-1]
    out: dict[str, Any] = {}
    for s in sorted({s for _, s in by}):
        lo, hi = by.get((small, s)), by.get((big, s))
        if lo is None or hi is None:
            continue
        out[f"S={s}"] = {
            f"busiest_{big}_over_{small}": _figure(
                _ratio(hi["busiest_bytes_per_update"], lo["busiest_bytes_per_update"]),
                1.5,
                f"busiest peer's bytes per merged update, {big} peers / {small} peers",
            ),
            f"publisher_fanout_{big}": _figure(
                hi["publisher_fanout_max"],
                (fanout if fanout is not None else 3) + 1,
                "publisher's bytes sent per update / update size (fanout + 1"
                + (")" if fanout is not None else "; fanout taken as 3, the default planned)"),
            ),
            f"publisher_pushes_per_update_{big}": _figure(
                max((hi.get("relay") or {}).get("publisher_pushes_per_update", {}).values(), default=None),
                fanout if fanout is not None else 3,
                "update frames the publisher pushed per update (its relay counters; none before relaying)",
            ),
            f"p99_{big}_over_p50_{small}": _figure(
                _ratio(hi["propagation"]["p99"], lo["propagation"]["p50"]),
                3.0,
                f"p99 propagation at {big} peers / p50 at {small} peers",
            ),
        }
    return out


def print_figures(figures: dict[str, Any]) -> None:
    for group, items in figures.items():
        for name, f in items.items():
            value = "-" if f["value"] is None else f"{f['value']:.2f}"
            print(f"{group} {name}: {value} (target <= {f['target']}: {'met' if f['met'] else 'MISSED'})")


def plot_real(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if "skipped" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for s in sorted({r["shards"] for r in rows}):
        mine = sorted((r for r in rows if r["shards"] == s), key=lambda r: r["learners"])
        n = [r["learners"] for r in mine]
        axes[0].plot(
            n, [(r["busiest_bytes_per_update"] or 0) / 1e3 for r in mine], "o-", label=f"busiest, S={s}"
        )
        median = [
            sorted(p["sent_per_update"] + p["received_per_update"] for p in r["per_peer"].values())[
                len(r["per_peer"]) // 2
            ]
            / 1e3
            for r in mine
        ]
        axes[0].plot(n, median, "x--", label=f"median peer, S={s}")
        axes[1].plot(n, [r["publisher_fanout_max"] or 0 for r in mine], "o-", label=f"S={s}")
        axes[2].plot(n, [r["propagation"]["p50"] or 0 for r in mine], "o-", label=f"p50, S={s}")
        axes[2].plot(n, [r["propagation"]["p99"] or 0 for r in mine], "x--", label=f"p99, S={s}")
    axes[0].set_ylabel("kB sent + received per merged update")
    axes[1].set_ylabel("publisher fan-out (copies of each update it sent)")
    axes[2].set_ylabel("seconds, publish -> applied on the last peer")
    for ax in axes:
        ax.set_xlabel("learners")
        ax.legend(fontsize=7)
    cfg = report["config"]
    fig.suptitle(
        f"real `join` processes on 127.0.0.1, {cfg['min_step_time']} s per step, {cfg['duration']:.0f} s measured"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def real_main(args: argparse.Namespace) -> int:
    path = args.out / "swarm.json"
    if args.tabulate:  # the measures again, by today's definitions, from the stored event logs
        report = json.loads(path.read_text())
        report["rows"] = [reanalyze(row) for row in report["rows"]]
    else:
        rows = [run_config(n, s, args) for s in args.shards for n in args.learners]
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        report = {"config": config, "rows": rows}
    fanout = report["config"]["overrides"].get("diloco.fanout")
    report["figures"] = real_figures(report["rows"], fanout if isinstance(fanout, int) else None)
    path.write_text(json.dumps(report, indent=1, default=str))
    print_figures(report["figures"])
    plot_real(report, args.out / "swarm.png")
    print(f"wrote {path} and {args.out / 'swarm.png'}")
    return 0


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--learners", type=int_list, default=[4, 8, 16])
    parser.add_argument("--shards", type=int_list, default=[1])
    parser.add_argument("--min-step-time", type=float, default=0.5)
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds after all are up, not measured")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per configuration")
    parser.add_argument("--manifest", type=Path, default=DEMO_MANIFEST)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--inprocess", type=int_list, default=None, metavar="PEERS,...")
    parser.add_argument("--fanout", type=int, default=3, help="--inprocess: the relay tree's fan-out")
    parser.add_argument("--rounds", type=int, default=4, help="--inprocess: rounds of every fragment")
    parser.add_argument(
        "--peers-per-shard",
        type=int,
        default=None,
        metavar="N",
        help="--inprocess: add the rule S = M / N (shards and fragments grown with the swarm)",
    )
    parser.add_argument("--up-mbit", type=float, default=20.0, help="--inprocess: each peer's uplink")
    parser.add_argument("--down-mbit", type=float, default=100.0, help="--inprocess: each peer's downlink")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="--inprocess: one-way, per peer")
    parser.add_argument(
        "--real-upto",
        type=int,
        default=16,
        help="--inprocess: also run the in-process swarm of real Peer objects at the sizes up to this",
    )
    parser.add_argument("--real-seconds", type=float, default=20.0, help="fake seconds of that run")
    parser.add_argument("--tabulate", action="store_true", help="figures and plots again from OUT, no runs")
    parser.add_argument("--sim-peers", type=int_list, default=None, metavar="PEERS,...")
    parser.add_argument(
        "--sim-warmup", type=float, default=40.0, help="--sim-peers: virtual s before the window, >= 10"
    )
    parser.add_argument("--sim-window", type=float, default=20.0, help="--sim-peers: measured virtual s")
    parser.add_argument("--sim-quiet", type=float, default=30.0, help="--sim-peers: virtual s to settle")
    parser.add_argument("--sim-seed", type=int, default=0)
    parser.add_argument("--sim-wall-budget", type=float, default=None, help="--sim-peers: wall s per size")
    parser.add_argument(
        "--sim-check-every",
        type=float,
        default=0.0,
        help="--sim-peers: virtual s between invariant checks (0: after every event)",
    )
    parser.add_argument("--sim-profile", type=int, default=None, metavar="M", help="cProfile the size M")
    parser.add_argument(
        "--sim-fragments",
        type=int,
        default=None,
        metavar="P",
        help="--sim-peers: fragments at every size, at least S (default 16; 0: max(4, S), the old layout)",
    )
    parser.add_argument(
        "--sim-young-per-peer",
        type=int,
        default=None,
        metavar="N",
        help="--sim-peers: the collector's youngest generation, objects per simulated peer (default 700, "
        "one process's own; 0: Python's one setting for the whole process)",
    )
    parser.add_argument(
        "--sim-min-quorum",
        type=int,
        default=None,
        metavar="K",
        help="--sim-peers: the deltas a round waits for at every size (default: the manifest's, 1; "
        "0: K = S, sized with the swarm as the shards are)",
    )
    parser.add_argument(
        "--sim-min-window-cpu",
        type=float,
        default=30.0,
        metavar="S",
        help="--sim-peers: play a size again (a fresh process each time, at most 8 plays) until its measured "
        "windows add up to S CPU seconds; the row pools them (0: one play)",
    )
    args = parser.parse_args()
    if args.sim_min_window_cpu < 0:
        parser.error(f"--sim-min-window-cpu {args.sim_min_window_cpu}: give 0 or more CPU seconds")
    if args.sim_min_quorum is not None and args.sim_min_quorum < 0:
        parser.error(f"--sim-min-quorum {args.sim_min_quorum}: give K >= 1, or 0 for K = S")
    if args.sim_young_per_peer is not None and args.sim_young_per_peer < 0:
        parser.error(f"--sim-young-per-peer {args.sim_young_per_peer}: give 0 or more objects per peer")
    if args.sim_fragments is not None and args.sim_fragments < 0:
        parser.error(
            f"--sim-fragments {args.sim_fragments}: give the fragments per model, or 0 for max(4, S)"
        )
    if args.peers_per_shard is not None and args.peers_per_shard < 1:
        parser.error(f"--peers-per-shard {args.peers_per_shard}: give the learners per shard, 1 or more")
    args.overrides = {}
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            parser.error(f"--set {item!r}: expected SECTION.KEY=VALUE")
        args.overrides[key.strip()] = parse_value(value.strip())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sim_peers is not None:
        from p2p_diloco.sim.bottle.scale import sim_peers_main

        sim_peers_main(
            args.sim_peers,
            args.out,
            warmup=args.sim_warmup,
            window=args.sim_window,
            quiet=args.sim_quiet,
            seed=args.sim_seed,
            wall_budget=args.sim_wall_budget,
            check_every=args.sim_check_every,
            profile_at=args.sim_profile,
            fragments=args.sim_fragments,
            young_per_peer=args.sim_young_per_peer,
            min_window_cpu=args.sim_min_window_cpu,
            min_quorum=args.sim_min_quorum,
            say=lambda line: print(line, flush=True),
        )
        return 0
    if args.inprocess is not None:
        from bench_swarm_inprocess import inprocess_main  # scripts/: the in-process half

        return inprocess_main(args)
    return real_main(args)


if __name__ == "__main__":
    sys.exit(main())
