"""The handover check (#15: the 30-minute chaos run at 977d15f lost state twice at a term change).

A new holder published versions of a fragment over the previous term's newest updates, which it never
received: one had reached a single peer before its holder was killed, the others were published while the
new holder did not yet know that term's lease. No heartbeat showed them. So a peer that takes a term asks
the previous holders and the live peers directly for every fragment's updates after its own versions,
replays what extends its replica (each record checked) and holds the term's rounds until they answered or
a heartbeat period has passed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import replace

import torch

from p2p_diloco.config import TrustConfig
from p2p_diloco.protocol.election import ElectionTag, LeaseRecord
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.election.handover import handover_sources
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import encode_update, update_signing_bytes
from p2p_diloco.wire.keys import heartbeat_key, lease_key
from p2p_diloco.wire.records import HeartbeatInfo, encode_lease
from tests.support.peers import KEYS, PeerHarness, make_peer, signed
from tests.unit.test_holder_catch_up import MANIFEST, delta, ticks

PERIOD = MANIFEST.timing.heartbeat_period


def last_update_of(me: PeerHarness, leader: str, term: int, fragment: int = 0, *, signer: str = "") -> bytes:
    """The update `leader` published of `fragment` in `term`, v0 -> v1 (as `me` would compute it), signed by
    `signer` (the leader by default)."""
    replica = copy.deepcopy(me.replica)
    payload = encode_tensors({n: torch.full(s, 0.01) for n, s in replica.shapes(fragment).items()})
    pending = replica.compute_update(fragment, decode_tensors(payload), lr=0.7, momentum=0.9)
    record = UpdateRecord(
        MANIFEST.run_id, MANIFEST.manifest_hash, fragment, 0, term, leader, (("a", 1.0),),
        pending.checksum, payload,
    )  # fmt: skip
    if signer:
        return encode_update(
            replace(record, signature=KEYS.signer(signer).sign(update_signing_bytes(record)))
        )
    return encode_update(signed(record))


def after_old_holder(**transport_setup) -> PeerHarness:  # noqa: ANN003
    """`me`, may synchronize, with `old`'s lease of term 1 about to lapse in the DHT; ticks until it claims
    term 2 (the handover check starts there), with `transport_setup` set on its transport first."""
    me = make_peer(MANIFEST, may_sync=True)
    kv, clock, transport = me.kv, me.clock, me.transport
    old = LeaseRecord("old", 1, expires_at=clock.now() + 1.0)
    kv.store(lease_key(MANIFEST.run_id, MANIFEST.manifest_hash), "old", encode_lease(old), 1e9)
    for name, value in transport_setup.items():
        setattr(transport, name, value(me) if callable(value) else value)
    for _ in range(20):
        ticks(me, 1)
        if me.peer.sync is not None:
            return me
    raise AssertionError("never claimed")


def test_a_new_holder_replays_the_previous_holders_last_update_that_no_heartbeat_shows():
    me = after_old_holder(logs=lambda me: {"old": [last_update_of(me, "old", 1)]})
    assert me.peer.sync.term == 2
    assert {(source, after) for source, _, after in me.transport.asked} == {("old", 0)}
    assert me.replica.version(0) == 1  # checked (signature, old's lease of term 1) and applied
    assert any("handover check, replayed v1-v1 of fragment 0 from old" in line for line in me.peer.decisions)
    assert not me.peer.handover.holding(me.clock.now())
    # the term builds on it: a delta anchored at v1 is usable, the merged update goes v1 -> v2
    assert "accepted: learner" in me.handle_delta("learner", delta(0, anchor=1, seq=1))
    assert ticks(me, 1).tag == ElectionTag.CONFIRMED  # a read shows its claim alone: its rounds merge
    merged = me.sync_now(me.clock.now())
    assert [(r.fragment, r.from_version, r.term) for r in merged if r.fragment == 0] == [(0, 1, 2)]


def test_the_terms_rounds_wait_for_the_answers_at_most_a_heartbeat_period_and_a_late_answer_still_counts():
    me = after_old_holder(frozen={"old"})  # a frozen previous holder: its kernel accepts, nobody answers
    claimed = me.clock.now() - 1.0  # `ticks` advanced the clock once after the claiming election
    every = frozenset(range(me.peer.plan.num_fragments))
    assert me.peer.handover.held(claimed + 0.5 * PERIOD) == every
    assert me.peer.handover.held(claimed + PERIOD) == frozenset()  # the run never halts on it
    assert any("handover check, no answer from old within" in line for line in me.peer.decisions)

    frame = last_update_of(me, "old", 1)
    for future in me.transport.pending:  # old thaws and answers
        future.set_result([frame])
    assert me.replica.version(0) == 1  # nothing of fragment 0 was published meanwhile: it still fits


def test_sources_are_the_previous_holders_then_the_most_advanced_live_peers_never_me_or_a_dead_one():
    def hb(*versions: int) -> HeartbeatInfo:
        return HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=versions)

    live = {"me": hb(9, 9), "a": hb(1, 1), "b": hb(5, 0), "c": hb(2, 3), "dead": hb(9, 9), "old": hb(0, 0)}
    assert handover_sources("me", ["old"], live, frozenset({"dead"})) == ["old", "b", "c", "a"]
    assert handover_sources("me", ["old", "me"], live, frozenset({"dead", "old"}), limit=2) == ["b", "c"]


def test_a_hostile_answer_is_refused_with_a_reason_and_changes_nothing():
    """The answer holds garbage, an update of old's term forged by a stranger, and one the stranger signed
    for the term `me` holds (it never held a lease of it)."""

    def logs(me: PeerHarness) -> dict:
        forged = last_update_of(me, "old", 1, signer="stranger")
        return {"old": [b"\x00garbage", forged, last_update_of(me, "stranger", 2)]}

    me = after_old_holder(logs=logs)
    assert me.replica.version(0) == 0
    fragments = me.peer.plan.num_fragments  # the stub answers every fragment's request with that log
    by_sender = me.peer.rejections_by_sender
    assert sum(n for (sender, _), n in by_sender.items() if sender == "old") == 3 * fragments, by_sender
    assert by_sender[("old", "bad signature")] == by_sender[("old", "no lease")] == fragments, by_sender
    assert not me.peer.handover.holding(me.clock.now())


def test_a_source_that_refuses_ends_its_part_of_the_check_at_once():
    me = after_old_holder(logs={"old": ConnectionError("connection refused")})
    assert not me.peer.handover.holding(me.clock.now() - 1.0)  # at the claim, not a period later
    assert any("handover check, old did not answer" in line for line in me.peer.decisions)


def test_in_a_public_run_the_check_never_asks_unlisted_keys_claiming_high_versions():
    """Issue #27: under a flood of 200 fresh keys the handover check dialed all of them (ranked by the
    versions their heartbeats claim). It asks the previous holders, peers that may synchronize and peers whose
    updates this peer checked; the claims of other keys never put them on the list."""
    me_id, other = "QmMe" + "1" * 42, "QmSync" + "2" * 40
    public = dataclasses.replace(
        MANIFEST, trust=TrustConfig(authority=me_id, synchronizers=(me_id, other, "QmPrev" + "3" * 40))
    )
    me = make_peer(public, peer_id=me_id, may_sync=True)
    kv, clock, transport = me.kv, me.clock, me.transport
    key = heartbeat_key(public.run_id, public.manifest_hash)
    for i in range(20):
        sybil = "QmSybi1" + "abcdefghijkmnopqrstu"[i] * 39
        info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(10**6, 10**6))
        kv.store(key, sybil, info.to_bytes(), 1e9)
    honest = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(0, 0))
    kv.store(key, other, honest.to_bytes(), 1e9)
    old = LeaseRecord("QmPrev" + "3" * 40, 1, expires_at=clock.now() + 1.0)
    kv.store(lease_key(public.run_id, public.manifest_hash), old.holder, encode_lease(old), 1e9)
    for _ in range(20):
        ticks(me, 1)
        if me.peer.sync is not None:
            break
    assert me.peer.sync is not None
    asked = {source for source, _, _ in transport.asked}
    assert asked and asked <= {old.holder, other}, asked
