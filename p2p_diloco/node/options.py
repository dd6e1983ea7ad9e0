"""What one `join` process is asked to do (`NodeOptions`) and the device check; no side effects."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.dht_store import DEFAULT_HOST_MADDRS

# the install line for a CUDA build of torch (doctor's fix, and join's for --device cuda without CUDA)
CUDA_TORCH = (
    "pip install torch --index-url https://download.pytorch.org/whl/cu124, the CUDA version of your driver"
)


@dataclass(frozen=True)
class NodeOptions:
    manifest: RunManifest
    identity: Path
    state_dir: Path
    initial_peers: tuple[str, ...] = ()
    device: str = "cpu"
    may_sync: bool = True
    behind_nat: bool = (
        False  # unreachable: DHT client mode, relayed through the initial peers, never synchronizer
    )
    listen: tuple[str, ...] = DEFAULT_HOST_MADDRS
    announce: tuple[str, ...] = ()
    max_steps: int | None = None
    # sequences per forward/backward (gradient accumulation; 0: the manifest's whole batch). The node
    # hands it to the learner's `InnerTrainer` (model/trainer.py, `make_trainer`).
    micro_batch: int = 0
    threads: int = 1
    # nice value added to the training thread, so the peer's control plane gets the CPU first (Linux;
    # 0: off); see node/priority.py
    train_nice: int = 5
    persist_every: float = 30.0
    progress_every: float = 5.0
    min_step_time: float = 0.0  # pace training (slow devices, tests); 0 trains flat out
    flush_timeout: float = 5.0
    fetch_timeout: float = 30.0
    dht_timeout: float = 5.0
    verbose: bool = False
    metrics_port: int = 0  # Prometheus /metrics port; 0: no endpoint
    metrics_host: str = "127.0.0.1"
    display: str = (
        "auto"  # progress output: "live" (rich panel), "plain" (lines), "auto" (live on a terminal)
    )


def check_device(device: str) -> None:
    """`ConfigError` unless torch can use `device` here (cpu, cuda, cuda:N or mps)."""
    if device == "cpu":
        return
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {device}: no CUDA device is available to this torch {torch.__version__} "
                f"(built with CUDA {torch.version.cuda or 'none'}): install a CUDA build of torch "
                f"({CUDA_TORCH}), or train on the CPU with --device cpu"
            )
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise ConfigError(
                f"--device {device}: there are {torch.cuda.device_count()} CUDA devices (cuda:0..)"
            )
        return
    if device == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ConfigError("--device mps: Apple's MPS backend is not available here; use --device cpu")
        return
    raise ConfigError(f"--device must be cpu, cuda, cuda:N or mps, got {device!r}")
