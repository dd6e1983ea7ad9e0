"""Model-size scale on real peers: memory over time, merge/apply speed, a newcomer's snapshot download.

    .venv/bin/python scripts/bench_scale.py --params 125M --out docs/results/scale [--duration 420]
    .venv/bin/python scripts/bench_scale.py --throughput-only [--baseline OLD.json] --out docs/results/scale-kernels

Part 1 (in this process, before any peer starts, one torch thread, glibc malloc set up as `join` sets
it): on one fragment of the run's model, milliseconds per million parameters and GB/s of fp32 parameters
(best of `--repeats`, by wall-clock time and by this process's CPU time, which on a shared machine is the
cleaner per-core figure) for merging M deltas (RDA), the outer step (`GlobalReplica.compute_update`,
finiteness checks and checksum included), the checksum alone, encoding the int8 update, applying an
update on a replica (decode, outer step, checksum compare) and applying it with the int8 gradient decoded
inside the step (`decode_tensors(lazy=True)`), plus this core's copy and page-fault bandwidth. Whether the
C kernels of `protocol.fused` ran is in the JSON (`fused_kernels`; P2P_DILOCO_FUSED=0 measures the torch
path).

Part 2 (real processes on 127.0.0.1): a bootstrap node and two `join` learners (batch 1, the byte GPT
sized to `--params`) train; once `--join-after` updates have been published a newcomer joins and downloads
the replica as chunked snapshots from both. Every 2 s the PSS of every peer's process tree (the join
process, its DHT child and p2pd) is sampled from /proc/PID/smaps_rollup. Reported per peer: PSS over time,
growth over the last half of the run, PSS minus the training state (model, gradients, AdamW: 16 B/param)
per parameter; the newcomer's time from its start to its first merged delta and its download MB/s per
source; bytes per parameter per round sent and received. Writes OUT/scale.json and OUT/scale_pss.png.

`--throughput-only` runs part 1 alone and writes OUT/throughput.json and OUT/throughput.png (GB/s per row
against the 1 GB/s goal of issue #14; with `--baseline` a JSON of an earlier part-1 run, such as
scale.json, drawn beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.config import ModelConfig, RunManifest  # noqa: E402
from p2p_diloco.model.gpt import GPT, gpt_config_for, parse_parameter_count  # noqa: E402
from p2p_diloco.node.heap import bound_heap  # noqa: E402
from p2p_diloco.protocol import fused  # noqa: E402
from p2p_diloco.protocol.fragments import plan_fragments  # noqa: E402
from p2p_diloco.protocol.kernels import fresh  # noqa: E402
from p2p_diloco.protocol.merge import merge_deltas  # noqa: E402
from p2p_diloco.protocol.replica import GlobalReplica, fragment_checksum  # noqa: E402
from p2p_diloco.protocol.robust import RobustGuard  # noqa: E402
from p2p_diloco.swarm.updates import UpdateChecks  # noqa: E402
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors  # noqa: E402

FRAGMENTS = 4
TRAINING_BYTES_PER_PARAM = 16  # fp32 weights, gradients, AdamW exp_avg and exp_avg_sq


def shapes_of(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in GPT(config).named_parameters()}


# ---- part 1: throughput on one fragment ------------------------------------------------------------


def throughput(config: ModelConfig, deltas: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    heap_bounded = bound_heap()  # as `join` runs: blocks of 1 MiB or more are mapped afresh (node/heap.py)
    shapes = shapes_of(config)
    plan = plan_fragments(list(shapes.items()), FRAGMENTS)
    names = plan.names(0)
    gen = torch.Generator().manual_seed(0)
    frag = {n: torch.randn(shapes[n], generator=gen) * 0.02 for n in names}
    numel = sum(t.numel() for t in frag.values())
    one = plan_fragments([(n, shapes[n]) for n in names], 1)
    replica = GlobalReplica(one, frag)
    parts = [{n: torch.randn(shapes[n], generator=gen) * 1e-3 for n in names} for _ in range(deltas)]

    cpu_times: list[float] = []

    def best(fn):  # noqa: ANN001, ANN202
        seconds, cpu, out = float("inf"), float("inf"), None
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            out = fn()
            seconds = min(seconds, time.perf_counter() - start)
            cpu = min(cpu, time.process_time() - start_cpu)
        cpu_times.append(cpu)
        return seconds, out

    rows = {}

    def row(name: str, seconds: float) -> None:
        cpu = cpu_times[-1]  # this process's CPU time: what one core spent, whatever else ran beside it
        rows[name] = {
            "ms_per_mparam": round(seconds * 1e3 / (numel / 1e6), 3),
            "gb_per_s_fp32": round(numel * 4 / seconds / 1e9, 3),
            "seconds": round(seconds, 4),
            "cpu_seconds": round(cpu, 4),
            "gb_per_s_fp32_cpu": round(numel * 4 / cpu / 1e9, 3),
        }

    s, merged = best(lambda: merge_deltas(parts, [1.0 + i for i in range(deltas)]))
    row(f"merge_{deltas}_deltas", s)
    s, _ = best(lambda: replica.compute_update(0, merged, lr=0.7, momentum=0.9))
    row("outer_step_with_checks_and_checksum", s)
    version, params, momentum = replica.fragment_state(0)
    s, _ = best(lambda: fragment_checksum(names, params, momentum, version))
    row("checksum", s)
    s, payload = best(lambda: encode_tensors(merged))
    row("encode_int8", s)
    grad = decode_tensors(payload)
    expected = replica.compute_update(0, grad, lr=0.7, momentum=0.9).checksum

    def apply() -> None:
        twin = replica.frozen()
        decoded = decode_tensors(payload, expected_shapes=twin.shapes(0))
        decision = twin.apply(0, 0, decoded, lr=0.7, momentum=0.9, expected_checksum=expected)
        assert decision.action == "apply", decision

    s, _ = best(apply)
    row("apply_update_on_a_replica", s)

    def apply_lazy() -> None:  # the int8 gradient decoded inside the outer step (decode_tensors(lazy=True))
        twin = replica.frozen()
        decoded = decode_tensors(payload, expected_shapes=twin.shapes(0), lazy=True)
        decision = twin.apply(0, 0, decoded, lr=0.7, momentum=0.9, expected_checksum=expected)
        assert decision.action == "apply", decision

    s, _ = best(apply_lazy)
    row("apply_update_decoding_in_the_step", s)

    # what a peer's UpdateBook.apply does with an update's content: the value checks, the outer step and
    # checksum, and the robust direction reference (the signature and history checks are not here)
    manifest = RunManifest(run_id="scale", model=config)
    guard = RobustGuard.from_manifest(manifest)
    checks = UpdateChecks(manifest, 1, guard)

    def apply_as_a_peer(lazy: bool) -> None:
        twin = replica.frozen()
        decoded = decode_tensors(payload, expected_shapes=twin.shapes(0), lazy=lazy)
        values = checks.value_check(0, decoded)  # as `UpdateBook.apply`: the norm is computed once
        assert values.problem is None
        decision = twin.apply(0, 0, decoded, lr=0.7, momentum=0.9, expected_checksum=expected)
        assert decision.action == "apply", decision
        guard.observe_update(0, decoded, norm=values.norm)

    s, _ = best(lambda: apply_as_a_peer(lazy=False))
    row("peer_applies_an_update_decoded_first", s)
    s, _ = best(lambda: apply_as_a_peer(lazy=True))
    row("peer_applies_an_update_int8_kept", s)
    return {
        "fragment_params": numel,
        "threads": 1,
        "heap_bounded": heap_bounded,
        "fused_kernels": fused.available(),
        "fused_kernels_missing_because": fused.WHY_NOT or None,
        "memory": memory_bandwidth(),
        "rows": rows,
    }


def memory_bandwidth() -> dict:
    """This core's memory bandwidth, for reading the rows against it: a 128 MiB copy between touched
    buffers (GB/s copied; read + write), and the first touch of a fresh huge-page 128 MiB tensor (GB/s
    zeroed by the kernel's page faults), both by CPU time, best of 3."""
    n = 32 << 20
    src, dst = torch.randn(n), torch.empty(n)
    dst.fill_(0.0)

    def best(fn) -> float:  # noqa: ANN001
        seconds = float("inf")
        for _ in range(3):
            start = time.process_time()
            fn()
            seconds = min(seconds, time.process_time() - start)
        return round(n * 4 / seconds / 1e9, 2)

    def touch() -> None:
        fresh((n,)).view(-1)[::1024].fill_(0.0)  # one write per 4 KiB: the faults alone

    return {"copy_gb_per_s": best(lambda: dst.copy_(src)), "first_touch_gb_per_s": best(touch)}


# ---- part 2: real peers ----------------------------------------------------------------------------


def tree_pss_parts_kib(root: int) -> dict[str, int]:
    """PSS of `root` and each of its descendants, KiB, by process ("peer" for `root`, else its command
    name: hivemind's DHT child, p2pd); empty if gone."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    parts: dict[str, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            name = "peer" if pid == root else Path(f"/proc/{pid}/comm").read_text().strip()
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    parts[name] = parts.get(name, 0) + int(line.split()[1])
        except OSError:
            continue
    return parts


def tree_pss_kib(root: int) -> int:
    """PSS of `root` and all its descendants, KiB (0 if gone)."""
    return sum(tree_pss_parts_kib(root).values())


def manifest_text(config: ModelConfig) -> str:
    return f"""run_id = "scale"
[diloco]
inner_steps = 16
fragments = {FRAGMENTS}
max_in_flight = 2
min_quorum = 1
batch_size = 1
[model]
n_layer = {config.n_layer}
n_head = {config.n_head}
n_embd = {config.n_embd}
block_size = {config.block_size}
[timing]
heartbeat_period = 2.0
heartbeat_ttl = 60.0
lease_ttl = 90.0
claim_grace = 10.0
lease_margin = 1.0
term_rounds = 100000
rejoin_grace = 60.0
"""


def read_events(state: Path) -> list[dict]:
    out = []
    try:
        for line in (state / "events.jsonl").read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    except OSError:
        pass
    return out


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", *args]


def take_census(proc: subprocess.Popen, state: Path, deadline: float = 60.0) -> dict | None:
    """SIGUSR2 to a `join` process, then its `memory-census.json` (node/census.py), or None."""
    target = state / "memory-census.json"
    target.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR2)
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        if target.exists():
            return json.loads(target.read_text())
        time.sleep(0.5)
    return None


def run_peers(
    config: ModelConfig,
    params: int,
    out: Path,
    duration: float,
    join_after: int,
    step_time: float,
    census_at: list[float] = (),
) -> dict:
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    manifest = work / "scale.toml"
    manifest.write_text(manifest_text(config))
    logs, procs = {}, {}

    def spawn(name: str, args: list[str]) -> subprocess.Popen:
        logs[name] = open(work / f"{name}.log", "w")  # noqa: SIM115
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs[name] = subprocess.Popen(args, stdout=logs[name], stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return procs[name]

    for name in ("boot", "A", "B", "C"):
        subprocess.run(
            cli("keygen", "--out", str(work / f"{name}.key"), "--force"), check=True, capture_output=True
        )
    spawn("boot", cli("bootstrap", "--identity", str(work / "boot.key"), "--listen", "/ip4/127.0.0.1/tcp/0"))
    address = None
    deadline = time.monotonic() + 60
    while address is None and time.monotonic() < deadline:
        for line in (work / "boot.log").read_text().splitlines():
            if line.startswith("bootstrap address: ") and "/tcp/" in line:
                address = line.split(": ", 1)[1].strip()
        time.sleep(0.5)
    if address is None:
        raise SystemExit("the bootstrap node printed no address")

    def join(name: str) -> None:
        spawn(name, cli(
            "join", str(manifest), "--initial-peers", address, "--identity", str(work / f"{name}.key"),
            "--state-dir", str(work / f"state-{name}"), "--listen", "/ip4/127.0.0.1/tcp/0",
            "--threads", "1", "--progress-every", "5", "--display", "plain", "--min-step-time", str(step_time),
            "--persist-every", "120",
        ))  # fmt: skip

    # the runtime alone (python, torch, hivemind's DHT child and p2pd) of a peer with a 1-layer toy model
    tiny = work / "tiny.toml"
    toy = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)
    tiny.write_text(manifest_text(toy).replace('"scale"', '"scale-tiny"'))
    subprocess.run(cli("keygen", "--out", str(work / "T.key"), "--force"), check=True, capture_output=True)
    spawn("T", cli(
        "join", str(tiny), "--initial-peers", address, "--identity", str(work / "T.key"),
        "--state-dir", str(work / "state-T"), "--listen", "/ip4/127.0.0.1/tcp/0", "--threads", "1",
        "--display", "plain", "--min-step-time", "0.5",
    ))  # fmt: skip
    runtime = []
    for _ in range(12):
        time.sleep(2.0)
        runtime.append(tree_pss_kib(procs["T"].pid) / 1024)
    procs["T"].send_signal(signal.SIGINT)
    procs["T"].wait(timeout=60)
    del procs["T"]

    started = time.time()
    samples: list[dict] = []
    join("A")
    join("B")
    newcomer_started = None
    censuses: list[dict] = []
    census_due = sorted(census_at)
    try:
        while time.time() - started < duration:
            row = {"t": round(time.time() - started, 1), "parts": {}}
            for name, proc in procs.items():
                if proc.poll() is None:
                    parts = tree_pss_parts_kib(proc.pid)
                    row[name] = sum(parts.values()) / 1024
                    row["parts"][name] = {k: round(v / 1024, 1) for k, v in parts.items()}
                elif name != "boot":
                    raise SystemExit(
                        f"peer {name} exited with {proc.returncode}; see {work / (name + '.log')}"
                    )
            samples.append(row)
            published = [
                e
                for e in read_events(work / "state-A") + read_events(work / "state-B")
                if e["event"] == "published"
            ]
            if newcomer_started is None and len(published) >= join_after:
                newcomer_started = time.time()
                join("C")
            if census_due and time.time() - started >= census_due[0]:
                census_due.pop(0)
                for name in ("A", "B", "C"):
                    if name in procs and procs[name].poll() is None:
                        taken = take_census(procs[name], work / f"state-{name}")
                        if taken is not None:
                            censuses.append({"t": round(time.time() - started, 1), "peer": name, **taken})
            time.sleep(2.0)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
            logs[name].close()
    result = summarize(work, params, samples, started, newcomer_started, max(runtime[-5:]))
    result["censuses"] = censuses
    return result


def summarize(
    work: Path,
    params: int,
    samples: list[dict],
    started: float,
    newcomer_started: float | None,
    runtime: float,
) -> dict:
    events = {name: read_events(work / f"state-{name}") for name in ("A", "B", "C")}
    ids = {
        name: next((e["peer_id"] for e in ev if e["event"] == "start"), None) for name, ev in events.items()
    }
    published = sorted(
        (e for ev in events.values() for e in ev if e["event"] == "published"), key=lambda e: e["t"]
    )
    peers = {}
    for name in ("A", "B", "C"):
        series = [(s["t"], s[name]) for s in samples if name in s]
        if len(series) < 4:
            continue
        half = series[len(series) // 2 :]
        lo, hi = half[0][1], max(v for _, v in half)
        first_half_end = half[0][1]
        progress = [e for e in events[name] if e["event"] == "progress"]
        last = progress[-1] if progress else {}
        applied = sum(1 for e in events[name] if e["event"] in ("applied", "published"))
        peers[name] = {
            "peer_id": ids[name],
            "pss_mib_last": round(series[-1][1], 1),
            "pss_mib_max": round(max(v for _, v in series), 1),
            "growth_last_half_pct": round(100 * (series[-1][1] - first_half_end) / first_half_end, 2),
            "growth_last_half_max_pct": round(100 * (hi - lo) / lo, 2),
            "bytes_per_param": round(series[-1][1] * 2**20 / params, 2),
            "beyond_training_bytes_per_param": round(
                (series[-1][1] - runtime) * 2**20 / params - TRAINING_BYTES_PER_PARAM, 2
            ),
            "updates_seen": applied,
            "bytes_sent": last.get("bytes_sent"),
            "bytes_received": last.get("bytes_received"),
            "steps": last.get("step"),
        }
        rounds_params = applied * params / FRAGMENTS
        if rounds_params and last:
            peers[name]["sent_bytes_per_param_per_round"] = round(
                last.get("bytes_sent", 0) / rounds_params, 3
            )
            peers[name]["received_bytes_per_param_per_round"] = round(
                last.get("bytes_received", 0) / rounds_params, 3
            )
    newcomer: dict = {"started_s": round(newcomer_started - started, 1) if newcomer_started else None}
    catch_up = next((e for e in events["C"] if e["event"] == "catch_up"), None)
    if catch_up:
        seconds = catch_up["seconds"]
        newcomer["catch_up"] = {
            k: catch_up.get(k) for k in ("mode", "seconds", "snapshots", "before", "after")
        }
        newcomer["download_mb_per_s_per_source"] = {
            source: round(b / seconds / 1e6, 1) for source, b in (catch_up.get("from_sources") or {}).items()
        }
        newcomer["sources"] = len(catch_up.get("from_sources") or {})
    merged = next((e for e in published if ids["C"] in (e.get("contributors") or [])), None)
    if merged and newcomer_started:
        newcomer["first_merged_delta_s"] = round(merged["t"] - newcomer_started, 1)
    return {
        "steady_state": steady_state(samples, runtime, params),
        "runtime_pss_mib": round(runtime, 1),
        "peers": peers,
        "newcomer": newcomer,
        "published": len(published),
        "pss_samples": samples,
    }


def steady_state(samples: list[dict], runtime: float, params: int) -> dict:
    """Per peer over the last half of the run: mean PSS, the growth of a least-squares line through it (%
    of the mean, over that half), the means of its two quarters, and bytes/param beyond the training
    state (mean and peak: PSS minus the runtime alone minus 16 B/param)."""
    end = samples[-1]["t"]
    out = {}
    for name in ("A", "B", "C"):
        pts = [(s["t"], s[name]) for s in samples if name in s and s["t"] >= end / 2]
        if len(pts) < 4:
            continue
        ts, vs = [t for t, _ in pts], [v for _, v in pts]
        mt, mv = sum(ts) / len(ts), sum(vs) / len(vs)
        slope = sum((t - mt) * (v - mv) for t, v in pts) / sum((t - mt) ** 2 for t in ts)
        half = len(vs) // 2
        beyond = lambda mib: round((mib - runtime) * 2**20 / params - TRAINING_BYTES_PER_PARAM, 1)  # noqa: E731
        out[name] = {
            "mean_pss_mib": round(mv),
            "fit_growth_pct": round(100 * slope * (end - ts[0]) / mv, 1),
            "quarter_means_mib": [round(sum(vs[:half]) / half), round(sum(vs[half:]) / (len(vs) - half))],
            "beyond_training_bytes_per_param_mean": beyond(mv),
            "beyond_training_bytes_per_param_peak": beyond(max(vs)),
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    samples = result["peers_run"]["pss_samples"]
    for name in ("boot", "A", "B", "C"):
        pts = [(s["t"], s[name] / 1024) for s in samples if name in s]
        if pts:
            ax.plot(*zip(*pts), label={"boot": "bootstrap", "C": "C (newcomer)"}.get(name, f"learner {name}"))
    ax.set_xlabel("seconds")
    ax.set_ylabel("PSS of the process tree (GiB)")
    ax.set_title(f"{result['params'] / 1e6:.0f}M-parameter byte GPT, 2 learners + newcomer, 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


GOAL_GB_PER_S = 1.0  # issue #14: every part-1 row at >= 1 GB/s of fp32 parameters per core


def plot_throughput(result: dict, baseline: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["throughput"]["rows"]
    names = list(rows)

    def rate(row: dict) -> float:  # per core: by CPU time where measured (a shared machine), else wall time
        return row.get("gb_per_s_fp32_cpu", row.get("gb_per_s_fp32", 0.0))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ys = range(len(names))
    if baseline is not None:
        old = baseline["throughput"]["rows"]
        ax.barh(
            [y + 0.2 for y in ys], [rate(old.get(n, {})) for n in names], 0.4, label="before", color="0.7"
        )
        ax.barh([y - 0.2 for y in ys], [rate(rows[n]) for n in names], 0.4, label="after")
    else:
        ax.barh(list(ys), [rate(rows[n]) for n in names], 0.6)
    ax.axvline(GOAL_GB_PER_S, color="red", linestyle="--", label="goal (1 GB/s)")
    ax.set_yticks(list(ys), [n.replace("_", " ") for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("GB/s of fp32 parameters per core (by CPU time, one thread)")
    frag = result["throughput"]["fragment_params"]
    ax.set_title(f"Synchronizer and replica kernels, one {frag / 1e6:.0f}M-parameter fragment")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", default="125M")
    parser.add_argument("--out", default="docs/results/scale")
    parser.add_argument("--duration", type=float, default=480.0, help="seconds of the peers' run")
    parser.add_argument(
        "--join-after", type=int, default=2, help="updates published before the newcomer joins"
    )
    parser.add_argument("--deltas", type=int, default=2, help="M, deltas merged in part 1")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--throughput-only",
        "--skip-peers",
        action="store_true",
        help="part 1 only: writes OUT/throughput.json and OUT/throughput.png",
    )
    parser.add_argument(
        "--baseline", type=Path, default=None, help="with --throughput-only: an earlier run's JSON to chart"
    )
    parser.add_argument(
        "--min-step-time",
        type=float,
        default=None,
        help="pace the learners' inner steps (default 10 s per 125M parameters: two CPU cores must also merge)",
    )
    parser.add_argument(
        "--census-at",
        type=float,
        action="append",
        default=[],
        help="seconds into the peers' run at which to take a memory census of every peer (node/census.py); "
        "repeatable",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        config = gpt_config_for(parse_parameter_count(args.params))
    except ValueError as exc:
        raise SystemExit(f"--params: {exc}") from exc
    params = sum(int(torch.Size(s).numel()) for s in shapes_of(config).values())
    began = time.time()
    result = {
        "command": " ".join(["scripts/bench_scale.py", *sys.argv[1:]]),
        "params": params,
        "model": {
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_embd": config.n_embd,
            "block_size": 32,
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "throughput": throughput(config, args.deltas, args.repeats),
    }
    print(json.dumps(result["throughput"], indent=1), flush=True)
    if args.throughput_only:
        baseline = json.loads(args.baseline.read_text()) if args.baseline else None
        if baseline is not None:
            result["baseline"] = {"command": baseline.get("command"), "throughput": baseline["throughput"]}
        (out / "throughput.json").write_text(json.dumps(result, indent=1))
        plot_throughput(result, baseline, out / "throughput.png")
        return 0
    step_time = args.min_step_time if args.min_step_time is not None else max(0.5, 10.0 * params / 125e6)
    result["min_step_time"] = step_time
    result["peers_run"] = run_peers(
        config, params, out, args.duration, args.join_after, step_time, args.census_at
    )
    result["wall_seconds"] = round(time.time() - began, 1)
    plot(result, out / "scale_pss.png")
    brief = {k: v for k, v in result["peers_run"].items() if k not in ("pss_samples", "censuses")}
    print(json.dumps(brief, indent=1), flush=True)
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
