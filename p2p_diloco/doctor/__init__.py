"""`p2p-diloco doctor [MANIFEST] [--initial-peers ...] [--state-dir DIR] [--device D] [--json]`.

What a volunteer runs before joining and what an organizer asks for in a bug report: one line per check,
``ok`` / ``warn`` / ``fail``, and for anything not ok the fix. Checks: Python and the package versions
(numpy below 2.4, see FINDINGS), torch's devices (CUDA, bitsandbytes), the run manifest (loads, signature,
model size; a custom factory's model built and probed once), host and GPU memory against what that model needs
(per-parameter costs of docs/model_size.md: 16 B/param of training state, up to 19.1 B/param beyond it,
0.51 GiB of runtime), reachability of the initial peers, this clock against the peers' (timed from their
heartbeats: leases expire on their writers' clocks and tolerate `timing.lease_margin` of disagreement;
`doctor.clock`), whether this machine has a public address or should join with ``--behind-nat`` (a heuristic
from its interface addresses), and the state directory (free disk). Without a manifest it checks the machine
alone: versions, devices, host memory, free disk, the clock (the time and whether NTP keeps it) and, given
``--initial-peers``, outbound TCP connections to them. Exit status 1 when a check fails, 0 otherwise (warnings
included).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import ipaddress
import json
import os
import platform
import shutil
import socket
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from p2p_diloco.doctor.checks import Check, Status
from p2p_diloco.doctor.clock import measure_clock, system_clock
from p2p_diloco.errors import ConfigError
from p2p_diloco.node.options import CUDA_TORCH

GIB = 1024**3
RUNTIME_BYTES = int(0.51 * GIB)  # python, torch, the DHT child and p2pd (docs/model_size.md, bench_scale)
TRAIN_BYTES_PER_PARAM = 16.0  # fp32 weights, gradients, AdamW's two moments
TRAIN_BYTES_PER_PARAM_8BIT = 10.0  # bitsandbytes 8-bit AdamW state on CUDA
# replica, momentum, residuals, reference, update log (peak, docs/model_size.md)
BEYOND_BYTES_PER_PARAM = 19.1
DISK_BYTES_PER_PARAM = 8.0  # the replica on disk: Θ and outer momentum, fp32
# fixes that name what a volunteer has (commands and URLs, not the repository's files)
REINSTALL = "install p2p_diloco again with its dependencies: pip install p2p_diloco (or the wheel you got)"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions() -> list[Check]:
    py = platform.python_version()
    out = [
        Check("python", Status.OK if sys.version_info >= (3, 11) else Status.FAIL, f"{py} ({sys.executable})")
    ]
    found = {d: _version(d) for d in ("p2p_diloco", "torch", "hivemind", "transformers", "numpy", "pydantic")}
    missing = [d for d, v in found.items() if v is None]
    detail = ", ".join(f"{d} {v}" for d, v in found.items() if v)
    out.append(
        Check(
            "packages",
            Status.FAIL if missing else Status.OK,
            detail + (f"; missing: {', '.join(missing)}" if missing else ""),
            REINSTALL if missing else "",
        )
    )
    numpy = found.get("numpy") or "0"
    if tuple(int(x) for x in numpy.split(".")[:2] if x.isdigit()) >= (2, 4):
        out.append(
            Check(
                "numpy",
                Status.FAIL,
                f"numpy {numpy}: hivemind's 8-bit quantizers break on numpy >= 2.4",
                "pip install 'numpy<2.4'",
            )
        )
    return out


def check_devices(device: str | None) -> tuple[list[Check], int | None]:
    """Torch's devices and bitsandbytes; also the free memory of the GPU a CUDA join would use."""
    import torch

    if torch.cuda.is_available():
        index = int(device.partition(":")[2] or 0) if device and device.startswith("cuda") else 0
        free, total = torch.cuda.mem_get_info(index)
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        checks = [
            Check(
                "cuda",
                Status.OK,
                f"torch {torch.__version__}, CUDA {torch.version.cuda}: {names}; cuda:{index} has "
                f"{free / GIB:.1f} of {total / GIB:.1f} GiB free",
            )
        ]
        gpu_free: int | None = free
    else:
        wanted = bool(device and device.startswith("cuda"))
        built = torch.version.cuda
        checks = [
            Check(
                "cuda",
                Status.FAIL if wanted else Status.OK,
                f"no CUDA device (torch {torch.__version__}, "
                f"built {'with CUDA ' + built if built else 'for CPU'})"
                + ("" if wanted else ": training runs on the CPU"),
                f"install a CUDA build of torch ({CUDA_TORCH}) or join with --device cpu" if wanted else "",
            )
        ]
        gpu_free = None
    bnb = _version("bitsandbytes")
    if bnb is None:
        checks.append(Check("bitsandbytes", Status.WARN, "not installed", "pip install bitsandbytes"))
    else:
        where = (
            "8-bit AdamW on CUDA" if torch.cuda.is_available() else "CPU only: adamw8bit falls back to AdamW"
        )
        checks.append(Check("bitsandbytes", Status.OK, f"{bnb} ({where})"))
    return checks, gpu_free


