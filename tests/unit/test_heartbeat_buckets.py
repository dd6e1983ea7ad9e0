"""Heartbeat buckets (issue #40 item 1): what a peer reads each heartbeat period does not grow with the swarm.

From 16 synchronizer shards on, heartbeats live in S buckets: bucket 0 holds the candidates', read every
period, and each read samples one other bucket in turn (a peer's first `SWEEP_READS` reads take every bucket) (`protocol.heartbeat_buckets`); `Membership` keeps
what it read of each bucket until that bucket is read again (`live_peers`), and the per-period rules read
only the last read (`read_peers`)."""

from __future__ import annotations

import dataclasses
from collections import Counter

from p2p_diloco.node.status import read_heartbeats
from p2p_diloco.protocol import heartbeat_buckets as hb
from p2p_diloco.protocol.standing import Standing
from p2p_diloco.swarm.driver import InlineDriver
from p2p_diloco.swarm.effects import SwarmRecords
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.memory import FakeClock, InMemoryKeyValueStore
from p2p_diloco.wire import keys
from p2p_diloco.wire.records import HeartbeatInfo
from tests.support.manifests import TINY_DILOCO, tiny_manifest

SHARDS = 16
MANIFEST = tiny_manifest(
    "buckets",
    diloco=dataclasses.replace(TINY_DILOCO, inner_steps=SHARDS, fragments=SHARDS, synchronizer_shards=SHARDS),
)
PEERS = [f"peer-{i:03d}" for i in range(200)]


def membership(me: str, manifest=MANIFEST) -> Membership:  # noqa: ANN001
    standing = Standing(new_peer_rounds=1, active_window=60.0, newcomer_grace=60.0)
    first = Membership(me, manifest, SHARDS, Journal(me, lambda intent: None), standing)
    for shard in range(1, manifest.diloco.synchronizer_shards):
        Membership(me, manifest, SHARDS, first.journal, standing, shard=shard, first=first)
    return first


def read(kv: InMemoryKeyValueStore, m: Membership, now: float) -> SwarmRecords:
    """What a peer's driver returns for `m.read_swarm()` (`PeerDriver.read_swarm`, the one read path)."""
    driver = InlineDriver(None, kv=kv, transport=None, clock=FakeClock(now), bind=False)
    return driver.read_swarm(m.read_swarm())


def swarm(peers: list[str], now: float, gone: frozenset[str] = frozenset()) -> InMemoryKeyValueStore:
    """Every peer's heartbeat, written where its own membership writes it."""
    kv = InMemoryKeyValueStore()
    for peer in peers:
        if peer in gone:
            continue
        info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(1,) * SHARDS)
        record = membership(peer).heartbeat_record(info, now)
        kv.store(record.key, record.subkey, record.value, record.expiration)
    return kv


def test_below_sixteen_shards_one_key_holds_every_heartbeat():
    assert [hb.buckets_for(s) for s in (1, 4, 8, 15, 16, 32)] == [1, 1, 1, 1, 16, 32]
    assert hb.sample_buckets("a", 3, 1) == () and hb.bucket_of("a", 1, candidate=False) == 0
    assert all(hb.open_candidate(p, 1) for p in PEERS)
    m = membership("me", tiny_manifest("one-key"))
    assert m.own_hb_key == m.hb_key == keys.heartbeat_key("one-key", m.manifest.manifest_hash)
    assert len(m.read_swarm().leases) == 1


def test_candidates_write_bucket_zero_and_the_others_spread_over_the_rest():
    buckets = [hb.bucket_of(p, 16, candidate=hb.open_candidate(p, 16)) for p in PEERS]
    assert {b for p, b in zip(PEERS, buckets) if hb.open_candidate(p, 16)} == {0}
    assert set(buckets) == set(range(16))
    assert 4 <= buckets.count(0) <= 25  # about 200 / 16


def test_the_first_reads_take_every_bucket_then_the_sample_walks_them_seeded_by_the_peer():
    first = hb.SWEEP_READS
    assert all(hb.sample_buckets("peer-007", reads, 16) == tuple(range(1, 16)) for reads in range(first))
    walk = [hb.sample_buckets("peer-007", reads, 16) for reads in range(first, first + 15)]
    assert all(len(one) == 1 for one in walk) and sorted(b for (b,) in walk) == list(range(1, 16))
    assert walk == [hb.sample_buckets("peer-007", reads, 16) for reads in range(first, first + 15)]  # replays
    other = [hb.sample_buckets("peer-008", reads, 16) for reads in range(first, first + 2)]
    assert walk[:2] != other


