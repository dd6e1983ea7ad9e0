"""A `join` process SIGKILLed on its own (the OOM killer, `kill -9`; not its whole process group) leaves no
DHT process or p2pd behind, and the peer restarts on the same state directory (`net.lifeline`). A Ctrl-C
in the peer's terminal (SIGINT to its whole foreground process group) stops it in order, without the
daemons' noise of dying first, and leaves nothing behind either."""

from __future__ import annotations

import os
import pty
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.runtime import SHUTDOWN_SECONDS
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


def trained(state_dir: Path) -> bool:
    return any(e["event"] == "progress" and e.get("step", 0) > 0 for e in read_events(state_dir))


@pytest.mark.skipif(
    not Path("/proc/self/stat").exists() or shutil.which("setsid") is None, reason="needs Linux /proc, setsid"
)
def test_ctrl_c_in_a_terminal_stops_a_lone_peer_quietly_and_leaves_no_daemon(cli, wait_for, tmp_path):
    """The peer runs in a pseudo-terminal's foreground process group (`setsid --ctty`, as in a shell), and
    its whole group gets SIGINT, as a terminal's Ctrl-C sends it: the DHT process and p2pd must not get
    it (p2pd used to die first and log `[ERROR] ... use of closed network connection`, and the DHT
    process then missed hivemind's grace period), the peer exits 0 within its stop deadline, and no
    helper outlives it."""
    cmd, state_dir = join_command(cli, tmp_path)
    master, terminal = pty.openpty()
    out_path = tmp_path / "peer.out"
    with open(out_path, "w") as out:
        peer = subprocess.Popen(
            ["setsid", "--ctty", *cmd, "--display", "plain"],
            stdin=terminal, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    os.close(terminal)
    helpers: dict[int, str] = {}
    try:
        wait_for(lambda: trained(state_dir), START_TIMEOUT, "the peer's first progress event")
        assert os.getpgid(peer.pid) == peer.pid and os.tcgetpgrp(master) == peer.pid  # the terminal's job
        helpers = descendants(peer.pid)
        assert "p2pd" in helpers.values(), helpers
        os.killpg(peer.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        status = peer.wait(timeout=SHUTDOWN_SECONDS + 20)  # the stop deadline, plus a loaded machine's slack
        wait_for(
            lambda: not any(running(pid) for pid in helpers), 10, f"the peer's helpers {helpers} to exit"
        )
    finally:
        for pid in [peer.pid, *helpers]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        peer.wait(timeout=10)
        os.close(master)
    output = out_path.read_text(errors="replace")  # stdout and stderr
    assert status == 0, output[-3000:]
    assert "[ERROR]" not in output and "grace period" not in output, output[-3000:]
    assert "stopped: versions" in output, output[-3000:]
