"""The WAN emulator itself: configured RTT and rate are what applications see, NAT blocks inbound
connections, and teardown (explicit, on SIGTERM, or `cleanup` after a SIGKILL) leaves nothing behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.wan import LinkSpec, PeerSpec, nat_problem
from p2p_diloco.wan.emulator import REGISTRY_DIR, list_namespaces, pid_alive
from p2p_diloco.wan.probe import measure_rtt, measure_throughput

pytestmark = [pytest.mark.wan, pytest.mark.slow, pytest.mark.soak]

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.20
HAVE_NAT = nat_problem() is None


def test_rtt_matches_configured_delays(make_wan):
    wan = make_wan([PeerSpec("a", LinkSpec(25)), PeerSpec("b", LinkSpec(25)), PeerSpec("c", LinkSpec(10))])
    cases = {("a", "b"): 100.0, ("a", "c"): 70.0}  # 2 x (d_i + d_j)
    for (src, dst), configured in cases.items():
        rtt = measure_rtt(wan, src, dst, count=15, interval=0.02)
        assert rtt.lost == 0, rtt.summary()
        assert abs(rtt.median_ms - configured) <= TOLERANCE * configured, (src, dst, rtt.summary())
        assert min(rtt.samples_ms) >= configured * 0.98, rtt.summary()  # a delay line never shortens


def test_tbf_rate_matches_configured_rate(make_wan):
    wan = make_wan([PeerSpec("a", LinkSpec(0, rate_mbit=20)), PeerSpec("b", LinkSpec(0, rate_mbit=20))])
    limited = measure_throughput(wan, "a", "b", seconds=4.0, warmup=1.0)
    assert abs(limited.steady_mbit - 20.0) <= TOLERANCE * 20.0, limited
    wan.shape("a", rate_mbit=None)
    wan.shape("b", rate_mbit=None)
    unlimited = measure_throughput(wan, "a", "b", seconds=2.0, warmup=0.5)
    assert unlimited.steady_mbit > 2 * 20.0, unlimited  # the limit came from tbf, not the forwarder


def _tcp_connect_argv(host: str, port: int, timeout: float) -> list[str]:
    code = (
        "import socket,sys\n"
        f"try:\n    socket.create_connection(({host!r}, {port}), timeout={timeout}).close(); print('connected')\n"
        "except OSError as e:\n    print('failed', type(e).__name__)\n"
    )
    return [sys.executable, "-c", code]


@pytest.mark.skipif(not HAVE_NAT, reason=f"NAT emulation: {nat_problem()}")
def test_nat_peer_dials_out_but_accepts_nothing(make_wan, ns_spawn):
    wan = make_wan([PeerSpec("a", LinkSpec(5)), PeerSpec("n", LinkSpec(5), nat=True)])
    for peer in ("a", "n"):
        listener = ns_spawn(
            wan, peer, [sys.executable, "-m", "p2p_diloco.wan.probe", "tcp-sink", "--port", "47002"]
        )
        listener.next_line("listening", timeout=30)

    def connect(src: str, host: str) -> str:
        out = subprocess.run(
            wan.command(src, _tcp_connect_argv(host, 47002, 2.0)), capture_output=True, text=True
        )
        return out.stdout.strip()

    assert connect("n", wan.address("a")) == "connected"
    assert measure_rtt(wan, "n", "a", count=3).lost == 0  # UDP out and the replies back in work too
    assert connect("a", wan.address("n")).startswith("failed")  # private address: no route
    assert connect("a", wan.public_address("n")).startswith("failed")  # the gateway forwards nothing in


def _leftovers(prefix: str) -> list[str]:
    """Namespaces, registry files and host-side interfaces (there should never be any) of a run."""
    files = [str(f) for f in REGISTRY_DIR.glob(f"{prefix}*")] if REGISTRY_DIR.is_dir() else []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    interfaces = [line.split(":")[1].strip() for line in links.splitlines() if prefix in line]
    return list_namespaces(prefix) + files + interfaces


def test_teardown_kills_processes_and_deletes_everything(make_wan):
    wan = make_wan([PeerSpec("a", LinkSpec(5)), PeerSpec("n", LinkSpec(5), nat=HAVE_NAT)])
    sleeper = wan.spawn("a", ["sleep", "600"])
    # a process started behind the emulator's back (not through spawn) is found by its namespace
    stray = subprocess.Popen(wan.command("n", ["sleep", "600"]), start_new_session=True)
    assert wan.forwarder is not None
    forwarder_pid = wan.forwarder.pid
    assert len(_leftovers(wan.prefix)) >= 4  # 3 namespaces (2 without NAT) + registry files
    wan.teardown()
    stray.wait(timeout=10)
    assert _leftovers(wan.prefix) == []
    assert not pid_alive(sleeper.pid) and not pid_alive(forwarder_pid)
    wan.teardown()  # idempotent


OWNER_SCRIPT = """
import json, time
from p2p_diloco.wan import WanEmulator, PeerSpec, LinkSpec
wan = WanEmulator([PeerSpec("a", LinkSpec(5)), PeerSpec("b", LinkSpec(5))]).start()
wan.spawn("a", ["sleep", "600"])
print(json.dumps({"prefix": wan.prefix, "forwarder": wan.forwarder.pid}), flush=True)
time.sleep(600)
"""


def _start_owner() -> tuple[subprocess.Popen[str], dict]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    assert owner.stdout is not None
    info = json.loads(owner.stdout.readline())
    assert list_namespaces(info["prefix"]), "the owner did not create its namespaces"
    return owner, info


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_owner_killed_by_signal_tears_down(sig):
    owner, info = _start_owner()
    try:
        owner.send_signal(sig)
        owner.wait(timeout=30)
        assert _leftovers(info["prefix"]) == []
        assert not pid_alive(info["forwarder"])
    finally:
        owner.kill()
        subprocess.run(
            [sys.executable, "scripts/wan_emulator.py", "cleanup", "--prefix", info["prefix"]], cwd=REPO_ROOT
        )


def test_sigkilled_owner_is_cleaned_by_cleanup_command():
    owner, info = _start_owner()
    try:
        owner.kill()  # SIGKILL: no handler runs, everything is left behind
        owner.wait(timeout=10)
        assert list_namespaces(info["prefix"]), "SIGKILL should leave the namespaces behind"
        out = subprocess.run(
            [sys.executable, "scripts/wan_emulator.py", "cleanup", "--stale"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert info["prefix"] in out.stdout
        assert _leftovers(info["prefix"]) == []
        assert not pid_alive(info["forwarder"])
    finally:
        subprocess.run(
            [sys.executable, "scripts/wan_emulator.py", "cleanup", "--prefix", info["prefix"]], cwd=REPO_ROOT
        )
