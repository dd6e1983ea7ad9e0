"""Two `p2p-diloco baseline-worker` processes for the baseline integration tests: their identities and
state dirs, the command line they share, a clean stop, and the goodput accounting over their logs."""

from __future__ import annotations

import signal
from pathlib import Path

from p2p_diloco.demo.accounting import summarize
from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.state import read_events

WORKERS = ("w1", "w2")


def prepare_workers(tmp_path: Path, manifest_text: str) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """The manifest file, and per worker its state dir and a fresh identity key."""
    manifest_path = tmp_path / "tiny.toml"
    manifest_path.write_text(manifest_text)
    dirs = {name: tmp_path / name for name in WORKERS}
    keys = {name: tmp_path / f"{name}.key" for name in WORKERS}
    for key in keys.values():
        write_identity(key)
    return manifest_path, dirs, keys


def worker_args(manifest_path: Path, bootstrap, key: Path, state_dir: Path, *extra: str) -> list[str]:  # noqa: ANN001
    """`baseline-worker` arguments for a fast two-worker run on loopback (`extra`: e.g. the mode)."""
    return [
        "baseline-worker", str(manifest_path), *extra, "--initial-peers", *bootstrap.addresses,
        "--identity", str(key), "--state-dir", str(state_dir), "--learners", "2",
        "--min-step-time", "0.1", "--matchmaking-time", "1", "--averaging-timeout", "5",
        "--peer-expiration", "5", "--progress-every", "0.5", "--checkpoint-every", "1",
    ]  # fmt: skip


def stop_workers(procs: dict, timeout: float) -> None:
    """SIGTERM every worker; each must exit 0."""
    for proc in procs.values():
        proc.signal(signal.SIGTERM)
    for name, proc in procs.items():
        assert proc.wait(timeout=timeout) == 0, f"{name} exit status; stderr:\n{proc.stderr_tail()}"


def accounting(dirs: dict[str, Path]) -> tuple[dict[str, list[dict]], dict]:
    """Both workers' event logs and the goodput report over the whole run (first start to last stop)."""
    logs = {n: read_events(d) for n, d in dirs.items()}
    begin = min(e["t"] for log in logs.values() for e in log if e["event"] == "start")
    end = max(e["t"] for log in logs.values() for e in log if e["event"] == "stopped")
    return logs, summarize(logs, start=begin, end=end)