def test_a_read_decodes_the_candidates_and_one_bucket_whatever_the_swarm():
    now = 100.0
    kv = swarm(PEERS, now)
    m = membership("peer-000")
    candidates = {p for p in PEERS if hb.open_candidate(p, SHARDS)}
    assert 0 < len(candidates) < 30
    m.ingest_all(read(kv, m, now))
    assert m.live_peers.keys() == m.read_peers.keys() == set(PEERS)  # joining: the first read takes all
    for _ in range(hb.SWEEP_READS - 1):
        m.ingest_all(read(kv, m, now))
    for _ in range(SHARDS - 1):
        views = m.ingest_all(read(kv, m, now))
        assert candidates <= m.read_peers.keys() and len(m.read_peers) <= len(candidates) + 30
        for view in views:  # the elections rank candidates only
            assert {x.peer_id for x in view.heartbeats} <= candidates | {"peer-000"}
    assert m.live_peers.keys() == set(PEERS)  # every bucket read again in B - 1 reads
    assert all(shard.live_peers is m.live_peers for shard in m.shards)


def test_a_peer_gone_drops_out_when_its_bucket_is_read_again():
    now = 100.0
    m = membership("peer-000")
    for _ in range(SHARDS - 1):
        m.ingest_all(read(swarm(PEERS, now), m, now))
    gone = next(p for p in PEERS if not hb.open_candidate(p, SHARDS))
    kv = swarm(PEERS, now, gone=frozenset({gone}))
    for _ in range(SHARDS - 1):
        m.ingest_all(read(kv, m, now))
    assert gone not in m.live_peers and len(m.live_peers) == len(PEERS) - 1


def test_a_peer_that_is_no_candidate_never_ranks_itself():
    me = next(p for p in PEERS if not hb.open_candidate(p, SHARDS))
    m = membership(me)
    assert m.own_hb_key != m.hb_key
    kv = swarm(PEERS, 100.0)
    for _ in range(SHARDS - 1):
        for view in m.ingest_all(read(kv, m, 100.0)):
            assert all(not x.may_sync for x in view.heartbeats if x.peer_id == me)


def run_reads(peers: list[str], seconds: float) -> dict[str, Membership]:
    """Every peer reads the swarm each period for `seconds`, writing its heartbeat where it stands."""
    members = {p: membership(p) for p in peers}
    kv, period = InMemoryKeyValueStore(), MANIFEST.timing.heartbeat_period
    now = 100.0
    while now < 100.0 + seconds:
        for m in members.values():
            info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(1,) * SHARDS)
            record = m.heartbeat_record(info, now)
            kv.store(record.key, record.subkey, record.value, record.expiration)
        for m in members.values():
            m.ingest_all(read(kv, m, now))
        now += period
    return members


def test_a_small_swarm_under_a_large_s_is_never_left_without_candidates():
    """8 peers, S = 16 (about one ID in 16 hashes to bucket 0): once they have read the swarm for a heartbeat
    period the others volunteer, and every peer counts them all as candidates."""
    peers = PEERS[:8]
    members = run_reads(peers, 3 * MANIFEST.timing.heartbeat_ttl)
    assert all(m.own_bucket[0] == 0 for m in members.values())
    assert all({p for p in peers if m.candidate(p)} == set(peers) for m in members.values())


def test_a_large_swarm_has_no_volunteers():
    members = run_reads(PEERS, 3 * MANIFEST.timing.heartbeat_ttl)
    standing = {p for p, m in members.items() if m.own_bucket[0] == 0}
    assert standing == {p for p in PEERS if hb.open_candidate(p, SHARDS)}


def test_status_and_the_dashboard_see_every_bucket_not_only_the_candidates():
    """A one-shot look at the run (`p2p-diloco status`, the dashboard's collector) reads every bucket."""
    now = 100.0
    kv = swarm(PEERS, now)
    assert len(kv.get(keys.heartbeat_key(MANIFEST.run_id, MANIFEST.manifest_hash), now)) < len(PEERS) // 4
    rows = read_heartbeats(kv, MANIFEST, now, Counter())
    assert [row["peer_id"] for row in rows] == sorted(PEERS)
