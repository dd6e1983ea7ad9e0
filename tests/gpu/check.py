"""The measurements and the short real run of `scripts/gpu_check.sh` (docs/gpu.md), one subcommand each:

    python -m tests.gpu.check env      --out DIR --device cuda|cpu    env.json: torch, CUDA, GPU, packages
    python -m tests.gpu.check figures  --out DIR --device cuda|cpu    figures.json: tokens/s, peak memory
    python -m tests.gpu.check realrun  --out DIR --device cuda|cpu    realrun.json: bootstrap + 2 joins
    python -m tests.gpu.check summary  --out DIR                      summary.json and summary.md
    python -m tests.gpu.check wheels   --out DIR                      wheels a CUDA machine lacks (docs/gpu.md)

`figures` times the project's own inner step (`model.trainer.InnerTrainer`: autocast, accumulation,
clipping) on random tokens for each model size and setting, and reads the peak GPU memory
(`torch.cuda.max_memory_allocated`: weights, gradients, optimizer state and activations) and the process's
host memory (PSS, with the model on the device and a `GlobalReplica` of it on the host, as a GPU peer holds
it). `--device cpu` runs the same code on tiny sizes (the dry run CI uses). `realrun` starts a bootstrap
and two `join` processes on 127.0.0.1 (with CUDA: one on the GPU, one on the CPU), trains for a while,
stops training (SIGUSR1), and checks that the replicas of both peers agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def say(line: str) -> None:
    print(f"[gpu_check] {line}", flush=True)


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n")


def pss_bytes() -> int | None:
    """This process's proportional set size (Linux), or None."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---- env ------------------------------------------------------------------------------------------------


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    from p2p_diloco.protocol import fused

    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device_arg": args.device,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "fused_c_kernels": fused.active(),
        "packages": {
            name: package_version(name)
            for name in (
                "numpy",
                "hivemind",
                "bitsandbytes",
                "transformers",
                "tokenizers",
                "safetensors",
                "protobuf",
                "multiaddr",
                "blake3",
                "pydantic",
            )
        },  # fmt: skip
    }
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpu_memory_bytes"] = props.total_memory
        env["capability"] = f"{props.major}.{props.minor}"
        env["bf16_supported"] = torch.cuda.is_bf16_supported()
    try:
        meminfo = Path("/proc/meminfo").read_text().split("\n", 1)[0]
        env["host_memory_kib"] = int(meminfo.split()[1])
    except (OSError, IndexError, ValueError):
        pass
    write_json(Path(args.out) / "env.json", env)
    say(f"env: torch {env['torch']} (CUDA {env['torch_cuda']}), python {env['python']}, "
        f"GPUs {env.get('gpus', 'none')}, packages {env['packages']}")  # fmt: skip
    return 0


# ---- figures --------------------------------------------------------------------------------------------


def llama(hidden: int, layers: int, inter: int, heads: int, kv: int, vocab: int, block: int) -> dict:
    return {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "max_position_embeddings": block, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    config: dict | None  # None: the [model] of peers/llama-tiny.toml
    block: int
    batch: int  # sequences per inner step
    micro_batch: int  # sequences per forward/backward (join --micro-batch)


GPU_SIZES = (
    Size("llama-tiny (peers/llama-tiny.toml)", None, 256, 16, 16),
    Size("llama-350M", llama(1024, 22, 2816, 16, 16, 32000, 1024), 1024, 16, 4),
    Size("llama-1B", llama(2048, 20, 5632, 32, 8, 32000, 1024), 1024, 16, 4),
)
CPU_SIZES = (  # the dry run: the same code on sizes two loaded cores take in seconds
    Size("llama-dry-a", llama(32, 2, 64, 4, 4, 256, 32), 32, 4, 2),
    Size("llama-dry-b", llama(96, 3, 256, 4, 2, 512, 64), 64, 4, 4),
)
SETTINGS = (  # (inner optimizer, precision, activation checkpointing)
    ("adamw", "bf16", False),
    ("adamw8bit", "bf16", False),
    ("adamw", "bf16", True),
    ("adamw8bit", "bf16", True),
)


class RandomTokens:
    """The sampler interface of `InnerTrainer`: fresh random batches (pinned on CUDA), no data loading."""

    def __init__(self, batch: int, block: int, vocab: int, pin: bool):
        import torch

        self.gen = torch.Generator().manual_seed(0)
        self.batch, self.block, self.vocab, self.pin = batch, block, vocab, pin

    def next_batch(self):  # noqa: ANN201
        import torch

        data = torch.randint(0, self.vocab, (self.batch, self.block + 1), generator=self.gen)
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)


