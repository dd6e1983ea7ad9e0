"""Synchronizer terms seen by a peer. A new term is a new synchronizer, even when the same peer holds it:
deltas in flight to the old term are released and resent at once (its rounds are gone), not left to the
in-flight timeout. A holder whose term ends merges its open rounds before it releases the lease."""

from __future__ import annotations

import dataclasses

import torch

from p2p_diloco.protocol import election
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.messages import DeltaHeader
from p2p_diloco.swarm.effects import DeltaWork, Stopping, StoreRecord
from p2p_diloco.swarm.memory import FakeClock, InMemoryKeyValueStore
from p2p_diloco.swarm.outbox import InFlight
from p2p_diloco.wire.codecs.codec import encode_tensors
from p2p_diloco.wire.frames import encode_delta
from p2p_diloco.wire.keys import lease_key
from p2p_diloco.wire.records import decode_lease, encode_lease
from tests.support.manifests import tiny_manifest
from tests.support.peers import PeerHarness, make_peer

MANIFEST = tiny_manifest("terms")


def hold(kv: InMemoryKeyValueStore, holder: str, term: int, expires_at: float) -> None:
    """A lease record as `holder` writes it (peers read it before `expires_at - lease_ttl` passes)."""
    lease = LeaseRecord(holder, term, expires_at=expires_at)
    kv.store(lease_key(MANIFEST.run_id, MANIFEST.manifest_hash), holder, encode_lease(lease), expires_at)


def train_and_send(peer: PeerHarness, clock: FakeClock) -> None:
    for _ in range(2 * MANIFEST.diloco.steps_per_fragment):
        peer.train_step()


def test_a_new_term_of_the_same_holder_releases_the_deltas_sent_to_the_old_one():
    peer = make_peer(MANIFEST)
    kv, clock, transport = peer.kv, peer.clock, peer.transport
    hold(kv, "leader", 1, expires_at=105.0)
    assert peer.election_tick(clock.now()).action == election.FOLLOW
    train_and_send(peer, clock)
    assert transport.sent == ["leader", "leader"] and len(peer.learner.out) == 2  # tau = 2 in flight
    work = sum(w.steps for w in peer.learner.work)

    clock.advance_to(120.0)  # term 1 ended; the same peer holds term 2
    hold(kv, "leader", 2, expires_at=125.0)
    decision = peer.election_tick(clock.now())
    assert (decision.action, decision.holder, decision.term) == (election.FOLLOW, "leader", 2)
    assert peer.peer.outbox.in_flight == {}  # released at once ...
    peer.learner.settle()  # ... and at the learner's next step boundary their work is back to resend
    assert peer.learner.out == {} and sum(w.steps for w in peer.learner.work) > work
    assert any("('leader', 2): resending" in line for line in peer.peer.decisions)
    assert peer.peer.failovers_seen == 0  # the same holder: not a failover

    train_and_send(peer, clock)
    assert transport.sent[2:] == ["leader", "leader"]


def test_deltas_go_back_only_when_another_synchronizer_or_term_is_followed():
    """Not while no synchronizer is known (lease grace): what is in flight may still be merged."""
    routing = make_peer(MANIFEST).peer.outbox
    work = DeltaWork(16, 1, 0.1)
    routing.in_flight = {
        0: InFlight(1, ("leader", 1), 100.0, work, {}),
        1: InFlight(2, ("leader", 2), 100.0, work, {}),
    }
    routing.follow(None)
    assert set(routing.in_flight) == {0, 1}
    routing.follow(("leader", 2))  # e.g. this peer's own claim of the next term: same holder, new term
    assert set(routing.in_flight) == {1}


def test_a_holder_whose_term_ends_merges_its_open_rounds_before_releasing():
    """DESIGN: "a term ends after term_rounds rounds; the holder finishes in-flight rounds, releases the
    lease". A round with its quorum but a grace window still running is merged, not dropped."""
    manifest = dataclasses.replace(
        MANIFEST,
        timing=dataclasses.replace(MANIFEST.timing, term_rounds=1),
        robust=dataclasses.replace(MANIFEST.robust, enabled=False),
    )
    published: list = []
    me = make_peer(manifest, may_sync=True, published=published)
    kv, clock = me.kv, me.clock
    other = make_peer(manifest, kv=kv, clock=clock, peer_id="other")  # live, never reports
    for _ in range(10):  # claim term 1 (after the claim grace)
        me.heartbeat(clock.now())
        other.heartbeat(clock.now())
        me.election_tick(clock.now())
        if me.peer.sync is not None:
            break
        clock.advance_to(clock.now() + 1.0)
    assert me.peer.sync is not None and me.peer.holder == "me"
    me.peer.sync.observe_step_time(
        5.0
    )  # learners step every 5 s: a grace window of seconds waits for "other"

    def send_next_delta() -> int:
        before = set(me.peer.outbox.in_flight)
        for _ in range(manifest.diloco.steps_per_fragment):
            me.train_step()
        (fragment,) = set(me.peer.outbox.in_flight) - before
        return fragment

    first = send_next_delta()  # its round waits out the grace window for "other"
    for _ in range(30):  # the lease renewed meanwhile
        clock.advance_to(clock.now() + 1.0)
        me.heartbeat(clock.now())
        other.heartbeat(clock.now())
        assert me.election_tick(clock.now()).action in (election.HOLD, election.RENEW)
    second = send_next_delta()
    assert [r.fragment for r in me.sync_now(clock.now())] == [first]  # the first round's grace is over
    assert me.peer.sync.rounds.open_fragments == (second,)  # the second's is running
    versions = me.replica.versions()

    clock.advance_to(clock.now() + 0.5)
    decision = me.peer.elect(me.read_view(clock.now()), clock.now())  # 1 of 1 rounds done: the term ends
    intents = me.peer.flush()
    # one unit, in order: the open round's merge goes out before the released lease is stored, and once
    # the lease is given up no delta can reach a round (no thread can slip in between any more)
    kinds = [type(i).__name__ if not isinstance(i, StoreRecord) else i.what for i in intents]
    assert kinds.index("Published") < kinds.index("released lease")
    assert me.peer.sync is None and me.peer.role.sync is None
    for intent in intents:
        me.perform(intent)
    assert (decision.action, decision.tag) == (
        election.STEP_DOWN,
        election.ElectionTag.TERM_ENDED,
    )
    assert me.replica.versions()[second] == versions[second] + 1  # merged, not dropped
    assert [r.fragment for r in published] == [first, second]
    assert second not in me.peer.outbox.in_flight  # its own delta was merged: nothing to resend
    assert any("term ended: merged the open rounds of fragments" in line for line in me.peer.decisions)
    lease = decode_lease(
        "me", kv.get(lease_key(manifest.run_id, manifest.manifest_hash), clock.now())["me"].value
    )
    assert lease.released and me.peer.sync is None


