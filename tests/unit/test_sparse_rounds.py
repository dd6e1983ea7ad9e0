"""Sparse rounds under union aggregation (`swarm.sparse_rounds`, issue #30): learners sign their sparse
deltas, the synchronizer admits only deltas signed by their sender and publishes a record listing them with
their frames bundled, and a replica merges them itself, bit-identically, or refuses a record whose listing
does not check (made-up delta, changed weight, dropped signature, ...) with its reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.config import DilocoConfig, ModelConfig, RunManifest, WireConfig
from p2p_diloco.model.gpt import build_model
from p2p_diloco.net.identity import write_identity
from p2p_diloco.net.record_signing import RsaRecordSigner, RsaSignatureCheck
from p2p_diloco.protocol.decisions import Action
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord, UpdateTag
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.sync_round import RoundTag
from p2p_diloco.swarm.effects import DeltaReady
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.outbox import Outbox
from p2p_diloco.swarm.sparse_rounds import open_record, signed_fields, weight_cap
from p2p_diloco.swarm.synchronizer import Synchronizer
from p2p_diloco.wire.codecs.codec import decode_sparse, encode_tensors
from p2p_diloco.wire.delta_bundle import decode_bundle, encode_bundle
from p2p_diloco.wire.delta_signature import DeltaRefusal, delta_signing_bytes, payload_digest, sign_delta
from p2p_diloco.wire.frames import decode_delta, decode_update, encode_delta, encode_update
from p2p_diloco.wire.replies import Reply
from p2p_diloco.wire.signing import InMemoryKeys

MODEL = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)
DILOCO = DilocoConfig(inner_steps=4, fragments=2, batch_size=2)
MANIFEST = RunManifest(
    run_id="sp", model=MODEL, diloco=DILOCO, wire=WireConfig(codec="topk-int8", density=0.1, block_size=64)
)
TOKENS = 4 * DILOCO.batch_size * MODEL.block_size  # H steps of batch x block: a full, uncapped weight
_template = build_model(MODEL)
SHAPES = {n: tuple(p.shape) for n, p in _template.named_parameters()}
PLAN = plan_fragments(list(SHAPES.items()), 2)
INITIAL = {n: p.detach().clone() for n, p in _template.named_parameters()}
LEARNERS = ("a", "b", "c")


def manifest_of(codec: str) -> RunManifest:
    return dataclasses.replace(MANIFEST, wire=dataclasses.replace(MANIFEST.wire, codec=codec))


def deltas(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Per learner, a delta of fragment 0 that agrees with the others (a shared direction plus noise)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = GlobalReplica(PLAN, INITIAL).shapes(0)
    base = {n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()}
    return {
        who: {n: t + 2e-3 * torch.randn(t.shape, generator=gen) for n, t in base.items()} for who in LEARNERS
    }


def signed_frame(
    keys: InMemoryKeys,
    learner: str,
    tensors: dict[str, torch.Tensor],
    *,
    seq: int = 1,
    manifest: RunManifest = MANIFEST,
    signer: str | None = None,
) -> bytes:
    """A learner's sparse delta of fragment 0, signed as `swarm.outbox` signs it (by `signer`'s key)."""
    wire = manifest.wire
    payload = encode_tensors(tensors, codec=wire.codec, block_size=wire.block_size, density=wire.density)
    header = DeltaHeader(manifest.run_id, manifest.manifest_hash, 0, 0, tokens=TOKENS, steps=4, seq=seq)
    signature = sign_delta(keys.signer(signer or learner), signed_fields(signer or learner, header, payload))
    return encode_delta(dataclasses.replace(header, signature=signature), payload)


def synchronizer(keys: InMemoryKeys, manifest: RunManifest = MANIFEST) -> Synchronizer:
    replica = GlobalReplica(PLAN, INITIAL)
    return Synchronizer("me", manifest, PLAN, replica, term=1, shapes=SHAPES, check=keys)


def honest_round(keys: InMemoryKeys, manifest: RunManifest = MANIFEST):  # noqa: ANN201
    sync = synchronizer(keys, manifest)
    for who, tensors in deltas().items():
        reply = sync.offer_delta(who, signed_frame(keys, who, tensors, manifest=manifest), 0.0)
        assert reply.ok, reply
    (outcome,) = sync.poll(10.0, frozenset(LEARNERS), cap=0.0)
    return sync, outcome


def test_dense_delta_frames_are_unchanged_and_sparse_ones_carry_the_signature():
    header = DeltaHeader("sp", MANIFEST.manifest_hash, 0, 0, tokens=TOKENS, steps=4, seq=1)
    dense = encode_delta(header, b"payload")
    assert b"signature" not in dense
    assert decode_delta(dense, max_bytes=1 << 20) == (header, b"payload")
    signed = encode_delta(dataclasses.replace(header, signature=b"\x01\x02"), b"payload")
    assert decode_delta(signed, max_bytes=1 << 20)[0].signature == b"\x01\x02"


def test_the_outbox_signs_sparse_deltas_only():
    keys = InMemoryKeys()
    tensors = deltas()["a"]
    for manifest, signs in ((MANIFEST, True), (dataclasses.replace(MANIFEST, wire=WireConfig()), False)):
        outbox = Outbox(
            "a", manifest, Journal("a", lambda intent: None), lambda intent: None, keys.signer("a")
        )
        outbox.follow(("me", 1))
        header = DeltaHeader(manifest.run_id, manifest.manifest_hash, 0, 0, tokens=TOKENS, steps=4, seq=5)
        frame = outbox.route(DeltaReady(0, 5, header, tensors, 0.0))
        assert frame is not None
        sent, payload = decode_delta(frame, max_bytes=1 << 20)
        assert bool(sent.signature) == signs
        if signs:
            signed = signed_fields("a", sent, payload)
            assert keys.verify("a", delta_signing_bytes(signed), sent.signature)


def test_the_synchronizer_admits_only_deltas_signed_by_their_sender():
    keys = InMemoryKeys()
    tensors = deltas()["a"]
    honest = signed_frame(keys, "a", tensors)
    header, payload = decode_delta(honest, max_bytes=1 << 20)
    unsigned = encode_delta(dataclasses.replace(header, signature=b""), payload)
    other_payload = encode_tensors(
        {n: -t for n, t in tensors.items()}, codec="topk-int8", block_size=64, density=0.1
    )
    resigned_payload = encode_delta(header, other_payload)  # a's signature over another payload
    as_b = signed_frame(keys, "a", tensors, signer="b")  # b's signature, sent by a
    for frame in (unsigned, resigned_payload, as_b):
        reply = synchronizer(keys).offer_delta("a", frame, 0.0)
        assert reply.tag == DeltaRefusal.BAD_SIGNATURE, reply
    no_check = Synchronizer("me", MANIFEST, PLAN, GlobalReplica(PLAN, INITIAL), term=1, shapes=SHAPES)
    assert no_check.offer_delta("a", honest, 0.0).tag == DeltaRefusal.BAD_SIGNATURE
    assert synchronizer(keys).offer_delta("a", honest, 0.0).tag == RoundTag.OPENED_ROUND


@pytest.mark.parametrize("codec", ["topk-int8", "topk4k-int2"])
def test_a_replica_merges_the_listed_deltas_bit_identically(codec):
    keys = InMemoryKeys()
    manifest = manifest_of(codec)
    sync, outcome = honest_round(keys, manifest)
    record = decode_update(encode_update(outcome.record), max_bytes=1 << 24)
    assert record == outcome.record
    assert [d.learner for d in record.deltas] == list(LEARNERS)
    assert all(d.weight == TOKENS for d in record.deltas) and record.live == 3
    assert record.contributors == tuple((w, float(TOKENS)) for w in LEARNERS)
    frames = decode_bundle(record.payload, max_bytes=1 << 24)
    assert [payload_digest(decode_delta(f, max_bytes=1 << 24)[1]) for f in frames] == [
        d.digest for d in record.deltas
    ]
    grad = open_record(record, keys, manifest, sync.replica.shapes(0))
    assert isinstance(grad, dict)
    # nothing re-sparsified: the update covers exactly the union of the entries the learners sent
    shapes = sync.replica.shapes(0)
    sent = [decode_sparse(decode_delta(f, max_bytes=1 << 24)[1], expected_shapes=shapes) for f in frames]
    for name, t in grad.items():
        union = set().union(*(set(s[name].indices.tolist()) for s in sent))
        assert set(torch.nonzero(t.reshape(-1)).reshape(-1).tolist()) <= union
        assert torch.equal(t, outcome.outer_grad[name])
    replica = GlobalReplica(PLAN, INITIAL)
    cfg = manifest.diloco
    decision = replica.apply(
        0, 0, grad, lr=cfg.outer_lr, momentum=cfg.outer_momentum, expected_checksum=record.checksum
    )
    assert decision.action == Action.APPLY
    assert sync.replica.commit(outcome.pending).action == Action.APPLY
    assert replica.digest() == sync.replica.digest()


def test_weights_are_the_signed_tokens_capped_at_h_steps():
    assert weight_cap(MANIFEST) == TOKENS
    off = dataclasses.replace(MANIFEST, robust=dataclasses.replace(MANIFEST.robust, enabled=False))
    assert weight_cap(off) is None


def _resigned(record: UpdateRecord, **changes) -> UpdateRecord:  # noqa: ANN003
    return dataclasses.replace(record, **changes)


def _frames_with(record: UpdateRecord, index: int, frame: bytes) -> bytes:
    frames = decode_bundle(record.payload, max_bytes=1 << 24)
    frames[index] = frame
    return encode_bundle(frames)


def test_every_forged_listing_is_refused_with_its_reason():
    keys = InMemoryKeys()
    sync, outcome = honest_round(keys)
    record, shapes = outcome.record, sync.replica.shapes(0)
    frames = decode_bundle(record.payload, max_bytes=1 << 24)
    header, payload = decode_delta(frames[0], max_bytes=1 << 24)
    heavier = (dataclasses.replace(record.deltas[0], weight=10 * TOKENS), *record.deltas[1:])
    forged_tensors = {n: 100 * t for n, t in deltas(seed=9)["a"].items()}
    made_up = encode_tensors(forged_tensors, codec="topk-int8", block_size=64, density=0.1)
    made_up_listing = (
        dataclasses.replace(record.deltas[0], digest=payload_digest(made_up)),
        *record.deltas[1:],
    )
    leader_signed = signed_frame(keys, "a", forged_tensors, signer="me")  # the leader signing as itself
    cases = {
        "changed weight": (
            _resigned(record, deltas=heavier, contributors=(("a", 10.0 * TOKENS), *record.contributors[1:])),
            DeltaRefusal.WEIGHT_MISMATCH,
        ),
        "weight not the contributors'": (_resigned(record, deltas=heavier), DeltaRefusal.WEIGHT_MISMATCH),
        "dropped signature": (
            _resigned(
                record,
                payload=_frames_with(
                    record, 0, encode_delta(dataclasses.replace(header, signature=b""), payload)
                ),
            ),
            DeltaRefusal.BAD_SIGNATURE,
        ),
        "made-up delta": (
            _resigned(
                record, deltas=made_up_listing, payload=_frames_with(record, 0, encode_delta(header, made_up))
            ),
            DeltaRefusal.BAD_SIGNATURE,
        ),
        "made-up delta signed by the leader": (
            _resigned(record, deltas=made_up_listing, payload=_frames_with(record, 0, leader_signed)),
            DeltaRefusal.BAD_SIGNATURE,
        ),
        "payload not the listed digest": (
            _resigned(record, payload=_frames_with(record, 0, encode_delta(header, made_up))),
            DeltaRefusal.DIGEST_MISMATCH,
        ),
        "a listed delta left out": (
            _resigned(record, payload=encode_bundle(frames[:2])),
            DeltaRefusal.WRONG_DELTA,
        ),
        "another seq": (
            _resigned(record, payload=_frames_with(record, 0, signed_frame(keys, "a", deltas()["a"], seq=2))),
            DeltaRefusal.WRONG_DELTA,
        ),
        "no listing": (_resigned(record, deltas=(), live=0), UpdateTag.WRONG_CODEC),
        "more deltas than live learners": (_resigned(record, live=2), UpdateTag.IMPLAUSIBLE_WEIGHT),
    }
    for name, (forged, tag) in cases.items():
        got = open_record(forged, keys, MANIFEST, shapes)
        assert isinstance(got, tuple) and got[0] == tag, (name, got)
    assert isinstance(open_record(record, keys, MANIFEST, shapes), dict)


def test_rsa_signed_deltas_of_real_identities_are_admitted_listed_and_checked(tmp_path):
    """The real node's identities (`net.record_signing`): RSA signatures (public key inside, ~550 bytes)
    fit the delta frame, and the synchronizer and a replica check them with nothing but the peer IDs."""
    signers = []
    for name in ("x", "y"):
        write_identity(tmp_path / f"{name}.key")
        signers.append(RsaRecordSigner(tmp_path / f"{name}.key"))
    check = RsaSignatureCheck()
    sync = Synchronizer(
        "me", MANIFEST, PLAN, GlobalReplica(PLAN, INITIAL), term=1, shapes=SHAPES, check=check
    )
    wire = MANIFEST.wire
    for signer, tensors in zip(signers, deltas().values()):
        payload = encode_tensors(tensors, codec=wire.codec, block_size=wire.block_size, density=wire.density)
        header = DeltaHeader(MANIFEST.run_id, MANIFEST.manifest_hash, 0, 0, tokens=TOKENS, steps=4, seq=1)
        signature = sign_delta(signer, signed_fields(signer.peer_id, header, payload))
        frame = encode_delta(dataclasses.replace(header, signature=signature), payload)
        assert sync.offer_delta(signer.peer_id, frame, 0.0).ok
    (outcome,) = sync.poll(10.0, frozenset(s.peer_id for s in signers), cap=0.0)
    assert isinstance(open_record(outcome.record, check, MANIFEST, sync.replica.shapes(0)), dict)
    x, y = (s.peer_id for s in signers)
    swapped = dataclasses.replace(  # y's delta listed under x's name: x never signed it
        outcome.record,
        payload=_frames_with(outcome.record, 0, decode_bundle(outcome.record.payload, max_bytes=1 << 24)[1]),
    )
    refused = open_record(swapped, check, MANIFEST, sync.replica.shapes(0))
    assert isinstance(refused, tuple) and refused[0] in (
        DeltaRefusal.WRONG_DELTA,
        DeltaRefusal.DIGEST_MISMATCH,
    )
    assert sorted((x, y)) == [d.learner for d in outcome.record.deltas]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4),
    tail_cut=st.integers(0, 3),
)
def test_mutated_sparse_deltas_are_answered_with_a_reason_and_what_gets_in_merges(edits, tail_cut):
    keys = InMemoryKeys()
    frame = bytearray(signed_frame(keys, "a", deltas()["a"]))
    start = len(frame) - 200  # inside the tensor payload
    for position, value in edits:
        frame[start + position % 200] = value
    sync = synchronizer(keys)
    before = sync.replica.digest()
    reply = sync.offer_delta("a", bytes(frame[: len(frame) - tail_cut]), 0.0)
    assert isinstance(reply, Reply) and reply.tag, reply
    for outcome in sync.poll(10.0, frozenset({"a"}), cap=0.0):  # whatever got in checks and merges
        assert isinstance(open_record(outcome.record, keys, MANIFEST, sync.replica.shapes(0)), dict)
    assert sync.replica.digest() == before
