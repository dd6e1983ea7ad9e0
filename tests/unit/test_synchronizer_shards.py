"""Synchronizer shards, the pure parts: the `[diloco] synchronizer_shards` knob, the fragment-to-shard
assignment, per-shard lease keys, and the rendezvous spread of shards over candidates (`protocol.shards`)."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.node.status import format_status, swarm_status
from p2p_diloco.protocol import election, shards
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.swarm.memory import InMemoryKeyValueStore
from p2p_diloco.wire import keys
from p2p_diloco.wire.records import HeartbeatInfo, decode_heartbeat, encode_lease
from tests.support.manifests import TINY_DILOCO, tiny_manifest
from tests.support.peers import make_peer

RUN = ("demo", "0123456789abcdef")


def manifest(**diloco) -> RunManifest:
    return RunManifest.from_dict({"run_id": "demo", "diloco": {"fragments": 4, **diloco}})


def test_one_shard_keeps_the_manifest_hash_and_a_valid_count_changes_it():
    base = manifest()
    assert base.diloco.synchronizer_shards == 1
    assert manifest(synchronizer_shards=1).manifest_hash == base.manifest_hash
    assert manifest(synchronizer_shards=2).manifest_hash != base.manifest_hash


@pytest.mark.parametrize("bad", [0, 5, -1])
def test_shard_count_outside_one_to_fragments_is_refused_naming_the_fix(bad):
    with pytest.raises(ConfigError, match="synchronizer_shards"):
        manifest(synchronizer_shards=bad)


def test_every_fragment_has_exactly_one_shard_and_shards_split_evenly():
    for num_fragments in range(1, 13):
        for count in range(1, num_fragments + 1):
            owned = [shards.fragments_of(s, count, num_fragments) for s in range(count)]
            flat = sorted(p for group in owned for p in group)
            assert flat == list(range(num_fragments))
            assert all(shards.shard_of(p, count) == s for s, group in enumerate(owned) for p in group)
            assert max(map(len, owned)) - min(map(len, owned)) <= 1 and min(map(len, owned)) >= 1


def test_one_shard_owns_every_fragment():
    assert shards.fragments_of(0, 1, 4) == (0, 1, 2, 3)
    assert {shards.shard_of(p, 1) for p in range(4)} == {0}


def test_shard_zero_keeps_the_unsharded_lease_key_and_ranking_salt():
    assert keys.lease_key(*RUN, 0) == keys.lease_key(*RUN) == keys.record_key(*RUN, keys.LEASE)
    assert shards.shard_salt("demo", 0) == "demo"
    all_keys = keys.lease_keys(*RUN, 4)
    assert len(set(all_keys)) == 4 and all_keys[0] == keys.lease_key(*RUN)
    assert all(k.startswith(keys.namespace(*RUN)) for k in all_keys)
    with pytest.raises(ValueError):
        keys.lease_key(*RUN, -1)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("candidates", [1, 2, 3, 4, 6, 16])
def test_no_candidate_gets_more_than_its_share_of_shards(count, candidates):
    peers = [f"peer-{i}" for i in range(candidates)]
    for term in range(1, 6):
        chosen = shards.spread("demo", term, count, peers)
        assert sorted(chosen) == list(range(count))
        most = max(collections.Counter(chosen.values()).values())
        assert most <= shards.holder_cap(count, candidates)


def test_shards_rank_candidates_differently():
    peers = [f"peer-{i}" for i in range(8)]
    firsts = {shards.spread("demo", 1, 4, peers)[s] for s in range(4)}
    assert len(firsts) == 4


def test_at_cap_names_the_peers_holding_their_share():
    held = shards.holdings(["a", "a", None, "b"])
    assert held == {"a": 2, "b": 1}
    assert shards.at_cap(held, 2) == {"a"}
    assert shards.at_cap(held, 1) == {"a", "b"}
    assert shards.holder_cap(4, 0) == 4 and shards.holder_cap(4, 3) == 2


# ---- per-shard elections on one peer (fake clock) -------------------------------------------------

SHARDED = tiny_manifest("shards", diloco=dataclasses.replace(TINY_DILOCO, synchronizer_shards=2))


SHARDED_HB = keys.heartbeat_key(SHARDED.run_id, SHARDED.manifest_hash)


def lease(kv: InMemoryKeyValueStore, shard: int, record: LeaseRecord) -> None:
    key = keys.lease_key(SHARDED.run_id, SHARDED.manifest_hash, shard)
    kv.store(key, record.holder, encode_lease(record), record.expires_at + 60.0)


def elect_all(harness, now: float) -> list:
    """One election round of every shard (what a swarm tick does after its read)."""
    peer = harness.peer
    views = peer.membership.ingest_all(harness.read_all())
    decisions = [peer.elect(view, now, shard=seat.shard) for seat, view in zip(peer.seats, views)]
    for intent in peer.flush():
        harness.perform(intent)
    return decisions


def test_each_shard_is_elected_on_its_own_lease_key_with_its_own_terms():
    harness = make_peer(SHARDED, may_sync=True)
    kv, clock, timing = harness.kv, harness.clock, SHARDED.timing
    lease(kv, 0, LeaseRecord("A", 1, expires_at=clock.now() + timing.lease_ttl))
    harness.heartbeat(clock.now())
    elect_all(harness, clock.now())
    clock.advance_to(clock.now() + timing.heartbeat_ttl)  # read the swarm long enough to claim
    lease(kv, 0, LeaseRecord("A", 1, expires_at=clock.now() + timing.lease_ttl))  # A renews
    harness.heartbeat(clock.now())
    first, second = elect_all(harness, clock.now())
    assert (first.action, first.holder, first.term) == (election.FOLLOW, "A", 1)
    assert (second.action, second.holder, second.term) == (election.CLAIM, "me", 1)
    peer = harness.peer
    assert peer.seats[0].sync is None and peer.seats[1].sync is not None and peer.sync is peer.seats[1].sync
    written = kv.get(keys.lease_key(SHARDED.run_id, SHARDED.manifest_hash, 1), clock.now())
    assert set(written) == {"me"}
    assert set(kv.get(keys.lease_key(SHARDED.run_id, SHARDED.manifest_hash), clock.now())) == {"A"}
    # fencing and lease checks per shard: fragment 0 is shard 0's (A's term), fragment 1 shard 1's (mine)
    assert peer.membership.for_fragment(0).held_lease("A", 1)
    assert not peer.membership.for_fragment(1).held_lease("A", 1)
    assert peer.membership.for_fragment(1).my_lease is not None and peer.membership.my_lease is None
    assert peer.outbox.targets == {0: ("A", 1), 1: ("me", 1)}
    info = peer.heartbeat_info()
    assert info.shard_terms == (1,) and info.term_of(0) == 1 and info.term_of(1) == 1


def test_a_peer_holding_its_share_steps_aside_for_another_candidate():
    harness = make_peer(SHARDED, may_sync=True)
    kv, clock, timing = harness.kv, harness.clock, SHARDED.timing
    versions = harness.peer.replica.versions()
    other = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=versions)
    lease(kv, 0, LeaseRecord("me", 1, expires_at=clock.now() + timing.lease_ttl))
    harness.peer.membership.my_lease = LeaseRecord("me", 1, expires_at=clock.now() + timing.lease_ttl)
    for _ in range(2):
        kv.store(SHARDED_HB, "B", other.to_bytes(), clock.now() + timing.heartbeat_ttl)
        harness.heartbeat(clock.now())
        _, second = elect_all(harness, clock.now())
        clock.advance_to(clock.now() + timing.heartbeat_ttl)
    # 2 candidates, 2 shards: one each. "me" ranks first for shard 1's term 1, but it holds shard 0: B claims
    assert second.action == election.WAIT and second.holder == "B", second
    assert second.tag == election.ElectionTag.NOT_ELIGIBLE and "my share of the other shards" in second.detail
    assert harness.peer.seats[1].sync is None


def test_unsharded_heartbeats_are_byte_for_byte_as_before():
    info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(1, 2))
    assert b"shard_terms" not in info.to_bytes()
    assert decode_heartbeat(info.to_bytes(), 2) == info
    sharded = dataclasses.replace(info, shard_terms=(4, 5))
    assert decode_heartbeat(sharded.to_bytes(), 2).term_of(2) == 5


def test_status_shows_each_shards_holder_and_term():
    kv, now, ttl = InMemoryKeyValueStore(), 100.0, SHARDED.timing.lease_ttl
    lease(kv, 0, LeaseRecord("A", 1, expires_at=now + ttl))
    lease(kv, 1, LeaseRecord("B", 1, expires_at=now + ttl))
    status = swarm_status(kv, SHARDED, now)
    rows = [(row["shard"], row["fragments"], row["synchronizer"]["peer_id"]) for row in status["shards"]]
    assert rows == [(0, [0], "A"), (1, [1], "B")]
    assert status["synchronizer"]["peer_id"] == "A"  # the top-level fields stay shard 0's
    text = format_status(status)
    assert "shard 0 (fragments 0): A term 1" in text and "shard 1 (fragments 1): B term 1" in text
    unsharded = tiny_manifest("shards")
    assert [row["shard"] for row in swarm_status(InMemoryKeyValueStore(), unsharded, now)["shards"]] == [0]
