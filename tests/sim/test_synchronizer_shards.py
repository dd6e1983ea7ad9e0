"""Sim tier, synchronizer shards (`protocol.shards`): S = 4 shards over 6 peers, one holder crashed.

The shards' holders spread over distinct peers; a crash of one holder stalls only its shard's fragments
(the named successor takes that shard over) while the other shards keep publishing, and every replica
ends bit-identical. The same run with S = 1 is the unsharded swarm the other sim tests cover."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.protocol import shards
from p2p_diloco.swarm.inprocess import Crash, InProcessSwarm, SwarmSpec

pytestmark = pytest.mark.sim

SHARDS = 4
CRASH_AT = 20.0


@pytest.fixture(scope="module")
def sharded(manifest):
    return dataclasses.replace(
        manifest, diloco=dataclasses.replace(manifest.diloco, synchronizer_shards=SHARDS)
    )


def test_shards_spread_over_peers_and_a_holder_crash_stalls_only_its_shard(sharded, corpus):
    spec = SwarmSpec(
        manifest=sharded, learners=6, duration=60.0, eval_every=1000, crashes=(Crash(-1, CRASH_AT, -1),)
    )
    swarm = InProcessSwarm(spec, corpus=corpus)
    report = swarm.run()
    # every shard got a holder of its own (6 candidates: at most ceil(4 / 6) = 1 shard each)
    first = {shard: holder for _, holder, shard, term in swarm.shard_terms if term == 1}
    assert sorted(first) == list(range(SHARDS)) and len(set(first.values())) == SHARDS, swarm.shard_terms
    [(_, victim)] = report.crashes
    dead = f"learner-{victim}"
    lost = {shard for shard, holder in first.items() if holder == dead}
    assert len(lost) == 1, (first, dead)
    [shard] = lost
    # the shard's named successor took it over: term 2 of that shard only, by another peer
    later = [(t, holder, s, term) for t, holder, s, term in swarm.shard_terms if t > CRASH_AT]
    assert [(s, term) for _, _, s, term in later] == [(shard, 2)] and later[0][1] != dead, later
    mine = set(shards.fragments_of(shard, SHARDS, sharded.diloco.fragments))
    # until that shard publishes again, the others keep publishing, from the same holders
    resumed = min(t for t, _, p, _ in swarm.published if p in mine and t > CRASH_AT)
    others = [(t, leader, p) for t, leader, p, _ in swarm.published if p not in mine]
    assert any(CRASH_AT < t < resumed for t, _, _ in others), (resumed, others)
    for p in set(range(sharded.diloco.fragments)) - mine:
        times = [t for t, _, q in others if q == p]
        after = [t for t in times if t > CRASH_AT]
        assert len(after) >= 3, (p, times)  # never stalled: this fragment kept its pace through the crash
        assert {leader for t, leader, q in others if q == p} == {first[shards.shard_of(p, SHARDS)]}
    assert report.digests_equal, "replicas diverged"
    assert all(peer.replica.versions() == report.versions for peer in swarm.peers.values())
    assert all(v >= 5 for v in report.versions), report.versions
