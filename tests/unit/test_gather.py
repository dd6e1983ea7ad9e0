"""The gather set of sparse rounds (`protocol.gather`, issue #40): a union round lists at most `[diloco]
gather` of its screened deltas, the greatest merge weight (tokens x standing ramp) first, ties broken by a
per-round digest; the record names the rest (`left_out`), every replica checks the bound, and dense rounds
are untouched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import DilocoConfig, ModelConfig, RunManifest, WireConfig
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.gpt import build_model
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.gather import GatherTag, choose, gather_order, tie_rank
from p2p_diloco.protocol.messages import DeltaHeader, UpdateTag
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.standing import Standing
from p2p_diloco.protocol.sync_round import Contribution
from p2p_diloco.swarm.sparse_rounds import open_record, signed_fields
from p2p_diloco.swarm.synchronizer import Synchronizer
from p2p_diloco.wire.codecs.codec import encode_tensors
from p2p_diloco.wire.delta_bundle import decode_bundle
from p2p_diloco.wire.delta_signature import DeltaRefusal, sign_delta
from p2p_diloco.wire.frames import decode_update, encode_delta, encode_update
from p2p_diloco.wire.signing import InMemoryKeys

MODEL = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)
MANIFEST = RunManifest(
    run_id="g",
    model=MODEL,
    diloco=DilocoConfig(inner_steps=4, fragments=2, batch_size=2),
    wire=WireConfig(codec="topk-int8", density=0.1, block_size=64),
)
TOKENS = 4 * 2 * MODEL.block_size  # H steps of batch x block: a full, uncapped weight
_template = build_model(MODEL)
SHAPES = {n: tuple(p.shape) for n, p in _template.named_parameters()}
PLAN = plan_fragments(list(SHAPES.items()), 2)
INITIAL = {n: p.detach().clone() for n, p in _template.named_parameters()}


def deltas() -> dict[str, dict[str, torch.Tensor]]:
    """Per learner a, b, c, a delta of fragment 0 that agrees with the others (shared direction + noise)."""
    gen = torch.Generator().manual_seed(0)
    shapes = GlobalReplica(PLAN, INITIAL).shapes(0)
    base = {n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()}
    return {w: {n: t + 2e-3 * torch.randn(t.shape, generator=gen) for n, t in base.items()} for w in "abc"}


def signed_frame(
    keys: InMemoryKeys,
    learner: str,
    tensors: dict[str, torch.Tensor],
    *,
    manifest: RunManifest,
    tokens: int = TOKENS,
) -> bytes:
    """`learner`'s delta of fragment 0 carrying `tokens`, signed as `swarm.outbox` signs it."""
    wire = manifest.wire
    payload = encode_tensors(tensors, codec=wire.codec, block_size=wire.block_size, density=wire.density)
    steps = tokens // (manifest.diloco.batch_size * manifest.model.block_size)
    header = DeltaHeader(manifest.run_id, manifest.manifest_hash, 0, 0, tokens=tokens, steps=steps, seq=1)
    signature = sign_delta(keys.signer(learner), signed_fields(learner, header, payload))
    return encode_delta(dataclasses.replace(header, signature=signature), payload)


def delta(sender: str, tokens: int, seq: int = 1) -> Contribution:
    return Contribution(sender, 0, tokens, 1, 0.0, None, seq=seq)


def full(_: str) -> float:
    return 1.0


def same_wait(_: str) -> float:
    return 0.0


def test_the_longest_waiting_learners_are_listed_and_the_rest_left_out():
    waits = {"a": 5.0, "b": 1.0, "c": 3.0, "d": 9.0}.__getitem__  # when each was last merged
    round_ = [delta("a", 100), delta("b", 100), delta("c", 400), delta("d", 300)]
    chosen = choose(round_, 2, waiting_since=waits, ramp=full, fragment=0, version=7)
    assert [d.sender for d in chosen.listed] == ["b", "c"]
    assert [d.sender for d in chosen.left_out] == ["a", "d"]
    everything = choose(round_, 4, waiting_since=waits, ramp=full, fragment=0, version=7)
    assert len(everything.listed) == 4 and everything.left_out == ()
    assert choose(round_, 20, waiting_since=waits, ramp=full, fragment=0, version=7).left_out == ()
    with pytest.raises(ValueError, match="gather must be >= 1"):
        choose(round_, 0, waiting_since=waits, ramp=full, fragment=0, version=7)


def test_on_an_equal_wait_the_greater_merge_weight_with_standing_comes_first():
    ramp = {"old": 1.0, "new": 0.25}.__getitem__
    order = gather_order(
        [delta("new", 300), delta("old", 100)], waiting_since=same_wait, ramp=ramp, fragment=0, version=0
    )
    assert [d.sender for d in order] == ["old", "new"]  # 100 x 1 > 300 x 0.25
    order = gather_order(
        [delta("new", 500), delta("old", 100)], waiting_since=same_wait, ramp=ramp, fragment=0, version=0
    )
    assert order[0].sender == "new"


