"""Issue #32's mistakes that involve live daemons, against a real bootstrap node on 127.0.0.1: each is
refused with a message that names the fix and exit status 2 (the other cases: tests/unit/test_cli_mistakes.py).
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from p2p_diloco.net.identity import write_identity
from tests.integration.conftest import REPO_ROOT, python_cmd

pytestmark = [pytest.mark.integration, pytest.mark.soak]
WRONG_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a valid peer ID nobody uses


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        python_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, check=False
    )


def port_of(address: str) -> int:
    return int(address.split("/tcp/")[1].split("/")[0])


def join_args(tmp_path: Path, key: Path, *extra: str) -> list[str]:
    return ["join", "demo", "--identity", str(key), "--state-dir", str(tmp_path / "state"), *extra]


@pytest.fixture
def key(tmp_path: Path) -> Path:
    path = tmp_path / "me.key"
    write_identity(path)
    return path


def test_second_bootstrap_on_a_port_in_use_refuses(bootstrap_node, tmp_path):
    port = port_of(bootstrap_node.addresses[0])
    result = cli("bootstrap", "--listen", f"/ip4/127.0.0.1/tcp/{port}", timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"TCP port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "bootstrap address:" not in result.stdout and "choose a free port" in result.stderr


def test_join_with_the_identity_of_a_live_peer_names_keygen(bootstrap_node, tmp_path):
    args = join_args(tmp_path, bootstrap_node.identity, "--initial-peers", bootstrap_node.addresses[0])
    result = cli(*args, "--max-steps", "0")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "is already used by a live peer" in result.stderr
    assert "p2p-diloco keygen --out peer2.key" in result.stderr


def test_join_with_an_unreachable_bootstrap_is_refused_at_once(tmp_path, key):
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{WRONG_ID}"
    result = cli(*join_args(tmp_path, key, "--initial-peers", address, "--max-steps", "0"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"none of --initial-peers answers ({address}: Connection refused)" in result.stderr
    assert "copy the whole `bootstrap address:` line" in result.stderr
    assert "Checking that identity" not in result.stderr  # refused before any daemon started


def test_join_with_a_mistyped_peer_id_names_the_address_line(bootstrap_node, tmp_path, key):
    port = port_of(bootstrap_node.addresses[0])
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{WRONG_ID}"
    result = cli(*join_args(tmp_path, key, "--initial-peers", address, "--max-steps", "0"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no initial peer accepted a connection" in result.stderr
    assert "a wrong peer ID after /p2p/ is refused" in result.stderr
