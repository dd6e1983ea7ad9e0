"""Sim tier, synchronizer shards (`protocol.shards`): S = 4 shards over 6 peers, one holder crashed.

The shards' holders spread over distinct peers; a crash of one holder stalls only its shard's fragments
(the named successor takes that shard over) while the other shards keep publishing, and every replica
ends bit-identical. The same run with S = 1 is the unsharded swarm the other sim tests cover."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.protocol import shards
from p2p_diloco.swarm.inprocess import Crash, InProcessSwarm, Partition, SwarmSpec

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


def test_a_partition_longer_than_the_lease_heals_to_one_holder_per_shard(sharded, corpus):
    """2 | 2 split of 4 peers (each holding one shard): each side takes over the shards it lost, both train;
    after the heal every fragment converges on its shard's winning branch and each shard has one holder."""
    split, heal, end = 15.0, 45.0, 80.0
    spec = SwarmSpec(
        manifest=sharded,
        learners=4,
        duration=end,
        eval_every=end,
        partitions=(Partition(((0, 1), (2, 3)), split, heal),),
    )
    swarm = InProcessSwarm(spec, corpus=corpus)
    samples: list[tuple[float, set[str], dict[int, int]]] = []

    def sample() -> None:
        peers = swarm.peers
        samples.append(
            (
                swarm.clock.now(),
                {p.replica.digest() for p in peers.values()},
                {i: sum(p.replica.versions()) for i, p in peers.items()},
            )
        )
        swarm.loop.call_later(0.25, sample)

    swarm.loop.call_at(0.0, sample)
    report = swarm.run()
    assert heal - split > 2 * sharded.timing.lease_ttl
    at_split = max((s for s in samples if s[0] <= split), key=lambda s: s[0])[2]
    before_heal = max((s for s in samples if s[0] < heal), key=lambda s: s[0])[2]
    assert all(before_heal[i] > at_split[i] + 5 for i in range(4)), (
        at_split,
        before_heal,
    )  # both sides train
    # every shard lost on one side was claimed again there (a higher term) during the split
    during = {shard for t, _, shard, term in swarm.shard_terms if split < t < heal and term > 1}
    assert during == set(range(SHARDS)), swarm.shard_terms
    converged = next((t for t, digests, _ in samples if t >= heal and len(digests) == 1), None)
    assert converged is not None and converged - heal <= 10.0, converged
    for seat in range(SHARDS):
        holders = [p.peer_id for p in swarm.peers.values() if p.seats[seat].sync is not None]
        assert len(holders) == 1, (seat, holders)
    assert report.digests_equal


def test_as_many_shards_as_peers_give_every_peer_one_shard_and_equal_replicas(manifest, corpus):
    """S grown with the swarm (issue #29: one shard per N learners keeps a holder's inbound deltas flat):
    S = P = M = 8, each peer holds exactly one shard, every fragment keeps merging, replicas identical."""
    many = 8
    spec = SwarmSpec(
        manifest=dataclasses.replace(
            manifest,
            diloco=dataclasses.replace(manifest.diloco, fragments=many, synchronizer_shards=many),
        ),
        learners=many,
        duration=40.0,
        eval_every=1000,
    )
    swarm = InProcessSwarm(spec, corpus=corpus)
    report = swarm.run()
    holders = {shard: holder for _, holder, shard, _ in swarm.shard_terms}
    assert sorted(holders) == list(range(many)) and len(set(holders.values())) == many, swarm.shard_terms
    assert len(swarm.shard_terms) == many  # one term each: no split claim, no rotation
    assert {leader for _, leader, p, _ in swarm.published} == set(holders.values())
    assert all(v >= 3 for v in report.versions), report.versions
    assert report.digests_equal, "replicas diverged"
