"""A `join` process SIGKILLed on its own (the OOM killer, `kill -9`; not its whole process group) leaves no
DHT process or p2pd behind, and the peer restarts on the same state directory (`net.lifeline`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.state import read_events
from tests.support.processes import children_of, descendants, running

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 90.0  # imports, DHT and p2pd start on a loaded 2-core machine


def join_command(cli, tmp_path: Path) -> tuple[list[str], Path]:  # noqa: ANN001
    """A `join` of the demo manifest on loopback with a fresh key, and its state directory."""
    identity, state_dir = tmp_path / "peer.key", tmp_path / "state"
    write_identity(identity)
    cmd = cli(
        "join", str(REPO_ROOT / "peers" / "demo.toml"), "--identity", str(identity),
        "--state-dir", str(state_dir), "--listen", "/ip4/127.0.0.1/tcp/0", "--persist-every", "1",
    )  # fmt: skip
    return cmd, state_dir


def starts(state_dir: Path) -> int:
    return sum(1 for e in read_events(state_dir) if e["event"] == "start")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_sigkilled_peer_leaves_no_process_behind_and_restarts_on_its_state_dir(
    spawn, cli, wait_for, tmp_path
):
    cmd, state_dir = join_command(cli, tmp_path)
    first = spawn(cmd)
    wait_for(lambda: starts(state_dir) == 1, START_TIMEOUT, "the peer's start event")
    helpers = descendants(first.pid)
    assert "p2pd" in helpers.values(), helpers  # the DHT process and its p2pd

    os.kill(first.pid, signal.SIGKILL)  # the peer process only, as the OOM killer would
    first.wait(timeout=10)
    wait_for(
        lambda: not any(running(pid) for pid in helpers), 30, f"the peer's helpers {helpers} to exit with it"
    )

    second = spawn(cmd)  # same identity and state dir: refused while an orphan held the directory's lock
    wait_for(lambda: starts(state_dir) == 2, START_TIMEOUT, "the restarted peer's start event")
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=60) == 0, second.stderr_tail()


@pytest.mark.soak
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_peer_whose_dht_process_died_stops_with_its_state_saved_so_a_restart_rejoins(
    spawn, cli, wait_for, tmp_path
):
    """hivemind's DHT process can die under a peer (a desynchronized pipe, the OOM killer): without it the
    peer can neither renew a lease nor see the swarm, so it stops with exit status 3 instead of running on
    deaf (the 30-minute chaos run had a holder publish for minutes that way)."""
    cmd, state_dir = join_command(cli, tmp_path)
    peer = spawn(cmd)
    wait_for(lambda: starts(state_dir) == 1, START_TIMEOUT, "the peer's start event")
    dht = [
        pid
        for pid, name in descendants(peer.pid).items()
        if name == "python" and pid in children_of(peer.pid)
    ]
    assert len(dht) == 1, descendants(peer.pid)  # the forked DHT process (besides p2pd, torch's shm manager)
    os.kill(dht[0], signal.SIGKILL)
    assert peer.wait(timeout=60) == 3, peer.stderr_tail()
    events = [e["event"] for e in read_events(state_dir)]
    assert "dht_died" in events

    again = spawn(cmd)  # same identity and state dir: its lock was released, its replica saved
    wait_for(lambda: starts(state_dir) == 2, START_TIMEOUT, "the restarted peer's start event")
    restarted = [e for e in read_events(state_dir) if e["event"] == "start"][-1]
    assert restarted["restored"], restarted
    again.signal(signal.SIGTERM)
    assert again.wait(timeout=60) == 0, again.stderr_tail()
