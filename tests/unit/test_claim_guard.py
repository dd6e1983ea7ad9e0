"""The checks a claim passes before a peer makes it (`protocol.claim_guard`, issue 29 item 3): no claim on
a read that provably misses a record, nor by a peer that lags; a complete read claims as fast as before.

Unpaced, 8 real peers on 2 cores claimed one term up to 6 times ("claim: term 2, rank 1 of 1"): each had
read the others (every such claim named one of them successor) but ranked only itself, judging their
heartbeats (up to a TTL old) against its own replica now; and reads of a starved process return little.
"""

from __future__ import annotations

from p2p_diloco.config import TrustConfig
from p2p_diloco.protocol import claim_guard as guard
from p2p_diloco.protocol import election
from p2p_diloco.protocol.candidates import PeerHeartbeat, rendezvous_rank
from p2p_diloco.protocol.claim_guard import ClaimChecks, ReadCover, RecordKind, RecordSlot
from p2p_diloco.protocol.election import ElectionDecision, ElectionTag, LeaseRecord
from p2p_diloco.protocol.standing import Standing
from p2p_diloco.protocol.timing import SwarmTiming
from p2p_diloco.swarm.effects import SwarmRecords
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.wire.interfaces import StoredValue
from p2p_diloco.wire.records import HeartbeatInfo, encode_lease
from tests.support.manifests import tiny_manifest

T = SwarmTiming()  # heartbeat period 1, TTL 4; lease TTL 6, claim grace 2, margin 0.5
A, B, C = (
    "QmAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "QmBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
    ("QmCccccccccccccccccccccccccccccccccccccccccccc"),
)
HB = RecordKind.HEARTBEAT


def claim(term: int = 2, tag: ElectionTag = ElectionTag.CLAIM) -> ElectionDecision:
    return ElectionDecision(election.CLAIM, tag, "rank 1 of 1", term=term, holder=A, expires_at=106.0)


# --- the pure rule, on a fake clock -----------------------------------------------------------------


def test_a_read_that_lacks_a_record_still_stored_holds_a_claim_back_until_it_expires():
    cover, gaps = guard.covered(
        ReadCover(), {RecordSlot(HB, A): 104.0, RecordSlot(HB, B): 104.0}, A, 100.0, T
    )
    assert not gaps
    cover, gaps = guard.covered(cover, {RecordSlot(HB, A): 105.0}, A, 101.0, T)  # B's record: still stored
    assert set(gaps.missing) == {RecordSlot(HB, B)}
    held = guard.gate(claim(), ClaimChecks(gaps=gaps))
    assert (held.action, held.tag, held.holder) == (election.WAIT, ElectionTag.INCOMPLETE_READ, None)
    assert f"the {HB} of {B}" in held.detail and held.lease_to_write() is None
    # B's record expires at 104 (less the clock margin): from then on its absence proves nothing
    cover, gaps = guard.covered(cover, {RecordSlot(HB, A): 107.5, RecordSlot(HB, C): 107.0}, A, 103.5, T)
    assert not gaps
    assert guard.gate(claim(), ClaimChecks(gaps=gaps)) == claim()


def test_a_forged_far_future_expiration_holds_claims_back_no_longer_than_an_honest_record():
    cover, _ = guard.covered(
        ReadCover(), {RecordSlot(HB, A): 104.0, RecordSlot(HB, B): 10_000.0}, A, 100.0, T
    )
    others = {RecordSlot(HB, A): 110.0, RecordSlot(HB, C): 110.0}  # not only my own records
    _, gaps = guard.covered(cover, others, A, 100.0 + T.heartbeat_ttl, T)
    assert not gaps  # counted as if it expired a heartbeat TTL (+ margin) after the read, less the margin
    _, gaps = guard.covered(cover, others, A, 100.0 + T.heartbeat_ttl - 0.1, T)
    assert RecordSlot(HB, B) in gaps.missing


