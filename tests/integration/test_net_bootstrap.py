"""The bootstrap process: prints its addresses, exits 0 on SIGTERM, keeps records; stable peer IDs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.net.addresses import parse_peer_address, peer_id_in
from p2p_diloco.net.dht_store import DhtKeyValueStore
from p2p_diloco.net.identity import peer_id_of, write_identity
from p2p_diloco.wire import keys
from tests.support.processes import descendants

pytestmark = pytest.mark.integration

RUN, MANIFEST = "restart-test", "0123456789abcdef"


@pytest.mark.parametrize(
    "stop_signal",
    [
        pytest.param(signal.SIGTERM, id="SIGTERM"),
        pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.soak),
    ],
)
def test_bootstrap_prints_full_addresses_then_exits_0_on_signal(start_bootstrap, wait_for, stop_signal):
    node = start_bootstrap()
    assert node.peer_id.startswith("Qm")
    assert node.addresses
    for address in node.addresses:
        parsed = parse_peer_address(address, what="bootstrap address")
        assert peer_id_in(parsed) == node.peer_id
        assert address.startswith("/ip4/127.0.0.1/tcp/")

    node.handle.signal(stop_signal)
    # the DHT node is gone within about 5 s of the signal (net.dht_store); the rest is a loaded machine's slack
    assert node.handle.wait(timeout=45) == 0, node.handle.stderr_tail()
    # its DHT child and p2pd are gone too, not left behind as orphans
    wait_for(lambda: not node.handle.group_alive(), timeout=10, what="the bootstrap's process group to exit")
    assert "bootstrap stopped" in node.handle.stderr_tail()


@pytest.mark.soak
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_bootstrap_whose_dht_process_died_exits_3_for_its_supervisor(start_bootstrap):
    node = start_bootstrap()
    dht = [pid for pid, name in descendants(node.handle.pid).items() if name == "python"]
    assert len(dht) == 1, descendants(node.handle.pid)
    os.kill(dht[0], signal.SIGKILL)
    assert node.handle.wait(timeout=30) == 3, node.handle.stderr_tail()
    assert "the DHT process died" in node.handle.stderr_tail()


@pytest.mark.soak
def test_bootstrap_rejects_a_bad_listen_address_with_exit_2(spawn, cli):
    handle = spawn(cli("bootstrap", "--listen", "/ip4/1.2.3/tcp/5"))
    assert handle.wait(timeout=30) == 2
    assert "invalid IPv4 address '1.2.3'" in handle.stderr_tail()


@pytest.mark.soak
def test_peer_keeps_its_id_across_restart_and_the_bootstrap_keeps_its_records(
    start_bootstrap, dht_peers, tmp_path
):
    node = start_bootstrap()
    identity = tmp_path / "learner.key"
    expected = write_identity(identity)
    key = keys.heartbeat_key(RUN, MANIFEST)

    first = dht_peers(initial_peers=node.addresses, identity_path=identity)
    assert first.peer_id == expected == peer_id_of(identity)
    assert DhtKeyValueStore(first).store(key, first.peer_id, b"before restart", get_dht_time() + 60)
    first.shutdown()

    second = dht_peers(initial_peers=node.addresses, identity_path=identity)
    assert second.peer_id == expected
    # the record outlived its writer's process: the bootstrap kept a replica
    seen = DhtKeyValueStore(second).get(key, get_dht_time())
    assert seen[expected].value == b"before restart"
