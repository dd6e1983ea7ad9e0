"""`join --hot-spare --device cuda` on real processes (node/standby.py, node/supervise.py): the spare keeps its
model in host memory while the peer lives, and after the peer's SIGKILL it takes over under the same
identity and state directory, moves the model to the GPU and trains there."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.standby import READY
from p2p_diloco.node.state import PEER_STATE_FILE, read_events
from tests.integration.test_hot_spare import is_spare, python_children, start_events
from tests.support.processes import running

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120.0


def gpu_pids() -> set[int] | None:
    """Processes holding a CUDA context, per nvidia-smi; None when it cannot tell."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        return None
    return {int(line) for line in done.stdout.split() if line.strip().isdigit()}


def test_a_spare_takes_over_a_killed_gpu_peer_and_trains_on_the_gpu(
    spawn, cli, wait_for, start_bootstrap, tmp_path
):
    bootstrap = start_bootstrap()
    identity, state_dir = tmp_path / "peer.key", tmp_path / "state"
    peer_id = write_identity(identity)
    supervisor = spawn(
        cli(
            "join",
            str(REPO_ROOT / "peers" / "demo.toml"),
            "--identity",
            str(identity),
            "--state-dir",
            str(state_dir),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--persist-every",
            "1",
            "--initial-peers",
            *bootstrap.addresses,
            "--hot-spare",
            "--device",
            "cuda",
        )  # fmt: skip
    )
    wait_for(lambda: len(start_events(state_dir)) == 1, START_TIMEOUT, "the peer's start event")
    supervisor.wait_for_lines("joined run", START_TIMEOUT)
    assert any("device cuda" in line for line in supervisor.lines if line.startswith("joined run"))

    def spare_and_peer() -> tuple[int, int] | None:
        kids = python_children(supervisor.pid)
        spares = [pid for pid in kids if is_spare(pid)]
        peers = [pid for pid in kids if not is_spare(pid)]
        return (spares[0], peers[0]) if len(spares) == 1 and len(peers) == 1 else None

    wait_for(spare_and_peer, 60, "the supervisor's peer and spare")
    spare, peer = spare_and_peer()
    supervisor.wait_for_lines(READY, START_TIMEOUT)
    holders = gpu_pids()
    visible = holders is not None and peer in holders  # nvidia-smi sees the pids of this namespace
    if visible:
        assert spare not in holders, "the spare holds GPU memory while the peer lives"

    wait_for(lambda: (state_dir / PEER_STATE_FILE).exists(), 60, "the peer's first save of its state")
    os.kill(peer, signal.SIGKILL)
    wait_for(lambda: len(start_events(state_dir)) == 2, START_TIMEOUT, "the spare's start event")
    second = start_events(state_dir)[1]
    assert second["peer_id"] == peer_id and second["startup"]["hot_spare"] is True, second
    assert second["restored"] is True
    assert running(spare)
    supervisor.wait_for_lines("joined run", START_TIMEOUT, count=2)
    assert all("device cuda" in line for line in supervisor.lines if line.startswith("joined run"))

    def tokens_since_takeover() -> float:
        return max(
            (
                e.get("tokens", 0)
                for e in read_events(state_dir)
                if e["event"] == "progress" and e["t"] > second["t"]
            ),
            default=0,
        )

    wait_for(lambda: tokens_since_takeover() > 0, 90, "the promoted spare to train")
    if visible:
        holders = gpu_pids()
        assert holders is not None and spare in holders, f"the promoted spare trains; nvidia-smi: {holders}"
    print(f"measured: takeover to start event {second['startup'].get('total')} s")
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(timeout=90) == 0, supervisor.stderr_tail()
