"""A peer's `failovers_seen` (the join panel's "failovers seen", Prometheus' failovers_seen_total) counts a
change of synchronizer only when the old holder's lease was not released: a planned rotation (the holder
released its term) is no failover (issue #32: the panel counted every rotation)."""

from __future__ import annotations

from p2p_diloco.protocol import election
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.swarm.memory import InMemoryKeyValueStore
from p2p_diloco.wire.keys import lease_key
from p2p_diloco.wire.records import encode_lease
from tests.support.manifests import tiny_manifest
from tests.support.peers import make_peer

MANIFEST = tiny_manifest("failovers")


def write(kv: InMemoryKeyValueStore, lease: LeaseRecord) -> None:
    key = lease_key(MANIFEST.run_id, MANIFEST.manifest_hash)
    kv.store(key, lease.holder, encode_lease(lease), lease.expires_at + 60.0)


def followed_after(released: bool) -> tuple[str, int, int]:
    """A peer follows A's term 1; then B holds term 2, A's lease either released or lapsed."""
    peer = make_peer(MANIFEST)
    kv, clock, ttl = peer.kv, peer.clock, MANIFEST.timing.lease_ttl
    write(kv, LeaseRecord("A", 1, expires_at=clock.now() + ttl))
    assert peer.election_tick(clock.now()).action == election.FOLLOW
    clock.advance_to(clock.now() + (1.0 if released else ttl + 1.0))
    if released:  # A hands its role on: a release record, B claims at once
        write(kv, LeaseRecord("A", 1, expires_at=clock.now() + ttl, released=True))
    write(kv, LeaseRecord("B", 2, expires_at=clock.now() + ttl))
    decision = peer.election_tick(clock.now())
    return decision.holder, decision.term, peer.peer.failovers_seen


def test_a_planned_rotation_is_not_a_failover():
    assert followed_after(released=True) == ("B", 2, 0)


def test_a_lapsed_holder_replaced_is_a_failover():
    assert followed_after(released=False) == ("B", 2, 1)
