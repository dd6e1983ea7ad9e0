"""Owner-signed records through a real bootstrap: peers read each other's records; nobody forges one."""

from __future__ import annotations

import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.net.dht_store import DROP_NO_OWNER, DhtKeyValueStore
from p2p_diloco.wire import keys

pytestmark = pytest.mark.integration

RUN, MANIFEST = "dht-test", "00112233445566aa"
OTHER_MANIFEST = "00112233445566bb"


@pytest.fixture(scope="module")
def swarm(bootstrap_node, module_dht_peers):
    """Two run peers (bob in client mode) and an outsider, all joined through the bootstrap."""
    alice = module_dht_peers(initial_peers=bootstrap_node.addresses)
    bob = module_dht_peers(initial_peers=bootstrap_node.addresses, client_mode=True)
    mallory = module_dht_peers(initial_peers=bootstrap_node.addresses)
    return alice, bob, mallory


def test_two_peers_read_each_others_signed_records(swarm):
    alice, bob, _ = swarm
    key = keys.heartbeat_key(RUN, MANIFEST)
    now = get_dht_time()
    assert DhtKeyValueStore(alice).store(key, alice.peer_id, b"alice-hb", now + 30)
    assert DhtKeyValueStore(bob).store(key, bob.peer_id, b"bob-hb", now + 30)

    for reader in (alice, bob):
        seen = DhtKeyValueStore(reader).get(key, get_dht_time())
        assert {pid: v.value for pid, v in seen.items()} == {
            alice.peer_id: b"alice-hb",
            bob.peer_id: b"bob-hb",
        }
        assert seen[alice.peer_id].expiration == pytest.approx(now + 30)


@pytest.mark.soak
def test_a_later_record_replaces_the_owners_earlier_one(swarm):
    alice, bob, _ = swarm
    key = keys.lease_key(RUN, MANIFEST)
    store = DhtKeyValueStore(alice)
    now = get_dht_time()
    assert store.store(key, alice.peer_id, b"term 1", now + 20)
    assert store.store(key, alice.peer_id, b"term 2", now + 40)
    assert DhtKeyValueStore(bob).get(key, get_dht_time())[alice.peer_id].value == b"term 2"


@pytest.mark.soak
def test_a_third_peer_cannot_overwrite_another_peers_record(swarm):
    alice, bob, mallory = swarm
    key = keys.lease_key(RUN, "0123456789abcdef")
    now = get_dht_time()
    assert DhtKeyValueStore(alice).store(key, alice.peer_id, b"alice holds the lease", now + 30)

    # through the project's store: refused outright
    with pytest.raises(ValueError, match="subkey must be this peer's ID"):
        DhtKeyValueStore(mallory).store(key, alice.peer_id, b"mallory", now + 60)
    # through raw hivemind, under alice's owner tag with a later expiration: no valid signature
    forged = mallory.dht.store(key, b"mallory holds the lease", now + 60, subkey=alice.owner_tag)
    assert forged is False

    for reader in (alice, bob, mallory):
        seen = DhtKeyValueStore(reader).get(key, get_dht_time())
        assert seen[alice.peer_id].value == b"alice holds the lease"
        assert set(seen) == {alice.peer_id}


@pytest.mark.soak
def test_unsigned_subkeys_are_dropped_and_do_not_hide_signed_records(bootstrap_node, dht_peers):
    alice = dht_peers(initial_peers=bootstrap_node.addresses)
    # bob stores nothing itself; a short RPC timeout keeps the dead-alice lookup quick
    bob = dht_peers(initial_peers=bootstrap_node.addresses, client_mode=True, wait_timeout=1.0)
    mallory = dht_peers(initial_peers=bootstrap_node.addresses)
    key = keys.update_log_key(RUN, MANIFEST)
    now = get_dht_time()
    assert DhtKeyValueStore(alice).store(key, alice.peer_id, b"log", now + 30)
    assert mallory.dht.store(key, b"junk", now + 30, subkey=b"not-an-owner-tag")  # unprotected: accepted

    alice.shutdown()  # bob must now read alice's record from replicas that also hold the junk
    reader = DhtKeyValueStore(bob)
    seen = reader.get(key, get_dht_time())
    assert {pid: v.value for pid, v in seen.items()} == {alice.peer_id: b"log"}
    assert reader.dropped[DROP_NO_OWNER] == 1


@pytest.mark.soak
def test_expired_records_are_not_returned_and_other_manifests_are_separate(swarm):
    alice, bob, _ = swarm
    key = keys.snapshot_key(RUN, MANIFEST)
    now = get_dht_time()
    assert DhtKeyValueStore(alice).store(key, alice.peer_id, b"snap", now + 5)
    reader = DhtKeyValueStore(bob)
    assert alice.peer_id in reader.get(key, now)
    assert reader.get(key, now + 6) == {}  # the caller's clock decides what is expired
    assert reader.get(keys.snapshot_key(RUN, OTHER_MANIFEST), get_dht_time()) == {}


@pytest.mark.soak
def test_peer_reports_its_visible_addresses(swarm):
    alice, _, _ = swarm
    addresses = alice.visible_addresses()
    assert addresses and all(a.startswith("/ip4/127.0.0.1/tcp/") for a in addresses)
    assert all(a.endswith(f"/p2p/{alice.peer_id}") for a in addresses)


@pytest.mark.soak
def test_records_of_the_largest_size_the_store_takes_never_kill_hiveminds_dht_process(swarm):
    """hivemind's DHT process dies on a call over 16384 pickled bytes when its reader sees the first of two
    writes (20 KB values killed it within 3 stores while another thread held the GIL). The store refuses
    values over MAX_RECORD_BYTES, and at that size 200 stores under the same load leave it alive."""
    import threading

    from p2p_diloco.net.dht_store import MAX_RECORD_BYTES

    alice = swarm[0]
    store = DhtKeyValueStore(alice)
    key = keys.heartbeat_key(RUN, "00112233445566cc")
    with pytest.raises(ValueError, match="exceeds the"):
        store.store(key, alice.peer_id, b"x" * (MAX_RECORD_BYTES + 1), get_dht_time() + 30)
    busy = threading.Event()

    def hold_the_gil() -> None:
        while not busy.is_set():
            pass

    burner = threading.Thread(target=hold_the_gil, daemon=True)
    burner.start()
    try:
        for i in range(200):
            assert store.store(key, alice.peer_id, bytes([i % 256]) * MAX_RECORD_BYTES, get_dht_time() + 30)
    finally:
        busy.set()
        burner.join()
    assert alice.alive()
