"""`join --hot-spare` on real processes: the peer SIGKILLed, its prepared spare takes over under the same
peer ID and state directory without a cold start; SIGTERM stops the peer cleanly and dismisses the spare."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.standby import READY
from p2p_diloco.node.state import PEER_STATE_FILE, read_events
from tests.support.processes import children_of, running

pytestmark = [pytest.mark.integration, pytest.mark.soak]

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 90.0  # imports, DHT and p2pd start on a loaded 2-core machine


def start_events(state_dir: Path) -> list[dict]:
    return [e for e in read_events(state_dir) if e["event"] == "start"]


def comm(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def python_children(pid: int) -> list[int]:
    return [child for child in children_of(pid) if comm(child).startswith("python")]


def is_spare(pid: int) -> bool:
    try:
        return b"--standby" in (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_killed_peer_is_replaced_by_its_prepared_spare_under_the_same_identity(
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
        )  # fmt: skip
    )
    wait_for(lambda: len(start_events(state_dir)) == 1, START_TIMEOUT, "the peer's start event")
    first = start_events(state_dir)[0]
    assert first["peer_id"] == peer_id and first["startup"]["hot_spare"] is False

    def spare_and_peer() -> tuple[int, int] | None:
        kids = python_children(supervisor.pid)
        spares = [pid for pid in kids if is_spare(pid)]
        peers = [pid for pid in kids if not is_spare(pid)]
        return (spares[0], peers[0]) if len(spares) == 1 and len(peers) == 1 else None

    wait_for(spare_and_peer, 30, "the supervisor's peer and spare")
    spare, peer = spare_and_peer()
    supervisor.wait_for_lines(READY, START_TIMEOUT)  # the spare prepared (its output is the supervisor's)
    helpers = {pid: comm(pid) for pid in children_of(spare)}
    # a spare starts no DHT node (no DHT process, no p2pd); torch's shared-memory manager is hivemind's
    assert set(helpers.values()) <= {"torch_shm_manag"}, helpers

    wait_for(lambda: (state_dir / PEER_STATE_FILE).exists(), 30, "the peer's first save of its state")
    os.kill(peer, signal.SIGKILL)  # the peer alone, as the OOM killer would
    wait_for(lambda: len(start_events(state_dir)) == 2, START_TIMEOUT, "the spare's start event")
    second = start_events(state_dir)[1]
    assert second["peer_id"] == peer_id
    assert second["startup"]["hot_spare"] is True, second
    assert second["restored"] is True  # it loaded the replica the dead peer saved
    assert running(spare) and spare in children_of(supervisor.pid)  # the spare itself is the peer now

    def tokens_since_takeover() -> float:
        return max(
            (
                e.get("tokens", 0)
                for e in read_events(state_dir)
                if e["event"] == "progress" and e["t"] > second["t"]
            ),
            default=0,
        )

    wait_for(lambda: tokens_since_takeover() > 0, 60, "the promoted spare to train")
    wait_for(
        lambda: any(is_spare(pid) and pid != spare for pid in python_children(supervisor.pid)),
        30,
        "a new spare",
    )

    children = python_children(supervisor.pid)
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(timeout=90) == 0, supervisor.stderr_tail()
    # the peer stopped cleanly (its stop event) and the new spare left on end of input: nobody is left
    wait_for(lambda: not any(running(pid) for pid in children), 30, f"the supervisor's children {children}")
    assert any(e["event"] == "stopped" and e["t"] > second["t"] for e in read_events(state_dir))
    assert "the hot spare takes over" in supervisor.stderr_tail(50)
    assert len(start_events(state_dir)) == 2  # the dismissed spare never started a peer


def test_a_spare_whose_input_ends_leaves_without_touching_the_state_directory(cli, tmp_path):
    identity, state_dir = tmp_path / "peer.key", tmp_path / "state"
    write_identity(identity)
    join = cli(
        "join", str(REPO_ROOT / "peers" / "demo.toml"), "--identity", str(identity),
        "--state-dir", str(state_dir), "--standby",
    )  # fmt: skip
    done = subprocess.run(join, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert READY in done.stdout  # it prepared the model first
    assert not state_dir.exists()  # and never opened (or created) the peer's state directory

    both = subprocess.run([*join, "--hot-spare"], capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "--hot-spare and --standby exclude each other" in both.stderr