def test_a_read_of_only_my_own_records_waits_a_bounded_time_then_a_peer_alone_claims():
    cover, _ = guard.covered(ReadCover(), {RecordSlot(HB, A): 104.0, RecordSlot(HB, B): 104.0}, A, 100.0, T)
    alone = {RecordSlot(HB, A): 130.0}
    later = 100.0 + 2 * guard.record_life(RecordKind.LEASE, T)  # every record B wrote has expired long ago
    _, gaps = guard.covered(cover, alone, A, later - 0.1, T)
    assert gaps and gaps.others_seen == 100.0 and not gaps.missing
    assert guard.gate(claim(), ClaimChecks(gaps=gaps)).tag == ElectionTag.INCOMPLETE_READ
    _, gaps = guard.covered(cover, alone, A, later, T)
    assert not gaps  # alone that long: it claims
    # a peer that never read another (a new run) does not wait at all
    _, gaps = guard.covered(ReadCover(), alone, A, 100.0, T)
    assert not gaps


def test_only_a_plain_claim_waits_a_succession_claim_and_other_decisions_stand():
    _, gaps = guard.covered(ReadCover(others_seen=99.0), {}, A, 100.0, T)
    assert gaps
    succession = claim(tag=ElectionTag.SUCCESSION)
    assert guard.gate(succession, ClaimChecks(gaps=gaps)) == succession
    follow = ElectionDecision(election.FOLLOW, ElectionTag.HELD_BY, "", term=1, holder=B)
    assert guard.gate(follow, ClaimChecks(gaps=gaps)) == follow


def test_a_lagging_claimant_lets_its_window_pass():
    beats = [PeerHeartbeat(A, True, True, (3, 3), 110.0), PeerHeartbeat(B, True, True, (3, 4), 110.0)]
    held = guard.hold_lagging_claim(claim(), A, beats, 100.0, verified_newest=7)
    assert (held.action, held.tag) == (election.WAIT, ElectionTag.NOT_ELIGIBLE) and "lags" in held.detail
    assert guard.hold_lagging_claim(claim(), B, beats, 100.0, verified_newest=7) == claim()


# --- one peer's elections over its reads (Membership), on a fake clock -------------------------------


def member(me: str) -> Membership:
    manifest = tiny_manifest("claim-guard", timing=T, trust=TrustConfig(authority=A, synchronizers=(A, B, C)))
    standing = Standing(new_peer_rounds=1, active_window=60.0, newcomer_grace=60.0)
    return Membership(me, manifest, 2, Journal(me, lambda intent: None), standing)


def records(now: float, beats: dict[str, tuple[int, int]], *leases: LeaseRecord) -> SwarmRecords:
    """One read: heartbeats written at `now` (peer -> versions) and each holder's latest lease record."""
    stored = {
        p: StoredValue(
            HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=v).to_bytes(),
            now + T.heartbeat_ttl,
        )
        for p, v in beats.items()
    }
    held = {x.holder: StoredValue(encode_lease(x), election.dht_expiration(x, T)) for x in leases}
    return SwarmRecords(heartbeats=stored, leases=held, now=now)


def decide(me: Membership, read: SwarmRecords, versions: tuple[int, int]) -> ElectionDecision:
    return me.decide(me.ingest(read), read.now, 0, verified_newest=sum(versions), own_versions=versions)


def test_peers_that_see_each_others_heartbeats_a_version_behind_do_not_both_rank_themselves_first():
    """Both replicas are at (5, 5); each reads the other's heartbeat from before the last update, (5, 4).
    Ranked strictly, each was the only candidate up to date ("rank 1 of 1") and both claimed term 2."""
    lapsed = LeaseRecord(C, 1, 100.0)  # C's term 1 lapsed at 100; claims open at 100.5
    peers = {p: member(p) for p in (A, B)}
    for me in peers.values():  # warm up: read the swarm for a heartbeat TTL
        for t in (95.0, 97.0, 99.0):
            decide(me, records(t, {A: (5, 4), B: (5, 4)}, lapsed), (5, 4))
    now = 100.6
    decisions = {
        p: decide(me, records(now, {p: (5, 5), ({A, B} - {p}).pop(): (5, 4)}, lapsed), (5, 5))
        for p, me in peers.items()
    }
    claimants = [p for p, d in decisions.items() if d.action == election.CLAIM]
    assert claimants == [rendezvous_rank("claim-guard", 2, [A, B])[0]], decisions
    (waiting,) = [d for p, d in decisions.items() if p not in claimants]
    assert waiting.tag == ElectionTag.CLAIM_GRACE and waiting.holder == claimants[0]


