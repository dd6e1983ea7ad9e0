"""Lease rules as a peer applies them to what its DHT reads return: regressions for two holes the hostile
suite (tests/integration/test_hostile_peers.py) found in the first version of `protocol.lease_rules`, and
for the lease screen of `p2p-diloco status`.

* A DHT read returns one record per holder, its *latest* write. A listed key re-writing an early claim of
  term T + 1 was refused until the honest holder renewed term T after the claim was first read: the
  renewal was left out as "seen after" (the zombie-renewal rule) and the renewal it replaced was no longer
  in the read, so the claim counted and one honest peer adopted T + 1 (rule 4 now remembers earlier reads).
* The healed-partition exception counted any live peer's `term_seen`: a stranger's heartbeat (learners =
  "any") vouched for a listed key's jump to T + 1000, and both honest peers adopted it (only peers that may
  synchronize vouch now).
"""

from __future__ import annotations

from p2p_diloco.config import TrustConfig
from p2p_diloco.protocol import lease_rules as rules
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.standing import Standing
from p2p_diloco.protocol.timing import SwarmTiming
from p2p_diloco.swarm.effects import SwarmRecords
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.wire.interfaces import StoredValue
from p2p_diloco.wire.records import encode_lease
from tests.support.manifests import tiny_manifest

HONEST = "QmHonestHo1derHonestHo1derHonestHo1derHonest"
INSIDER = "QmRoguekeyRoguekeyRoguekeyRoguekeyRoguekeyRo"
ME = "QmFo11owerFo11owerFo11owerFo11owerFo11owerFo"
T = SwarmTiming(heartbeat_period=0.5, heartbeat_ttl=2.0, lease_ttl=3.0, claim_grace=1.0, lease_margin=0.5)


def follower(*, candidate: bool = False) -> Membership:
    """`ME`'s membership: a follower, or (`candidate`) a listed synchronizer that runs the election."""
    synchronizers = (HONEST, INSIDER, ME) if candidate else (HONEST, INSIDER)
    manifest = tiny_manifest(
        "lease-reads", timing=T, trust=TrustConfig(authority=HONEST, synchronizers=synchronizers)
    )
    standing = Standing(new_peer_rounds=1, active_window=60.0, newcomer_grace=60.0)
    return Membership(ME, manifest, 2, Journal(ME, lambda intent: None), standing)


def read(now: float, *leases: LeaseRecord) -> SwarmRecords:
    """What one DHT read returns: each holder's latest record."""
    stored = {x.holder: StoredValue(encode_lease(x), x.expires_at + T.lease_ttl) for x in leases}
    return SwarmRecords(heartbeats={}, leases=stored, now=now)


def test_an_early_claim_stays_refused_when_the_holder_renews_after_it_was_read():
    me = follower()
    renewed_at = [98.4, 99.9]  # the honest holder renews term 1 every 1.5 s (lease live throughout)
    claim = LeaseRecord(INSIDER, 2, 99.5 + T.lease_ttl)  # written at 99.5, while term 1 is live
    me.ingest(read(99.5, LeaseRecord(HONEST, 1, renewed_at[0] + T.lease_ttl), claim))
    assert me.journal.rejections[rules.LeaseTag.EARLY_CLAIM] == 1
    view = me.ingest(read(100.0, LeaseRecord(HONEST, 1, renewed_at[1] + T.lease_ttl), claim))
    assert [lease.term for lease in view.leases] == [1], (
        "the early claim of term 2 counted in the second read"
    )
    assert not me.held_lease(INSIDER, 2)


def test_status_names_only_a_synchronizer_the_lease_rules_accept():
    """`p2p-diloco status` screens leases like the peers do: a stranger's lease, a listed key's term jump
    with an expiry an hour ahead, and an early claim are listed as refused, never as the synchronizer."""
    from p2p_diloco.node.status import swarm_status
    from p2p_diloco.swarm.memory import InMemoryKeyValueStore
    from p2p_diloco.wire.keys import heartbeat_key, lease_key
    from p2p_diloco.wire.records import HeartbeatInfo

    stranger = "QmStrangerStrangerStrangerStrangerStrangerSt"
    manifest = follower().manifest
    kv = InMemoryKeyValueStore()
    now = 1000.0
    for peer in (HONEST, ME):
        info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(5, 5), term_seen=3)
        kv.store(heartbeat_key(manifest.run_id, manifest.manifest_hash), peer, info.to_bytes(), now + 2)
    leases = {
        HONEST: LeaseRecord(HONEST, 3, now + 2.0),  # live, renewed a second ago
        stranger: LeaseRecord(stranger, 4, now + 3.0),
        INSIDER: LeaseRecord(INSIDER, 1003, now + 3600),
    }
    key = lease_key(manifest.run_id, manifest.manifest_hash)
    for holder, lease in leases.items():
        kv.store(key, holder, encode_lease(lease), lease.expires_at + 10)
    status = swarm_status(kv, manifest, now)
    assert status["synchronizer"]["peer_id"] == HONEST and status["highest_term"] == 3
    assert {(x["peer_id"], x["reason"]) for x in status["refused_leases"]} == {
        (stranger, rules.LeaseTag.NOT_SYNCHRONIZER),
        (INSIDER, rules.LeaseTag.TOO_LONG),
    }
    kv.store(key, INSIDER, encode_lease(LeaseRecord(INSIDER, 4, now + 3.0)), now + 4000)  # T + 1, early
    status = swarm_status(kv, manifest, now)
    assert status["synchronizer"]["peer_id"] == HONEST
    assert (INSIDER, rules.LeaseTag.EARLY_CLAIM) in {
        (x["peer_id"], x["reason"]) for x in status["refused_leases"]
    }


