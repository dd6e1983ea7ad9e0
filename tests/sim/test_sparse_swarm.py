"""Sim tier: the sparse codecs in the in-process swarm: union rounds keep replicas bit-identical and train,
and a synchronizer that publishes a forged listing (a made-up delta, a changed weight, a dropped
signature) is refused by every replica, which stays untouched while the run goes on."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.wire.delta_bundle import decode_bundle, encode_bundle
from p2p_diloco.wire.delta_signature import DeltaRefusal, payload_digest
from p2p_diloco.wire.frames import decode_delta, encode_delta
from p2p_diloco.wire.signing import InMemoryKeys

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("codec", ["topk-int8", "topk-int4", "topk4k-int2"])
def test_sparse_codec_swarm_trains_and_replicas_agree(manifest, corpus, codec):
    sparse = dataclasses.replace(
        manifest,
        wire=dataclasses.replace(manifest.wire, codec=codec, density=0.03),
        # Rotation every 20 rounds: each new term starts with an empty outer residual.
        timing=dataclasses.replace(manifest.timing, term_rounds=20),
    )
    report = InProcessSwarm(
        SwarmSpec(manifest=sparse, learners=3, duration=90.0, eval_every=30), corpus=corpus
    ).run()
    assert all(v >= 5 for v in report.versions), report.versions
    assert report.digests_equal
    assert report.final_eval_loss < report.eval_curve[0][2] - 0.5, report.eval_curve
    assert report.rejections == {}
    assert len(report.terms) >= 2


# ---- a hostile synchronizer under union aggregation ---------------------------------------------------


def _made_up(record: UpdateRecord, keys: InMemoryKeys) -> UpdateRecord:
    """The first listed delta replaced by one the leader made up (its own payload, listed under the
    learner's name with the new digest; the learner's signature cannot follow)."""
    frames = decode_bundle(record.payload, max_bytes=1 << 30)
    header, payload = decode_delta(frames[0], max_bytes=1 << 30)
    forged = bytearray(payload)
    forged[-1] ^= 0x01  # one value changed: still a valid frame
    frames[0] = encode_delta(header, bytes(forged))
    listed = dataclasses.replace(record.deltas[0], digest=payload_digest(bytes(forged)))
    return dataclasses.replace(record, deltas=(listed, *record.deltas[1:]), payload=encode_bundle(frames))


def _heavier(record: UpdateRecord, keys: InMemoryKeys) -> UpdateRecord:
    # more weight than the tokens its learner signed (a lighter one is the holder's earned weight, issue #41)
    signed = decode_delta(decode_bundle(record.payload, max_bytes=1 << 30)[0], max_bytes=1 << 30)[0].tokens
    listed = dataclasses.replace(record.deltas[0], weight=signed + 1)
    contributors = ((listed.learner, float(listed.weight)), *record.contributors[1:])
    return dataclasses.replace(record, deltas=(listed, *record.deltas[1:]), contributors=contributors)


def _unsigned(record: UpdateRecord, keys: InMemoryKeys) -> UpdateRecord:
    frames = decode_bundle(record.payload, max_bytes=1 << 30)
    header, payload = decode_delta(frames[-1], max_bytes=1 << 30)
    frames[-1] = encode_delta(dataclasses.replace(header, signature=b""), payload)
    return dataclasses.replace(record, payload=encode_bundle(frames))


FORGERIES = {
    "made-up delta": (_made_up, DeltaRefusal.BAD_SIGNATURE),
    "changed weight": (_heavier, DeltaRefusal.WEIGHT_MISMATCH),
    "dropped signature": (_unsigned, DeltaRefusal.BAD_SIGNATURE),
}


class ForgingSwarm(InProcessSwarm):
    """Every synchronizer publishes `forge(record)` instead of the record it merged (signed by itself, as
    a hostile leaseholder can), and installs that record on its own replica."""

    def __init__(self, spec: SwarmSpec, corpus, forge):  # noqa: ANN001
        super().__init__(spec, corpus=corpus)
        self.forge = forge
        self.leaders: set[str] = set()

    def _start_peer(self, i: int, replica: GlobalReplica, incarnation: int) -> Peer:
        peer = super()._start_peer(i, replica, incarnation)
        take = peer.role.take

        def forging_take(term: int) -> None:
            take(term)
            self.leaders.add(peer.peer_id)
            merger = peer.role.sync.merger
            honest = merger.merge_union

            def forged(p, contributions, *, live, term):  # noqa: ANN001, ANN202
                record, pending, grad = honest(p, contributions, live=live, term=term)
                return self.forge(record, self.keys), pending, grad

            merger.merge_union = forged

        peer.role.take = forging_take
        return peer


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_every_replica_refuses_a_forged_sparse_record_and_nothing_changes(manifest, corpus, forgery):
    forge, tag = FORGERIES[forgery]
    sparse = dataclasses.replace(
        manifest, wire=dataclasses.replace(manifest.wire, codec="topk4k-int2", density=0.03)
    )
    swarm = ForgingSwarm(SwarmSpec(manifest=sparse, learners=3, duration=40.0, eval_every=40), corpus, forge)
    report = swarm.run()
    assert swarm.leaders, "no peer ever synchronized"
    initial = GlobalReplica(swarm.plan, swarm.initial).digest()
    followers = [peer for peer in swarm.peers.values() if peer.peer_id not in swarm.leaders]
    assert followers
    for peer in followers:  # refused every pushed and replayed record: untouched
        assert tuple(peer.replica.versions()) == (0,) * swarm.plan.num_fragments
        assert peer.replica.digest() == initial
        assert peer.rejections[tag] >= 1, (peer.peer_id, peer.rejections)
        assert all(sender in swarm.leaders for sender, t in peer.rejections_by_sender if t == tag)
    assert max(max(p.replica.versions()) for p in swarm.peers.values()) >= 1  # the leader did publish
    assert report.tokens > 0 and all(s.steps > 0 for s in report.learners)  # the run went on