def test_a_starved_reader_backs_off_while_the_holder_is_out_of_sight_and_claims_once_really_alone():
    me = member(B)
    for t in (90.0, 92.0, 94.0, 96.0):  # A holds term 1 and renews it every 2 s; C is a candidate too
        decision = decide(
            me, records(t, {A: (5, 5), B: (5, 5), C: (5, 5)}, LeaseRecord(A, 1, t + T.lease_ttl)), (5, 5)
        )
        assert decision.action == election.FOLLOW
    # From 96 on B's reads return only its own heartbeat: A's lease of term 1 (last seen live until 102)
    # stays remembered while live, then B would claim term 2 on a read of itself alone ("rank 1 of 1").
    starved = [decide(me, records(t, {B: (5, 5)}), (5, 5)) for t in range(97, 96 + 26)]
    assert not any(d.action == election.CLAIM for d in starved), starved
    backing_off = [d for d in starved if d.tag == ElectionTag.INCOMPLETE_READ]
    assert backing_off and "the lease of " + A in backing_off[0].detail
    # alone for twice a lease record's life since it last read another peer: B claims
    after = 96.0 + guard.alone_after(T)
    assert decide(me, records(after, {B: (5, 5)}), (5, 5)).action == election.CLAIM


def test_a_complete_read_after_the_holder_died_claims_as_soon_as_the_lease_grace_ends():
    """No wait is added to a failover: the dead holder's lease stays stored past its expiry, so complete
    reads return it, and its expired heartbeat is no gap."""
    me = member(B)
    last = LeaseRecord(A, 1, 96.0 + T.lease_ttl)  # A's last renewal, at 96; A dies at once
    for t in (92.0, 94.0, 96.0):  # A renews every 2 s
        renewal = LeaseRecord(A, 1, t + T.lease_ttl)
        assert decide(me, records(t, {A: (5, 5), B: (5, 5)}, renewal), (5, 5)).action == election.FOLLOW
    for t in (98.0, 100.0, 101.0):  # A's heartbeat (expired at 100) is gone from the DHT
        assert decide(me, records(t, {B: (5, 5)}, last), (5, 5)).action == election.FOLLOW
    opens = last.expires_at + T.lease_margin
    # A, remembered from recent reads, keeps its claim window (it may be alive): B's turn is at its rank
    assert rendezvous_rank("claim-guard", 2, [A, B]) == [A, B]
    mine = opens + T.claim_grace
    waits = [decide(me, records(t, {B: (5, 5)}, last), (5, 5)) for t in (opens - 0.1, opens, mine - 0.1)]
    assert [d.tag for d in waits] == [
        ElectionTag.LEASE_GRACE,
        ElectionTag.CLAIM_GRACE,
        ElectionTag.CLAIM_GRACE,
    ]
    assert decide(me, records(mine, {B: (5, 5)}, last), (5, 5)).action == election.CLAIM


def test_a_claim_is_confirmed_only_on_a_read_without_gaps():
    """A read that lacks a record still stored may lack another claim of the same term (issue #40)."""
    confirmed = ElectionDecision(election.HOLD, ElectionTag.CONFIRMED, "alone", term=2, holder="me")
    gaps = guard.ReadGaps({RecordSlot(RecordKind.LEASE, "other"): 30.0})
    held = guard.hold_confirmation(confirmed, gaps)
    assert (held.action, held.tag) == (election.HOLD, ElectionTag.UNCONFIRMED) and "lacks" in held.detail
    assert guard.hold_confirmation(confirmed, guard.NO_GAPS) is confirmed
    holding = ElectionDecision(election.HOLD, ElectionTag.HOLDING, "mine", term=2, holder="me")
    assert guard.hold_confirmation(holding, gaps) is holding  # a confirmed holder is not held back