def model_config(size: Size):  # noqa: ANN201
    from p2p_diloco.config import ModelConfig, RunManifest

    if size.config is None:
        base = RunManifest.load(REPO_ROOT / "peers" / "llama-tiny.toml").model
        # the pinned weights_digest may differ under another torch build; the figures need no pinning
        return dataclasses.replace(base, weights_digest="")
    return ModelConfig(kind="hf", block_size=size.block, config=size.config)


def measure(size: Size, device: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Every setting of `SETTINGS` for one model size (one model built, a fresh optimizer per setting)."""
    import torch

    from p2p_diloco.config import TrainConfig
    from p2p_diloco.model.gpt import build_model, make_inner_optimizer
    from p2p_diloco.model.trainer import InnerTrainer
    from p2p_diloco.protocol.fragments import plan_fragments
    from p2p_diloco.protocol.replica import GlobalReplica

    cuda = device.startswith("cuda")
    gc.collect()
    pss_before = pss_bytes()
    started = time.perf_counter()
    cfg = model_config(size)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = int(cfg.resolved_config.get("vocab_size", 256)) if cfg.resolved_config else 256
    # what a GPU peer keeps on the host: the replica (Θ and outer momentum, fp32) of the whole model
    plan = plan_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], 4)
    replica = GlobalReplica(plan, {n: p.detach() for n, p in model.named_parameters()})
    model.to(device)
    built = time.perf_counter() - started
    say(f"figures: {size.name}: {n_params / 1e6:.1f}M parameters, built in {built:.1f} s")
    rows = []
    for optimizer_name, precision, checkpointing in SETTINGS:
        row: dict[str, Any] = {
            "model": size.name, "parameters": n_params, "device": device, "optimizer": optimizer_name,
            "precision": precision, "activation_checkpointing": checkpointing, "block_size": size.block,
            "batch": size.batch, "micro_batch": size.micro_batch, "steps_timed": steps,
        }  # fmt: skip
        optimizer = trainer = None
        try:
            optimizer = make_inner_optimizer(model, 1e-4, 0.1)
            # SETTINGS lists the settings without checkpointing first: once on, it stays on for the model
            train = TrainConfig(
                optimizer=optimizer_name,
                precision=precision,
                grad_clip=1.0,
                loss_every=1000,
                activation_checkpointing=checkpointing,
            )
            sampler = RandomTokens(size.batch, size.block, vocab, pin=cuda)
            trainer = InnerTrainer(
                train, model, optimizer, sampler, micro_batch=size.micro_batch, device=device
            )
            row["optimizer_used"] = type(trainer.optimizer).__name__
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(warmup):
                trainer.step()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = None
            for _ in range(steps):
                loss = trainer.step()[0]
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = steps * size.batch * size.block
            row.update(
                tokens_per_s=round(tokens / seconds, 1),
                step_seconds=round(seconds / steps, 4),
                loss_finite=loss is None or loss == loss,
                weights_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            )
            if cuda:
                row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
                row["peak_gpu_gib"] = round(row["peak_gpu_bytes"] / 2**30, 3)
                row["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
                row["peak_gpu_bytes_per_param"] = round(row["peak_gpu_bytes"] / n_params, 2)
            pss = pss_bytes()
            if pss is not None and pss_before is not None:
                row["host_pss_gib"] = round(pss / 2**30, 3)
                row["host_bytes_per_param"] = round((pss - pss_before) / n_params, 2)
            row["ok"] = bool(row["weights_finite"] and row["loss_finite"])
        except Exception as exc:  # noqa: BLE001 - a setting that fails (OOM, a missing kernel) is a figure too
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            del optimizer, trainer
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        shown = {k: row.get(k) for k in ("tokens_per_s", "peak_gpu_gib", "host_bytes_per_param", "error")}
        say(f"figures: {size.name} {optimizer_name} {precision} ckpt={checkpointing}: {shown}")
        rows.append(row)
    del model, replica
    gc.collect()
    return rows


def cmd_figures(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)) if args.device != "cpu" else 2)
    sizes = GPU_SIZES if args.device.startswith("cuda") else CPU_SIZES
    deadline = time.monotonic() + args.budget
    rows: list[dict[str, Any]] = []
    for size in sizes:
        if time.monotonic() > deadline:
            error = f"skipped: over the {args.budget:.0f} s budget"
            rows.append({"model": size.name, "ok": False, "error": error})
            say(f"figures: {size.name} skipped (over the budget)")
        else:
            rows += measure(size, args.device, args.steps, args.warmup)
        write_figures(args, rows)  # after every size: a run stopped by its timeout keeps what it measured
    return 0 if rows and all(r.get("ok") for r in rows) else 1


def write_figures(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import torch

    result = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "what": "InnerTrainer steps on random tokens; peak_gpu = torch.cuda.max_memory_allocated (weights, "
        "gradients, optimizer state, activations); host_bytes_per_param = growth of this process's PSS "
        "per parameter with the model on the device and a GlobalReplica (Θ and outer momentum) on the "
        "host, without the DHT process, p2pd, update log and error-feedback residuals of a real peer",
        "rows": rows,
    }
    write_json(Path(args.out) / "figures.json", result)


# ---- the real run -------------------------------------------------------------------------------------

REAL_MANIFEST = """
run_id = "gpu-check"
[diloco]
inner_steps = 8
fragments = 2
max_in_flight = 2
min_quorum = 1
batch_size = 8
inner_lr = 3e-3
outer_lr = 1.0
outer_momentum = 0.0
[model]
kind = "hf"
block_size = 64
seed = 3
[model.config]
model_type = "llama"
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 64
[data]
source = "shards"
shards = "{shards}"
digest = "{digest}"
[train]
precision = "bf16"
grad_clip = 1.0
warmup_steps = 10
loss_every = 4
[timing]
heartbeat_period = 0.5
heartbeat_ttl = 2.0
lease_ttl = 3.0
claim_grace = 1.0
lease_margin = 0.5
rejoin_grace = 30.0
"""


def ask_status(manifest: Path, addresses: list[str]) -> dict[str, Any]:
    from tests.integration.conftest import python_cmd

    cmd = python_cmd("status", str(manifest), "--initial-peers", *addresses, "--json", "--wait", "10")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=REPO_ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"status exited {done.returncode}: {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def cmd_realrun(args: argparse.Namespace) -> int:
    from p2p_diloco.config import RunManifest
    from p2p_diloco.demo.checks import digest_agreement
    from p2p_diloco.model.prepare import prepare, train_tokenizer
    from p2p_diloco.model.shards import index_digest
    from p2p_diloco.net.identity import write_identity
    from p2p_diloco.node.export import load_global_replica
    from p2p_diloco.node.state import read_events
    from tests.integration.conftest import LOOPBACK_LISTEN, _Spawner, launch_bootstrap, python_cmd
    from tests.support.waiting import wait_until

    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-run-"))
    result: dict[str, Any] = {
        "device": args.device,
        "seconds": args.seconds,
        "workdir": str(work),
        "ok": False,
    }
    started = time.monotonic()
    devices = {"a": args.device, "b": "cpu"}  # with CUDA: a GPU peer and a CPU peer in one swarm
    result["peers"] = {name: {"device": device} for name, device in devices.items()}
    try:
        tokenizer = train_tokenizer([], work / "tokenizer.json", vocab_size=512, builtin=True)
        index = prepare([], work / "shards", tokenizer=str(tokenizer), builtin=True, shard_tokens=60_000)
        manifest_path = work / "run.toml"
        manifest_path.write_text(REAL_MANIFEST.format(shards=work / "shards", digest=index_digest(index)))
        manifest = RunManifest.load(manifest_path)
        say(f"realrun: data prepared in {time.monotonic() - started:.1f} s; starting a bootstrap and 2 peers")
        with _Spawner(work) as spawn:
            bootstrap = launch_bootstrap(spawn, work)
            handles = {}
            for name, device in devices.items():
                identity = work / f"{name}.key"
                write_identity(identity, force=True)
                handles[name] = spawn(
                    python_cmd(
                        "join",
                        str(manifest_path),
                        "--initial-peers",
                        *bootstrap.addresses,
                        "--identity",
                        str(identity),
                        "--state-dir",
                        str(work / f"state-{name}"),
                        "--listen",
                        LOOPBACK_LISTEN,
                        "--persist-every",
                        "2",
                        "--progress-every",
                        "2",
                        "--display",
                        "plain",
                        "--device",
                        device,
                    )  # fmt: skip
                )
            for name, handle in handles.items():
                line = handle.wait_for_lines("joined run", timeout=180)[0]
                result["peers"][name]["joined"] = line
            joined = time.monotonic()
            result["join_seconds"] = round(joined - started, 1)
            say(f"realrun: both peers joined after {result['join_seconds']} s; training {args.seconds:.0f} s")
            while time.monotonic() - joined < args.seconds:
                time.sleep(2)
                for name, handle in handles.items():
                    if handle.popen.poll() is not None:
                        raise RuntimeError(
                            f"peer {name} exited {handle.popen.returncode}:\n{handle.stderr_tail()}"
                        )
            for handle in handles.values():
                handle.signal(signal.SIGUSR1)  # stop training, keep serving: in-flight rounds close

            def settled() -> dict[str, Any] | None:
                status = ask_status(manifest_path, bootstrap.addresses)
                rows = [p for p in status.get("peers", []) if p.get("versions")]
                if len(rows) == 2 and rows[0]["versions"] == rows[1]["versions"]:
                    return status
                return None

            try:
                status = wait_until(settled, 60, "both peers at the same versions", interval=0.5)
            except TimeoutError:
                status = ask_status(manifest_path, bootstrap.addresses)
            rows = [
                {
                    "peer": p["peer_id"],
                    "versions": p.get("versions"),
                    "digest": p.get("digest"),
                    "tips": p.get("tips"),
                }
                for p in status.get("peers", [])
            ]
            result["status"] = {"error": status.get("error"), "peers": rows}
            result["agreement"] = digest_agreement(rows)
            for handle in handles.values():
                handle.signal(signal.SIGTERM)
            for name, handle in handles.items():
                try:
                    result["peers"][name]["exit"] = handle.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    result["peers"][name]["exit"] = "did not stop within 60 s"
                result["peers"][name]["stderr_tail"] = handle.stderr_tail(40).splitlines()
        digests = {}
        for name in devices:
            state = work / f"state-{name}"
            events = read_events(state)
            progress = [e for e in events if e.get("event") == "progress"]
            training = [e for e in progress if e.get("tokens_per_s")]
            peer = result["peers"][name]
            # what a slow run needs to be diagnosed from its JSON alone: the event kinds and the last others
            peer["event_counts"] = dict(Counter(str(e.get("event")) for e in events))
            peer["events_tail"] = [e for e in events if e.get("event") != "progress"][-40:]
            peer["tokens"] = progress[-1].get("tokens") if progress else 0
            peer["tokens_per_s_last"] = training[-1]["tokens_per_s"] if training else None
            peer["deltas_sent"] = progress[-1].get("deltas_sent") if progress else None
            replica, _ = load_global_replica(manifest, state)
            peer["persisted_versions"] = list(replica.versions())
            peer["persisted_digest"] = replica.digest()
            digests[name] = (tuple(replica.versions()), replica.digest())
        same_versions = digests["a"][0] == digests["b"][0]
        result["persisted_replicas"] = {
            "same_versions": same_versions,
            "identical": same_versions and digests["a"][1] == digests["b"][1],
        }
        versions_sum = sum(digests["a"][0])
        result["ok"] = bool(
            result["agreement"]["agree"]
            and (not same_versions or result["persisted_replicas"]["identical"])
            and versions_sum >= 2
            and all(result["peers"][n]["tokens"] for n in devices)
            and all(result["peers"][n].get("exit") == 0 for n in devices)
        )
        say(f"realrun: versions {list(digests['a'][0])} / {list(digests['b'][0])}, replicas agree: "
            f"{result['agreement']['agree']}, persisted identical: {result['persisted_replicas']['identical']}, "
            f"tokens/s a={result['peers']['a']['tokens_per_s_last']} b={result['peers']['b']['tokens_per_s_last']}")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - recorded in realrun.json
        result["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
        say(f"realrun: FAILED: {result['error']}")
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    write_json(out / "realrun.json", result)
    return 0 if result["ok"] else 1


# ---- summary ------------------------------------------------------------------------------------------


def junit_summary(path: Path) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {"error": "no junit report (pytest did not run)"}
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                detail = (child.get("message") or child.text or "")[:500]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail})  # fmt: skip
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return {"counts": counts, "cases": cases}


def cmd_summary(args: argparse.Namespace) -> int:
    out = Path(args.out)

    def load(name: str) -> dict[str, Any] | None:
        path = out / name
        return json.loads(path.read_text()) if path.exists() else None

    env, figures, realrun = load("env.json"), load("figures.json"), load("realrun.json")
    tests = junit_summary(Path(args.junit) if args.junit else out / "tests.xml")
    counts = tests.get("counts", {})
    problems = []
    if "error" in tests:
        problems.append(f"tests: {tests['error']}")
    if counts.get("failed") or counts.get("error"):
        problems.append(f"tests: {counts.get('failed', 0)} failed, {counts.get('error', 0)} errors")
    if env and env.get("cuda_available") and counts.get("skipped"):
        problems.append(f"tests: {counts['skipped']} skipped on a CUDA machine")
    if figures is None:
        problems.append("figures: not measured")
    else:
        problems += [
            f"figures: {r['model']} {r.get('optimizer')}: {r.get('error')}"
            for r in figures["rows"]
            if not r.get("ok")
        ]
    if realrun is None:
        problems.append("realrun: not run")
    elif not realrun.get("ok"):
        problems.append(f"realrun: {realrun.get('error') or 'checks failed'}")
    summary = {
        "ok": not problems,
        "problems": problems,
        "device": env.get("gpus") if env else None,
        "tests": tests,
        "figures": figures["rows"] if figures else None,
        "realrun": realrun,
        "phase_seconds": json.loads(args.phases) if args.phases else None,
    }
    write_json(out / "summary.json", summary)
    lines = [
        "# GPU check summary",
        "",
        f"- machine: {(env.get('gpus') or 'no GPU') if env else '?'}, torch {env.get('torch') if env else '?'} "
        f"(CUDA {env.get('torch_cuda') if env else '?'}), python {env.get('python') if env else '?'}",
        f"- commit: {env.get('commit') if env else '?'}",
        f"- result: **{'all checks passed' if not problems else 'PROBLEMS'}**",
        *[f"  - {p}" for p in problems],
        "",
        f"## tests/gpu: {counts}",
        "",
        *[
            f"- {c['outcome']}: `{c['test']}` ({c['seconds']:.1f} s){' ' + c['detail'][:200] if c['detail'] else ''}"
            for c in tests.get("cases", [])
        ],  # fmt: skip
        "",
        "## Figures (InnerTrainer on random tokens)",
        "",
        "| model | params | optimizer | precision | ckpt | block | batch / micro | tokens/s | peak GPU GiB "
        "| GPU B/param | host B/param |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in figures["rows"] if figures else []:
        lines.append(
            f"| {r['model']} | {r.get('parameters', 0) / 1e6:.2f}M | {r.get('optimizer_used', r.get('optimizer'))} "
            f"| {r.get('precision')} | {r.get('activation_checkpointing')} | {r.get('block_size')} "
            f"| {r.get('batch')} / {r.get('micro_batch')} | {r.get('tokens_per_s', r.get('error', '-'))} "
            f"| {r.get('peak_gpu_gib', '-')} | {r.get('peak_gpu_bytes_per_param', '-')} "
            f"| {r.get('host_bytes_per_param', '-')} |"
        )
    if realrun:
        lines += [
            "",
            "## Real run (bootstrap + 2 joins on 127.0.0.1)",
            "",
            f"- ok: {realrun.get('ok')}; {realrun.get('error', '')}",
            f"- peers: {json.dumps(realrun.get('peers'))}",
            f"- replicas agree (status): {(realrun.get('agreement') or {}).get('agree')}; persisted: "
            f"{realrun.get('persisted_replicas')}",
        ]
    if args.phases:
        lines += ["", f"Phase seconds: {args.phases}"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    say(f"summary: {'all checks passed' if not problems else 'PROBLEMS: ' + '; '.join(problems)}")
    say(f"summary: {out / 'summary.md'}")
    return 0 if not problems else 1


# ---- wheels for a machine without a package index --------------------------------------------------------

# What the GPU machines' image already holds (/work/.library/device/KINDS.md, 2026-11-17): never carried.
DEVICE_HAS = frozenset(
    "pyyaml scipy msgpack sortedcontainers uvloop grpcio protobuf packaging idna six safetensors "
    "prometheus-client rich matplotlib transformers tokenizers huggingface-hub typing-extensions torch numpy "
    "psutil attrs mypy-extensions setuptools pytest pytest-timeout hypothesis pyarrow filelock fsspec "
    "jinja2 networkx sympy triton regex requests tqdm pillow".split()
)
NOT_IMPORTED = frozenset({"grpcio-tools"})  # hivemind declares it, imports it only to compile protos


def runtime_closure() -> dict[str, str]:
    """name -> installed version of everything the project needs at run time (its dependencies' too) that
    the GPU machines lack; read from this interpreter's installed metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    marker_env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": ""}  # fmt: skip
    todo, seen, missing = ["p2p_diloco"], set(), {}
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in DEVICE_HAS or name in NOT_IMPORTED:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        if name != "p2p-diloco":
            missing[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(marker_env):
                todo.append(req.name)
    return dict(sorted(missing.items()))


PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
BNB_KEEP = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so")


def trim_bitsandbytes(wheel: Path) -> Path:
    """The bitsandbytes wheel without the libraries of other CUDA versions, ROCm and XPU (torch there is
    built for CUDA 13.0): about 9 MB instead of 100+, so the wheels fit one device call's 64 MiB."""
    import zipfile

    trimmed = wheel.with_name(wheel.name)
    source = wheel.with_suffix(".full")
    wheel.rename(source)
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            base = item.filename.rsplit("/", 1)[-1]
            if base.startswith("libbitsandbytes_") and base not in BNB_KEEP:
                continue
            data = zin.read(item)
            if base == "RECORD":
                data = b"\n".join(
                    line for line in data.split(b"\n")
                    if not (b"libbitsandbytes_" in line and not any(k.encode() in line for k in BNB_KEEP))
                )  # fmt: skip
            zout.writestr(item, data)
    source.unlink()
    return trimmed


def cmd_wheels(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = runtime_closure()
    say(
        f"wheels: {len(wanted)} packages the GPU image lacks: {', '.join(f'{k}=={v}' for k, v in wanted.items())}"
    )
    failed = []
    for name, version in wanted.items():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(out)]  # fmt: skip
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        done = subprocess.run([*cmd, f"{name}=={version}"], capture_output=True, text=True)
        if done.returncode != 0:  # published as a source archive only: build its (pure) wheel here
            build = [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "-w",
                str(out),
                f"{name}=={version}",
            ]
            done = subprocess.run(build, capture_output=True, text=True)
        if done.returncode != 0:
            failed.append(name)
            say(f"wheels: {name}=={version}: {done.stderr.strip()[-300:]}")
    for wheel in out.glob("bitsandbytes-*.whl"):
        trim_bitsandbytes(wheel)
    total = sum(p.stat().st_size for p in out.glob("*.whl"))
    say(f"wheels: {len(list(out.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.check", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("env", "figures", "realrun", "summary", "wheels"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        if name in ("env", "figures", "realrun"):
            p.add_argument("--device", default="cuda")
    sub.choices["figures"].add_argument("--steps", type=int, default=5, help="timed steps per setting")
    sub.choices["figures"].add_argument("--warmup", type=int, default=2, help="untimed steps per setting")
    sub.choices["figures"].add_argument("--budget", type=float, default=300, help="seconds; later sizes skip")
    sub.choices["realrun"].add_argument("--seconds", type=float, default=90, help="seconds of training")
    sub.choices["summary"].add_argument("--phases", default="", help="JSON of phase durations")
    sub.choices["summary"].add_argument(
        "--junit", default="", help="pytest's junit XML (default OUT/tests.xml)"
    )
    args = parser.parse_args(argv)
    command = {"env": cmd_env, "figures": cmd_figures, "realrun": cmd_realrun, "summary": cmd_summary,
               "wheels": cmd_wheels}[args.command]  # fmt: skip
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