def test_waiting_to_claim_never_raises_the_term_seen():
    peer = make_peer(MANIFEST)  # may not synchronize: waits with "no candidates" forever
    kv, clock = peer.kv, peer.clock
    for _ in range(5):
        peer.heartbeat(clock.now())
        assert peer.election_tick(clock.now()).action == election.WAIT
        clock.advance_to(clock.now() + 1.0)
    assert peer.peer.term_seen == 0
    hold(kv, "leader", 1, expires_at=clock.now() + 5.0)
    assert peer.election_tick(clock.now()).action == election.FOLLOW and peer.peer.term_seen == 1


def test_a_synchronizer_refuses_a_delta_repeating_work_an_applied_update_merged():
    """A learner's delta s went back at a term change and its work was resent in s' (since_seq = s); an
    update of the old holder that merged s after all reached this holder first. s' would count s twice."""
    me = make_peer(MANIFEST, may_sync=True)
    clock = me.clock
    me.peer.role.take(1)
    me.peer.book.merged_seqs[0]["other"] = 5  # what applying that update recorded
    names = me.peer.plan.names(0)
    payload = encode_tensors(
        {n: torch.zeros(me.peer.shapes[n]) for n in names}, codec=MANIFEST.wire.codec, block_size=64
    )
    steps, per_step = 4, MANIFEST.diloco.batch_size * MANIFEST.model.block_size

    def delta(seq: int, since_seq: int) -> str:
        header = DeltaHeader(
            MANIFEST.run_id, MANIFEST.manifest_hash, 0, 0, steps * per_step, steps, seq, "", since_seq
        )
        return me.handle_delta("other", encode_delta(header, payload))

    repeat = delta(7, since_seq=5)
    assert repeat.startswith("already merged") and "delta 5 was merged already" in repeat
    assert not delta(8, since_seq=6).startswith("already merged")  # only work since s: fine
    assert delta(5, since_seq=0).startswith("replay")  # the merged delta itself again: an offence
    assert me.peer.sync.rejections["already merged"] == 1
    assert "other" not in me.peer.robust.cooling(clock.now())  # not an offence


def test_a_holder_that_stops_merges_its_open_rounds_before_releasing():
    manifest = dataclasses.replace(MANIFEST, robust=dataclasses.replace(MANIFEST.robust, enabled=False))
    me = make_peer(manifest, may_sync=True)
    clock = me.clock
    me.peer.membership.my_lease = LeaseRecord("me", 1, expires_at=clock.now() + manifest.timing.lease_ttl)
    me.peer.role.take(1)
    me.peer.membership.confirmed = True  # a read showed its claim alone: it merges
    me.peer.membership.follow("me", 1)
    me.peer.outbox.follow(("me", 1))
    me.peer.sync.observe_step_time(5.0)  # learners step every 5 s: the round's grace window keeps it open
    for _ in range(manifest.diloco.steps_per_fragment):
        me.train_step()
    (fragment,) = me.peer.sync.rounds.open_fragments
    version = me.replica.versions()[fragment]
    intents = me.peer.handle(Stopping(clock.now()))
    kinds = [type(i).__name__ if not isinstance(i, StoreRecord) else i.what for i in intents]
    assert kinds.index("Published") < kinds.index("released lease")  # merged, then given up
    assert me.replica.versions()[fragment] == version + 1


def test_a_live_lease_missing_from_one_partial_dht_read_is_still_followed():
    """A DHT read can come back without the holder's record (a slow or frozen node): the follower keeps
    following the lease it saw until that lease's own expiry instead of claiming the next term."""
    peer = make_peer(MANIFEST, may_sync=True)
    kv, clock = peer.kv, peer.clock
    peer.heartbeat(clock.now())
    hold(kv, "leader", 3, expires_at=clock.now() + 6.0)
    assert peer.election_tick(clock.now()).action == election.FOLLOW
    lease_records = kv._data.pop(lease_key(MANIFEST.run_id, MANIFEST.manifest_hash))  # a partial read
    clock.advance_to(clock.now() + 3.0)
    peer.heartbeat(clock.now())
    decision = peer.election_tick(clock.now())
    assert (decision.action, decision.holder, decision.term) == (election.FOLLOW, "leader", 3)
    clock.advance_to(clock.now() + 4.0)  # past the remembered lease's expiry: no longer followed
    peer.heartbeat(clock.now())
    assert peer.election_tick(clock.now()).action != election.FOLLOW
    assert lease_records  # the record really was there before
