"""Synchronizer shards, the pure parts: the `[diloco] synchronizer_shards` knob, the fragment-to-shard
assignment, per-shard lease keys, and the rendezvous spread of shards over candidates (`protocol.shards`)."""

from __future__ import annotations

import collections

import pytest

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol import shards
from p2p_diloco.wire import keys

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
