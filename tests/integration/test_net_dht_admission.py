"""DHT records from peers the run does not allow, or beyond the per-key bound, never reach the swarm."""

from __future__ import annotations

import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import RunManifest, TrustConfig
from p2p_diloco.net.admission import DROP_EXCESS, DROP_NOT_ADMITTED, admission_for
from p2p_diloco.net.dht_store import DhtKeyValueStore
from p2p_diloco.wire import keys

pytestmark = [pytest.mark.integration, pytest.mark.soak]


def test_records_of_strangers_and_excess_peers_are_ignored_and_counted(dht_peers, wait_for):
    alice = dht_peers()
    bob = dht_peers(initial_peers=alice.visible_addresses())
    mallory = dht_peers(initial_peers=alice.visible_addresses())
    manifest = RunManifest(
        run_id="admission", trust=TrustConfig(synchronizers=(alice.peer_id,), learners=(bob.peer_id,))
    )
    heartbeat = keys.heartbeat_key(manifest.run_id, manifest.manifest_hash)
    lease = keys.lease_key(manifest.run_id, manifest.manifest_hash)
    now = get_dht_time()
    for writer in (alice, bob, mallory):
        for key in (heartbeat, lease):
            assert DhtKeyValueStore(writer).store(key, writer.peer_id, writer.peer_id.encode(), now + 60)
    everyone = DhtKeyValueStore(bob)  # no admission: every signed record
    wait_for(lambda: len(everyone.get(heartbeat, get_dht_time())) == 3, 30, "all three heartbeats stored")
    wait_for(lambda: len(everyone.get(lease, get_dht_time())) == 3, 30, "all three leases stored")

    reader = DhtKeyValueStore(bob, admission=admission_for(manifest))
    assert set(reader.get(heartbeat, get_dht_time())) == {alice.peer_id, bob.peer_id}
    assert set(reader.get(lease, get_dht_time())) == {alice.peer_id}  # only a synchronizer's lease
    assert reader.dropped[DROP_NOT_ADMITTED] == 3  # mallory twice, bob's lease once

    open_run = RunManifest(run_id="admission")  # anyone may take part: the bound still holds
    bounded = DhtKeyValueStore(bob, admission=admission_for(open_run, max_subkeys=2))
    kept = bounded.get(heartbeat, get_dht_time())
    assert len(kept) == 2 and bounded.dropped[DROP_EXCESS] == 1
    assert (
        DhtKeyValueStore(alice, admission=admission_for(open_run, max_subkeys=2))
        .get(heartbeat, get_dht_time())
        .keys()
        == kept.keys()
    )  # every reader keeps the same ones