def test_a_term_jump_is_not_vouched_for_by_a_strangers_heartbeat():
    """A listed key writes term T + 1000 with an honest-looking expiry; a stranger (learners = "any") puts
    term_seen = T + 1000 in its own heartbeat. A stranger's self-report must not count as "another peer
    reports the term" (the healed-partition exception), or one spare key lifts any listed key's jump."""
    from p2p_diloco.wire.records import HeartbeatInfo

    stranger = "QmStrangerStrangerStrangerStrangerStrangerSt"
    me = follower()
    me.term_seen = 3
    beat = HeartbeatInfo(role="learner", may_sync=False, reachable=True, versions=(5, 5), term_seen=1003)
    records = read(
        99.5, LeaseRecord(HONEST, 3, 99.0 + T.lease_ttl), LeaseRecord(INSIDER, 1003, 99.5 + T.lease_ttl)
    )
    records = SwarmRecords(
        heartbeats={stranger: StoredValue(beat.to_bytes(), 101.5)}, leases=records.leases, now=records.now
    )
    view = me.ingest(records)
    assert [lease.term for lease in view.leases] == [3]
    assert me.journal.rejections[rules.LeaseTag.TERM_JUMP] == 1


def test_forged_far_future_leases_do_not_grow_a_peers_memory():
    me = follower()
    for i in range(200):  # the insider rewrites its record every read, each with a new hour-long expiry
        now = 100.0 + i
        me.ingest(read(now, LeaseRecord(INSIDER, 1000 + i, now + 3600.0 + i)))
    assert me.journal.rejections[rules.LeaseTag.TOO_LONG] == 200
    assert len(me.first_seen) <= 4 * T.lease_ttl + 2  # only records of the last few seconds are kept


def test_status_shows_versions_and_terms_backed_by_peers_that_may_synchronize_not_a_sybil_flood():
    """Issue #27: 200 fresh keys whose heartbeats claim versions 10^6 and term_seen T + 1000 made `status`
    (and the dashboard) show versions 1,000,000: a stranger decided what the run shows. Fragment versions
    now come from peers that may synchronize; unlisted rows stay, marked `listed: false` (claims)."""
    from p2p_diloco.node.status import format_status, swarm_status
    from p2p_diloco.swarm.memory import InMemoryKeyValueStore
    from p2p_diloco.wire.keys import heartbeat_key, lease_key
    from p2p_diloco.wire.records import HeartbeatInfo

    manifest = follower().manifest
    kv, now = InMemoryKeyValueStore(), 1000.0
    hb_key = heartbeat_key(manifest.run_id, manifest.manifest_hash)
    honest = HeartbeatInfo(role="synchronizer", may_sync=True, reachable=True, versions=(5, 6), term_seen=3)
    kv.store(hb_key, HONEST, honest.to_bytes(), now + 2)
    for i in range(200):
        sybil = f"QmSybi1{i:04d}".replace("0", "a") + "x" * 33
        forged = HeartbeatInfo(
            role="synchronizer", may_sync=True, reachable=True, versions=(10**6, 10**6), term_seen=1003
        )
        kv.store(hb_key, sybil, forged.to_bytes(), now + 2)
    kv.store(
        lease_key(manifest.run_id, manifest.manifest_hash),
        HONEST,
        encode_lease(LeaseRecord(HONEST, 3, now + 2.0)),
        now + 5,
    )
    status = swarm_status(kv, manifest, now)
    assert [f["version"] for f in status["fragments"]] == [5, 6]
    assert status["synchronizer"]["peer_id"] == HONEST and status["highest_term"] == 3
    assert len(status["peers"]) == 201 and sum(p["listed"] for p in status["peers"]) == 1
    assert "1 that may synchronize" in format_status(status)