def test_equal_waits_and_weights_break_by_a_per_round_digest_that_rotates():
    learners = [f"L{i}" for i in range(8)]
    round_ = [delta(who, 100) for who in learners]
    firsts = set()
    for version in range(12):
        order = gather_order(round_, waiting_since=same_wait, ramp=full, fragment=1, version=version)
        assert [d.sender for d in order] == sorted(learners, key=lambda w: tie_rank(1, version, w))
        assert order == gather_order(
            list(reversed(round_)), waiting_since=same_wait, ramp=full, fragment=1, version=version
        )
        firsts.add(order[0].sender)
    assert len(firsts) > 2  # no key wins every tie


def test_a_learner_waits_from_its_last_merge_of_the_fragment_or_else_from_when_it_was_first_heard():
    standing = Standing(new_peer_rounds=4, active_window=60.0, newcomer_grace=30.0)
    standing.heard(["a", "b"], 1.0)
    standing.note_merged(["a"], 5.0, fragment=0)
    standing.note_merged(["a", "b"], 6.0, fragment=1)
    assert standing.waiting_since("a", 0, 9.0) == 5.0  # per fragment: a merge of fragment 1 does not count
    assert standing.waiting_since("b", 0, 9.0) == 1.0
    assert standing.waiting_since("b", 1, 9.0) == 6.0
    assert standing.waiting_since("never", 0, 9.0) == 9.0


def test_gather_is_a_validated_knob_that_keeps_hashes_at_its_default():
    assert DilocoConfig().gather == 20
    base = RunManifest(run_id="g")
    assert dataclasses.replace(base, diloco=dataclasses.replace(base.diloco, gather=20)).manifest_hash == (
        base.manifest_hash
    )
    assert dataclasses.replace(base, diloco=dataclasses.replace(base.diloco, gather=4)).manifest_hash != (
        base.manifest_hash
    )
    for bad in (0, 257):
        with pytest.raises(ConfigError, match=r"\[diloco\] gather"):
            DilocoConfig(gather=bad)


def with_gather(manifest: RunManifest, gather: int) -> RunManifest:
    return dataclasses.replace(manifest, diloco=dataclasses.replace(manifest.diloco, gather=gather))


def round_of_three(manifest: RunManifest, keys: InMemoryKeys, tokens: dict[str, int] | None = None):  # noqa: ANN201
    """A synchronizer that took one delta of fragment 0 from a, b and c and closed the round."""
    sync = Synchronizer("me", manifest, PLAN, GlobalReplica(PLAN, INITIAL), term=1, shapes=SHAPES, check=keys)
    for who, tensors in deltas().items():
        frame = signed_frame(keys, who, tensors, manifest=manifest, tokens=(tokens or {}).get(who, TOKENS))
        assert sync.offer_delta(who, frame, 0.0).ok
    (outcome,) = sync.poll(10.0, frozenset("abc"), cap=0.0)
    return sync, outcome


def test_a_sparse_round_over_gather_lists_gather_and_names_the_rest():
    keys = InMemoryKeys()
    manifest = with_gather(MANIFEST, 2)
    sync, outcome = round_of_three(manifest, keys, tokens={"a": TOKENS // 2})  # a carries the least work
    record = decode_update(encode_update(outcome.record), max_bytes=1 << 24)
    assert record == outcome.record
    assert [d.learner for d in record.deltas] == ["b", "c"]
    assert len(decode_bundle(record.payload, max_bytes=1 << 24)) == 2
    assert (
        record.left_out == (("a", 1),) and record.left_out_seq("a") == 1 and record.left_out_seq("b") is None
    )
    assert record.live == 2  # outer scaling: a round listing `gather` deltas is a full one (min(3, 2))
    assert sync.left_out == {"a": 1}
    assert not sync.rejections and sync.guard.cooling(10.0) == frozenset()  # not an offence
    assert any(GatherTag.NOT_GATHERED in line for line in sync.decisions)
    grad = open_record(record, keys, manifest, sync.replica.shapes(0))  # a replica merges the same two
    assert isinstance(grad, dict)
    assert all(grad[n].equal(outcome.outer_grad[n]) for n in grad)


def test_replicas_refuse_a_record_over_gather_or_naming_a_listed_learner_left_out():
    keys = InMemoryKeys()
    sync, outcome = round_of_three(MANIFEST, keys)  # gather 20: all three listed
    record = outcome.record
    shapes = sync.replica.shapes(0)
    assert record.left_out == () and len(record.deltas) == 3
    assert open_record(record, keys, with_gather(MANIFEST, 2), shapes)[0] == UpdateTag.TOO_LARGE
    both = dataclasses.replace(record, left_out=(("b", 1),))
    assert open_record(both, keys, MANIFEST, shapes)[0] == DeltaRefusal.WRONG_DELTA


def test_dense_rounds_merge_every_screened_delta_whatever_gather():
    keys = InMemoryKeys()
    dense = with_gather(
        dataclasses.replace(MANIFEST, wire=dataclasses.replace(MANIFEST.wire, codec="int8")), 1
    )
    sync = Synchronizer("me", dense, PLAN, GlobalReplica(PLAN, INITIAL), term=1, shapes=SHAPES, check=keys)
    for who, tensors in deltas().items():
        frame = signed_frame(keys, who, tensors, manifest=dense)
        assert sync.offer_delta(who, frame, 0.0).ok
    (outcome,) = sync.poll(10.0, frozenset("abc"), cap=0.0)
    assert [who for who, _ in outcome.record.contributors] == ["a", "b", "c"]
    assert outcome.record.left_out == () and not outcome.record.deltas
