"""A synchronizer never publishes from behind (#15: the long chaos run lost 215 versions this way).

An update built on an older version of a fragment starts a branch of a higher term that replicas further
ahead refuse (it carries fewer updates, protocol/reconcile.py): the round is lost, and it could still win
over versions only dead peers held. So versions that trusted tips of
live peers show (vouched by a checked record, or reported alike by two peers) count when a peer judges
whether it may claim, and a holder that lacks them catches the fragment up before it merges a round of it
(at most `lease_ttl`: the run never halts on it). One peer's word alone moves nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import torch

from p2p_diloco.protocol import election
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.swarm.repair import spread_sources
from p2p_diloco.swarm.vouching import Vouchers, reported_tips, trusted_ahead
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import encode_delta, encode_update
from p2p_diloco.wire.keys import lease_key
from p2p_diloco.wire.records import HeartbeatInfo, encode_lease
from tests.support.manifests import tiny_manifest, tiny_training
from tests.support.peers import PeerHarness, make_peer, signed

MANIFEST = dataclasses.replace(
    tiny_manifest("terms"), robust=dataclasses.replace(tiny_manifest("terms").robust, enabled=False)
)


_TRAINING = tiny_training(MANIFEST)
MANIFEST_SHAPES = [_TRAINING.replica.shapes(p) for p in range(_TRAINING.plan.num_fragments)]


def ANYONE(peer: str) -> bool:  # noqa: N802 - an open run: every peer may witness
    return True


def tip(term: int, version: int, checksum: str = "c" * 16) -> BranchTip:
    return BranchTip(term, version, checksum)


def record(fragment: int, version: int, term: int, checksum: str) -> UpdateRecord:
    return UpdateRecord("r", "h", fragment, version - 1, term, "old", (("a", 1.0),), checksum, b"")


def test_tips_two_peers_report_alike_are_ahead_one_peers_alone_are_not():
    mine = [tip(1, 1, "x" * 16)]
    both = trusted_ahead(Vouchers(1), mine, [{"a": tip(1, 3), "b": tip(1, 3)}], ANYONE)
    assert set(both) == {0} and both[0].winner == tip(1, 3) and both[0].sources == ("a", "b")
    assert trusted_ahead(Vouchers(1), mine, [{"a": tip(1, 3), "b": tip(1, 2, "d" * 16)}], ANYONE) == {}

    vouchers = Vouchers(1)
    vouchers.vouch(record(0, 3, 1, "c" * 16))  # a checked record produced this state
    assert trusted_ahead(vouchers, mine, [{"a": tip(1, 3)}], ANYONE)[0].sources == ("a",)


def test_two_unlisted_keys_reporting_alike_are_no_evidence_two_listed_synchronizers_are():
    mine = [tip(1, 1, "x" * 16)]
    forged = {"stranger-1": tip(1, 3), "stranger-2": tip(1, 3)}
    listed = {"sync-a", "sync-b"}
    assert trusted_ahead(Vouchers(1), mine, [forged], listed.__contains__) == {}
    honest = {"sync-a": tip(1, 3), "sync-b": tip(1, 3), "stranger-1": tip(1, 3)}
    ahead = trusted_ahead(Vouchers(1), mine, [honest], listed.__contains__)
    assert ahead[0].sources == ("sync-a", "sync-b", "stranger-1")  # listed first, strangers only as sources


def test_peers_that_lag_spread_their_fetches_over_the_peers_on_the_tip():
    """Sources are tried witnesses first (holders last among them), but which of them first depends on the
    asker: 64 lagging peers do not all ask the same peer (sorted by ID, two peers once served 136 of 146
    replays)."""
    listed = {f"sync-{i}" for i in range(8)}
    sources = sorted(listed) + ["stranger-1", "stranger-2"]
    firsts = Counter()
    for i in range(64):
        order = spread_sources(sources, f"peer-{i}", 3, listed.__contains__)
        assert set(order[:8]) == listed and set(order[8:]) == {"stranger-1", "stranger-2"}
        firsts[order[0]] += 1
    assert len(firsts) >= 6 and max(firsts.values()) <= 20
    holders = {"sync-0", "sync-1"}
    order = spread_sources(sources, "peer-1", 3, listed.__contains__, holders)
    assert set(order[6:8]) == holders  # the synchronizers, busy merging, are asked last of the listed
    assert spread_sources(sources, "peer-1", 3, ANYONE) == spread_sources(sources, "peer-1", 3, ANYONE)


def test_reported_tips_leave_me_out_and_cap_each_fragments_terms():
    info = HeartbeatInfo("learner", True, True, (4, 2), tips=((5, "a" * 16), (1, "b" * 16)))
    reported = reported_tips(
        {"me": info, "a": info, "b": HeartbeatInfo("learner", True, True, (4, 2))}, "me", [3, 3]
    )
    assert reported == [{"a": tip(3, 4, "a" * 16)}, {"a": tip(1, 2, "b" * 16)}]


def test_newer_versions_of_a_lower_term_are_not_ahead_of_a_higher_terms_branch():
    """My state cannot lie on their history (that is reconciliation's business, not a catch-up)."""
    assert trusted_ahead(Vouchers(1), [tip(2, 1, "x" * 16)], [{"a": tip(1, 3), "b": tip(1, 3)}], ANYONE) == {}
    assert trusted_ahead(Vouchers(1), [tip(1, 3)], [{"a": tip(1, 3), "b": tip(1, 3)}], ANYONE) == {}


def report(peer: PeerHarness, who: str, versions: tuple[int, ...], tips: tuple, now: float) -> None:
    """A heartbeat of a live observer `who` as it would write it."""
    info = HeartbeatInfo(role="observer", may_sync=False, reachable=True, versions=versions, tips=tips)
    peer.kv.store(peer.peer.membership.hb_key, who, info.to_bytes(), now + MANIFEST.timing.heartbeat_ttl)


def ticks(peer: PeerHarness, seconds: int, **reports) -> election.ElectionDecision:  # noqa: ANN003
    decision = None
    for _ in range(seconds):
        now = peer.clock.now()
        peer.heartbeat(now)
        for who, (versions, tips) in reports.items():
            report(peer, who, versions, tips, now)
        decision = peer.election_tick(now)
        peer.clock.advance_to(now + 1.0)
    return decision


def test_a_peer_behind_two_peers_tips_does_not_claim_one_peers_word_does_not_stop_it():
    me = make_peer(MANIFEST, may_sync=True)
    mine = me.peer.book.tips()
    ahead = ((5, 0), ((1, "c" * 16), (mine[1].term, mine[1].checksum)))
    decision = ticks(me, 10, a=ahead, b=ahead)
    assert me.peer.sync is None and decision.action != election.CLAIM, decision

    alone = make_peer(MANIFEST, may_sync=True)
    ticks(alone, 10, a=ahead, b=((0, 0), tuple((t.term, t.checksum) for t in mine)))
    assert alone.peer.sync is not None  # a forged heartbeat cannot make an honest peer ineligible


def test_in_a_run_with_listed_synchronizers_two_strangers_tips_do_not_make_a_peer_think_it_lags():
    """Two strangers reporting the same made-up tip would otherwise keep every honest peer from claiming."""
    me_id = "QmMe" + "1" * 42
    listed = dataclasses.replace(MANIFEST, trust=dataclasses.replace(MANIFEST.trust, synchronizers=(me_id,)))
    me = make_peer(listed, peer_id=me_id, may_sync=True)
    mine = me.peer.book.tips()
    ahead = ((5, 0), ((1, "c" * 16), (mine[1].term, mine[1].checksum)))
    ticks(me, 10, a=ahead, b=ahead)
    assert me.peer.sync is not None  # a and b are not listed: their word counts for nothing here


def holder_behind() -> tuple[PeerHarness, int, bytes, tuple]:
    """`me` holds term 2 and has sent its own delta; `old` held term 1 and published fragment f v0->v1,
    which `me` missed: the update frame and the tips of the peers that applied it."""
    published: list = []
    me = make_peer(MANIFEST, may_sync=True, published=published)
    kv, clock = me.kv, me.clock
    old = LeaseRecord("old", 1, expires_at=clock.now() + 1.0)
    kv.store(lease_key(MANIFEST.run_id, MANIFEST.manifest_hash), "old", encode_lease(old), 1e9)
    ticks(me, 10)
    assert me.peer.sync is not None and me.peer.sync.term == 2
    before = set(me.peer.outbox.in_flight)
    for _ in range(MANIFEST.diloco.steps_per_fragment):
        me.train_step()
    (fragment,) = set(me.peer.outbox.in_flight) - before

    frame, checksum = old_update(me.replica, fragment, 0)
    versions = tuple(int(p == fragment) for p in range(me.peer.plan.num_fragments))
    tips = tuple(
        (1, checksum[:16]) if p == fragment else (t.term, t.checksum)
        for p, t in enumerate(me.peer.book.tips())
    )
    me.published = published
    return me, fragment, frame, (versions, tips)


def old_update(  # noqa: ANN001
    replica, fragment: int, from_version: int, contributors=(("a", 1.0),), seqs=()
) -> tuple[bytes, str]:
    """The signed term-1 update of "old" (a former holder) to `fragment` from `replica`'s state at
    `from_version`, merging `contributors` (their delta `seqs`), and the checksum it produces."""
    replica = copy.deepcopy(replica)
    payload = encode_tensors({n: torch.full(s, 0.01) for n, s in replica.shapes(fragment).items()})
    pending = replica.compute_update(fragment, decode_tensors(payload), lr=0.7, momentum=0.9)
    record = UpdateRecord(
        MANIFEST.run_id,
        MANIFEST.manifest_hash,
        fragment,
        from_version,
        1,
        "old",
        contributors,
        pending.checksum,
        payload,
        seqs=seqs,
    )
    return encode_update(signed(record)), pending.checksum


def test_a_holder_behind_trusted_tips_catches_up_before_it_merges():
    me, fragment, frame, ahead = holder_behind()
    me.transport.updates = [frame]
    ticks(me, 1, a=ahead, b=ahead)
    assert me.replica.version(fragment) == 1  # replayed the update it missed, checked
    assert any("holder behind on fragment" in line for line in me.peer.decisions)
    # the open round moved to v1 with the replica: a delta anchored there is usable
    assert "accepted: learner" in me.handle_delta("learner", delta(fragment, anchor=1, seq=8))
    (merged,) = me.sync_now(me.clock.now())
    assert (merged.fragment, merged.from_version, merged.term) == (fragment, 1, 2)
    assert dict(merged.contributors).keys() == {"me", "learner"}  # not a fork from v0


def test_a_holder_that_cannot_catch_up_waits_a_lease_ttl_then_merges():
    me, fragment, _, ahead = holder_behind()
    me.transport.updates, me.transport.snapshot = [], b"garbage"  # the peers ahead cannot serve it
    ticks(me, 1, a=ahead, b=ahead)
    assert me.replica.version(fragment) == 0
    assert me.sync_now(me.clock.now() + 1.0) == []  # the round waits for the versions others hold
    ticks(me, int(MANIFEST.timing.lease_ttl) + 1, a=ahead, b=ahead)  # renewing its lease meanwhile
    merged = me.sync_now(me.clock.now())
    assert [(r.fragment, r.from_version) for r in merged] == [(fragment, 0)]  # the run goes on
    assert any(f"fragment {fragment}: not caught up to v1" in line for line in me.peer.decisions)
    assert not me.peer.handover.wait_for(fragment, 1, me.clock.now())  # one wait per tip, not one per read


def delta(fragment: int, *, anchor: int, seq: int) -> bytes:
    tensors = {n: torch.full(s, 1e-3) for n, s in MANIFEST_SHAPES[fragment].items()}
    tokens = MANIFEST.diloco.batch_size * MANIFEST.model.block_size * 4
    header = DeltaHeader(
        MANIFEST.run_id, MANIFEST.manifest_hash, fragment, anchor, tokens=tokens, steps=4, seq=seq
    )
    return encode_delta(header, encode_tensors(tensors))


def test_a_delta_anchored_ahead_starts_a_catch_up_from_its_learner_but_holds_no_round():
    me, fragment, frame, _ = holder_behind()
    me.transport.updates = [frame]
    reply = me.handle_delta("learner", delta(fragment, anchor=1, seq=7))
    assert reply.startswith("future anchor")
    assert me.replica.version(fragment) == 1  # replayed from that learner, each record checked
    assert me.peer.handover.held(me.clock.now()) == frozenset()  # one learner's word holds no round


def test_a_holder_that_cannot_read_the_dht_stops_merging_when_its_written_lease_runs_out():
    """No election read, no renewal: past the lease it last wrote (less the margin) it merges nothing."""
    me, fragment, _, _ = holder_behind()
    lease = me.peer.membership.my_lease
    fence = lease.expires_at - MANIFEST.timing.lease_margin
    assert me.sync_now(fence + 30.0) == []  # every grace window long over, yet nothing merged
    assert any(f"term {lease.term}: lease written to expire" in line for line in me.peer.decisions)
    assert [r.fragment for r in me.sync_now(fence - 0.01)] == [fragment]  # before it, the round merges


def test_a_replayed_update_that_merged_my_delta_takes_it_out_of_flight():
    """Regression (found at 64 peers in the simulator, `deltas_settled`): an update that merged this
    learner's delta but reached it by replay (a catch-up), not by push, left the delta in flight until the
    backstop expiry, when its work would have gone out again. Every applied update now tells the outbox."""
    me = make_peer(MANIFEST)
    lease = LeaseRecord("old", 1, expires_at=me.clock.now() + MANIFEST.timing.lease_ttl)
    me.kv.store(lease_key(MANIFEST.run_id, MANIFEST.manifest_hash), "old", encode_lease(lease), 1e9)
    ticks(me, 1)
    while not me.peer.outbox.in_flight:
        me.train_step()
    (fragment, sent), *_ = me.peer.outbox.in_flight.items()
    frame, _ = old_update(me.replica, fragment, 0, contributors=(("me", 1.0),), seqs=(sent.seq,))
    me.transport.updates = [frame]
    assert me.catch_up_fragment(fragment, ["old"], target=1)
    assert me.replica.version(fragment) == 1 and fragment not in me.peer.outbox.in_flight