def test_a_flood_of_fresh_keys_changes_no_election_view_no_round_and_no_counter_table_size():
    """The election reads only peers that may synchronize; refusals are counted per sender for at most `MAX_SENDERS_COUNTED`
    senders; and an unlisted key's heartbeat starts no newcomer grace (it is awaited from its first
    accepted delta on)."""
    from p2p_diloco.swarm.journal import MAX_SENDERS_COUNTED, OTHER_SENDERS
    from p2p_diloco.wire.records import HeartbeatInfo

    me = follower()
    beat = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(10**6, 10**6), term_seen=9)
    flood = {f"QmFresh{i:06d}": StoredValue(beat.to_bytes(), 103.0) for i in range(500)}
    honest = HeartbeatInfo(role="synchronizer", may_sync=True, reachable=True, versions=(5, 5), term_seen=3)
    flood[HONEST] = StoredValue(honest.to_bytes(), 103.0)
    view = me.ingest(SwarmRecords(heartbeats=flood, leases={}, now=100.0))
    assert len(me.live_peers) == 501
    assert view.heartbeats == []  # a follower runs no election: it only follows the lease it reads
    assert me.live_learners(100.0) == frozenset({HONEST})  # 500 idle fresh keys: nobody to wait for
    candidate = follower(candidate=True)
    view = candidate.ingest(SwarmRecords(heartbeats=flood, leases={}, now=100.0))
    assert [hb.peer_id for hb in view.heartbeats] == [HONEST]  # the election sees listed peers only

    for i in range(MAX_SENDERS_COUNTED + 10):
        me.journal.reject(f"QmFresh{i:06d}", "bad lease", "forged")
    assert len(me.journal.rejections_by_sender) == MAX_SENDERS_COUNTED + 1
    assert me.journal.rejections_by_sender[(OTHER_SENDERS, "bad lease")] == 10


def test_a_claim_on_a_read_that_may_miss_a_candidate_waits():
    """Two listed synchronizers that each read only themselves ("rank 1 of 1") both claimed one term, at a
    run's start, on a loaded machine and under a flood of fresh keys. A peer claims only after reading the
    swarm for `heartbeat_ttl`, and ranks the candidates of its recent reads that a read lacks as if present
    (a remembered one only takes its claim window; once it has been gone long enough it is forgotten)."""
    from p2p_diloco.protocol import election
    from p2p_diloco.protocol.candidates import rendezvous_rank
    from p2p_diloco.protocol.claim_guard import alone_after
    from p2p_diloco.wire.records import HeartbeatInfo

    def beats(now: float, *peers: str) -> SwarmRecords:
        info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(0, 0))
        stored = {p: StoredValue(info.to_bytes(), now + T.heartbeat_ttl) for p in peers}
        return SwarmRecords(heartbeats=stored, leases={}, now=now)

    def decide(me: Membership, records: SwarmRecords) -> election.ElectionDecision:
        return me.decide(me.ingest(records), records.now, 0, verified_newest=0, own_versions=(0, 0))

    manifest = follower().manifest
    first, second = rendezvous_rank(manifest.run_id, 1, [HONEST, INSIDER])
    me = Membership(second, manifest, 2, Journal(second, lambda intent: None), follower().standing)
    start = decide(me, beats(100.0, second))
    assert start.action == election.WAIT and election.ElectionTag.PARTIAL_READ in start.reason  # just started
    t = 100.0 + T.heartbeat_ttl
    assert decide(me, beats(t, first, second)).action == election.WAIT  # `first` has the first window
    partial = decide(me, beats(t + T.heartbeat_period, second))  # a read that lost `first`'s heartbeat
    assert partial.action == election.WAIT and partial.holder == first, partial  # not "rank 1 of 1"
    gone = t + T.heartbeat_ttl + T.lease_ttl + T.heartbeat_period  # `first` unseen that long: forgotten
    alone = decide(me, beats(gone, second))  # but a read of only my own records waits a while longer
    assert alone.tag == election.ElectionTag.INCOMPLETE_READ and "only my own records" in alone.detail, alone
    assert decide(me, beats(t + alone_after(T), second)).action == election.CLAIM  # `protocol.claim_guard`


def test_a_garbage_lease_record_is_refused_at_every_read_and_the_honest_lease_still_counts():
    """Each holder's last lease record stays decoded (`Membership._decode_lease`); a record that does not
    decode is never kept, so every read refuses and counts it again, and the honest one is read as ever."""
    me = follower()
    honest = LeaseRecord(HONEST, 1, 100.0 + T.lease_ttl)
    for i, now in enumerate((100.0, 100.5), start=1):
        records = read(now, honest)
        records.leases[INSIDER] = StoredValue(b'{"term": "one"}', now + T.lease_ttl)
        view = me.ingest(records)
        assert me.journal.rejections["bad lease"] == i
        assert [lease.holder for lease in view.leases] == [HONEST]
    assert me.held_lease(HONEST, 1) and not me.held_lease(INSIDER, 1)