def count_parameters(manifest: Any) -> int:
    """Parameters of the manifest's model, built on the meta device (nothing allocated or initialized)."""
    import torch

    from p2p_diloco.config import ModelKind

    if manifest.model.kind == ModelKind.GPT:
        from p2p_diloco.model.gpt import GPT

        with torch.device("meta"):
            model = GPT(manifest.model)
    else:
        from p2p_diloco.model.external import build_skeleton

        model = build_skeleton(manifest.model)
    return sum(p.numel() for p in model.parameters())


def host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_checks(
    params: int, *, host_free: int | None, gpu_free: int | None, eight_bit: bool
) -> list[Check]:
    """Host (and GPU) memory against what a peer of a `params`-parameter model needs (activations aside)."""
    train = params * (
        TRAIN_BYTES_PER_PARAM_8BIT if eight_bit and gpu_free is not None else TRAIN_BYTES_PER_PARAM
    )
    beyond = params * BEYOND_BYTES_PER_PARAM
    host_need = RUNTIME_BYTES + beyond + (0 if gpu_free is not None else train)
    out = []
    if host_free is None:
        out.append(
            Check("host memory", Status.WARN, "cannot read /proc/meminfo", "check free memory yourself")
        )
    else:
        ok = host_free >= host_need
        out.append(
            Check(
                "host memory",
                Status.OK if ok else Status.FAIL,
                f"{host_free / GIB:.1f} GiB available, a peer needs about {host_need / GIB:.1f} GiB",
                "" if ok else "free memory, or join a run with a smaller model (or train on a GPU)",
            )
        )
    if gpu_free is not None:
        ok = gpu_free >= train
        out.append(
            Check(
                "gpu memory",
                Status.OK if ok else Status.FAIL,
                f"{gpu_free / GIB:.1f} GiB free, training state needs {train / GIB:.1f} GiB plus activations",
                "" if ok else "use --micro-batch to cut activations, free the GPU, or use a larger one",
            )
        )
    return out


def check_manifest(path: str | None) -> tuple[list[Check], Any]:
    if not path:
        return [
            Check(
                "manifest",
                Status.WARN,
                "none given: this machine alone is checked",
                "p2p-diloco doctor RUN.toml checks a run",
            )
        ], None
    from p2p_diloco.net.manifest_signature import load_run_manifest

    try:
        manifest = load_run_manifest(path, warn=False)
    except ConfigError as exc:
        return [Check("manifest", Status.FAIL, str(exc), "fix the manifest as the message says")], None
    kind = "public, signature verified" if manifest.trust.public else "private, unsigned"
    detail = f"{path}: run {manifest.run_id} (manifest {manifest.manifest_hash}, {kind})"
    return [Check("manifest", Status.OK, detail)], manifest


def check_contract(manifest: Any) -> Check:
    """A custom factory's model built and probed once, as `join` does before joining (`model.contract`:
    its keywords, the (logits, loss) pair, the vocabulary against the data's where it is readable)."""
    import dataclasses

    from p2p_diloco.model.contract import check_model_contract, data_vocab_size
    from p2p_diloco.model.gpt import build_model

    fix = "fix the factory or [model.config] as the message says"
    try:
        vocab: int | None = data_vocab_size(manifest.data)
    except ConfigError:
        vocab = None  # the shards are not here yet: the forward is still probed
    try:
        check_model_contract(
            manifest, build_model(dataclasses.replace(manifest.model, weights_digest="")), vocab
        )
    except ConfigError as exc:
        return Check("model contract", Status.FAIL, str(exc), fix)
    except Exception as exc:  # the organizer's code: whatever it raises is a finding, not doctor's crash
        return Check(
            "model contract", Status.FAIL, f"{manifest.model.factory}: {type(exc).__name__}: {exc}", fix
        )
    compared = (
        f"vocabulary {vocab} covered" if vocab is not None else "vocabulary not compared (no data here)"
    )
    return Check(
        "model contract", Status.OK, f"{manifest.model.factory}: forward returns (logits, loss), {compared}"
    )


def check_peers(addresses: list[str], timeout: float) -> list[Check]:
    from p2p_diloco.net.addresses import tcp_endpoints
    from p2p_diloco.preflight import _connect

    if not addresses:
        return [
            Check(
                "initial peers",
                Status.WARN,
                "none given or in the manifest: outbound connections not tried",
                "pass --initial-peers",
            )
        ]
    out = []
    for address in addresses:
        endpoints = tcp_endpoints([address])
        if not endpoints:
            out.append(Check("initial peer", Status.WARN, f"{address}: not a plain TCP address, not probed"))
            continue
        reason = _connect(*endpoints[0], timeout)
        out.append(
            Check(
                "initial peer",
                Status.OK if reason is None else Status.FAIL,
                f"{address}: " + ("accepts connections" if reason is None else reason),
                ""
                if reason is None
                else (
                    "check the address (the whole `bootstrap address:` line), "
                    "that the node runs, and firewalls"
                ),
            )
        )
    return out


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses as the routing table picks them (no packet is sent)."""
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: picks the outgoing interface's address
            found.add(probe.getsockname()[0])
        except OSError:
            pass
    return sorted(found)


def check_reachability() -> Check:
    addresses = local_addresses()
    public = [a for a in addresses if ipaddress.ip_address(a).is_global]
    if public:
        return Check("reachability", Status.OK, f"public address {', '.join(public)}: peers can dial you")
    shown = ", ".join(addresses) or "none"
    return Check(
        "reachability",
        Status.WARN,
        f"only private addresses ({shown}): behind NAT unless a port is forwarded",
        "join with --behind-nat, or forward a TCP port and pass --listen /ip4/0.0.0.0/tcp/PORT "
        "--announce /ip4/PUBLIC_IP/tcp/PORT",
    )


def check_state_dir(path: str | None, params: int | None) -> Check:
    if not path:
        free = shutil.disk_usage(Path.cwd()).free
        return Check(
            "state dir", Status.OK, f"none given (join needs --state-dir); {free / GIB:.1f} GiB free here"
        )
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        return Check("state dir", Status.FAIL, f"{path} is a file", "give a directory for --state-dir")
    existing = next((q for q in (p, *p.parents) if q.exists()), Path("/"))
    if not os.access(existing, os.W_OK):
        return Check("state dir", Status.FAIL, f"{existing} is not writable", "choose a directory you own")
    free = shutil.disk_usage(existing).free
    need = int((params or 0) * DISK_BYTES_PER_PARAM)
    used = "holds a peer's state" if (p / "peer_state.json").exists() else "new"
    ok = free >= 2 * need
    return Check(
        "state dir",
        Status.OK if ok else Status.WARN,
        f"{path} ({used}): {free / GIB:.1f} GiB free on its disk, the replica takes {need / GIB:.2f} GiB",
        "" if ok else "free disk space (saves write a second copy before replacing the first)",
    )


def machine_memory_check(host_free: int | None) -> Check:
    """Host memory without a run: enough for the runtime and a small model (a run's needs: its manifest)."""
    if host_free is None:
        return Check("host memory", Status.WARN, "cannot read /proc/meminfo", "check free memory yourself")
    ok = host_free >= 2 * RUNTIME_BYTES
    return Check(
        "host memory",
        Status.OK if ok else Status.WARN,
        f"{host_free / GIB:.1f} GiB available (a run's model needs more: doctor RUN.toml compares)",
        "" if ok else "free memory: a peer alone takes about 0.5 GiB before its model",
    )


def run_checks(
    manifest: Any, args: argparse.Namespace, gpu_free: int | None
) -> tuple[list[Check], int | None]:
    """The manifest's model: its size, a custom factory's contract, memory against what it needs."""
    from p2p_diloco.config import InnerOptimizer, ModelKind

    try:
        params = count_parameters(manifest)
    except ConfigError as exc:
        return [Check("model", Status.FAIL, str(exc), "fix [model] as the message says")], None
    checks = [Check("model", Status.OK, f"{manifest.model.kind}, {params / 1e6:.1f}M parameters")]
    if manifest.model.kind == ModelKind.CUSTOM:
        checks.append(check_contract(manifest))
    eight_bit = manifest.train.optimizer == InnerOptimizer.ADAMW_8BIT
    use_gpu = gpu_free if (args.device or "cuda").startswith("cuda") else None
    checks += memory_checks(params, host_free=host_memory_available(), gpu_free=use_gpu, eight_bit=eight_bit)
    return checks, params


def diagnose(args: argparse.Namespace) -> list[Check]:
    """The machine's checks, and with a manifest the run's: without one, doctor checks the machine alone."""
    checks = check_versions()
    device_checks, gpu_free = check_devices(args.device)
    checks += device_checks
    manifest_checks, manifest = check_manifest(args.manifest)
    checks += manifest_checks
    params = None
    if manifest is not None:
        model_checks, params = run_checks(manifest, args, gpu_free)
        checks += model_checks
    else:
        checks.append(machine_memory_check(host_memory_available()))
    peers = list(args.initial_peers or (manifest.bootstrap if manifest is not None else ()))
    peer_checks = check_peers(peers, args.timeout)
    answered = any(c.status == Status.OK for c in peer_checks)
    clock = measure_clock(manifest, peers, answered, args.timeout) if manifest is not None else system_clock()
    checks += [*peer_checks, clock]
    checks.append(check_reachability())
    checks.append(check_state_dir(args.state_dir, params))
    return checks


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def cli_doctor(args: argparse.Namespace) -> int:
    checks = diagnose(args)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks]}, indent=1))
    else:
        print(format_checks(checks))
    return 1 if any(c.status == Status.FAIL for c in checks) else 0
