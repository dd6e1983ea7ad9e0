"""An update's int8 gradient stays int8 on the apply path (#14 item 5): `decode_tensors(lazy=True)` in
`UpdateBook.apply` and the synchronizer. What reads the gradient besides the outer step must then see the
values decoding would give, a chunk at a time: `kernels.float_chunks`, the norms, `UpdateChecks.check_values`
and `RobustGuard.observe_update` (whose running reference must be the same bits as from decoded values)."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from p2p_diloco.model.gpt import build_model
from p2p_diloco.protocol import kernels
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.kernels import CHUNK, QuantizedTensor
from p2p_diloco.protocol.messages import DeltaHeader, UpdateTag
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.robust import RobustGuard, fragment_norm
from p2p_diloco.protocol.sync_round import Contribution
from p2p_diloco.swarm import updates as uc
from p2p_diloco.swarm.merging import dense
from p2p_diloco.swarm.synchronizer import Synchronizer
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import encode_delta
from tests.support.manifests import tiny_manifest

MANIFEST = tiny_manifest("lazy")


def fresh_synchronizer() -> Synchronizer:
    """The holder of term 1 over a fresh replica of the tiny model."""
    template = build_model(MANIFEST.model)
    shapes = {n: tuple(p.shape) for n, p in template.named_parameters()}
    plan = plan_fragments(list(shapes.items()), MANIFEST.diloco.fragments)
    replica = GlobalReplica(plan, {n: p.detach().clone() for n, p in template.named_parameters()})
    return Synchronizer("me", MANIFEST, plan, replica, term=1, shapes=shapes)


def int8_pair(tensors: dict[str, torch.Tensor], block_size: int = 64) -> tuple[dict, dict]:
    """(lazy, eager) decodings of the int8 frame of `tensors`."""
    frame = encode_tensors(tensors, block_size=block_size)
    return decode_tensors(frame, lazy=True), decode_tensors(frame)


@pytest.mark.parametrize("n", (5, CHUNK, 2 * CHUNK + 77))
def test_float_chunks_of_an_int8_tensor_are_its_decoded_values_in_order(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    lazy, eager = int8_pair({"g": torch.randn(n, generator=gen)})
    assert isinstance(lazy["g"], QuantizedTensor)
    offsets, pieces = zip(*((start, values.clone()) for start, values in kernels.float_chunks(lazy["g"])))
    assert list(offsets) == list(range(0, n, CHUNK))
    assert torch.cat(pieces).numpy().tobytes() == eager["g"].numpy().tobytes()
    # the same chunks, so the same float64 sums, bit for bit; and the float64 formula up to rounding
    assert kernels.sum_squares64(lazy["g"]) == kernels.sum_squares64(eager["g"])
    exact = float(eager["g"].double().square().sum())
    assert kernels.sum_squares64(lazy["g"]) == pytest.approx(exact, rel=1e-12)
    assert fragment_norm(lazy) == pytest.approx(math.sqrt(exact), rel=1e-12)


def test_update_checks_reach_the_same_verdict_on_int8_and_decoded_gradients() -> None:
    checks = uc.UpdateChecks(MANIFEST, 2, RobustGuard.from_manifest(MANIFEST))
    for scale, verdict in ((0.9, None), (100.0, UpdateTag.TOO_LARGE)):
        values = torch.full((3 * CHUNK + 5,), scale * checks.max_rms)
        values[::2] *= -1
        lazy, eager = int8_pair({"w": values})
        found = [checks.check_values(0, grad) for grad in (lazy, eager)]
        assert found[0] == found[1]
        assert (found[0] and found[0][0]) == verdict
    assert checks.check_values(0, {"w": torch.tensor([1.0, math.inf])})[0] == UpdateTag.NOT_FINITE


def test_observing_int8_updates_builds_the_reference_decoded_values_build_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(7)
    shapes = {"a": (CHUNK + 3,), "b": (4, 5)}
    updates = [{n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()} for _ in range(3)]
    lazy_guard, eager_guard = (RobustGuard.from_manifest(MANIFEST) for _ in range(2))
    decay = lazy_guard.config.reference_decay
    expected: dict[str, torch.Tensor] = {}
    for update in updates:
        lazy, eager = int8_pair(update)
        lazy_guard.observe_update(0, lazy)
        eager_guard.observe_update(0, eager)
        norm = fragment_norm(eager)  # checked against the float64 formula above
        for name, g in eager.items():  # the documented running average, on whole tensors
            unit = g * ((1 - decay) / norm)
            if name in expected:
                unit = expected[name].float() * decay + unit
            expected[name] = unit.to(torch.bfloat16)
    for guard in (lazy_guard, eager_guard):
        reference = guard.direction_reference(0)
        assert reference is not None and set(reference) == set(shapes)
        for name, want in expected.items():
            assert reference[name].dtype == torch.bfloat16 and reference[name].shape == want.shape
            assert torch.equal(reference[name], want), name


def test_a_round_keeps_accepted_deltas_int8_and_merges_what_decoding_first_merges() -> None:
    """The synchronizer screens a delta in float32, then its round holds the int8 form; the update it
    publishes is the one the decoded deltas give (same record bytes, same replica)."""
    shapes = fresh_synchronizer().expected[0]
    gen = torch.Generator().manual_seed(11)
    tokens = MANIFEST.diloco.batch_size * MANIFEST.model.block_size * 4

    def frame(seq: int) -> bytes:
        delta = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
        header = DeltaHeader("lazy", MANIFEST.manifest_hash, 0, 0, tokens=tokens, steps=4, seq=seq)
        return encode_delta(header, encode_tensors(delta, block_size=64))

    frames = {"a": frame(1), "b": frame(1)}
    published = []
    for keep_int8 in (True, False):
        sync = fresh_synchronizer()
        for sender, data in frames.items():
            assert sync.offer_delta(sender, data, 0.0).status == "accepted"
        held = [c.payload for c in sync.rounds.round(0).contributions()]
        assert all(isinstance(t, QuantizedTensor) for payload in held for t in payload.values() if t.numel())
        if not keep_int8:  # what the round held before: the decoded tensors
            for c in sync.rounds.round(0).contributions():
                object.__setattr__(c, "payload", dense(c.payload))  # a frozen dataclass, rewritten
        (outcome,) = sync.poll(10.0, frozenset({"a", "b"}), cap=0.0)
        published.append(outcome.record.payload + outcome.record.checksum.encode())
    assert published[0] == published[1]


def test_merging_lets_the_float32_deltas_go_before_the_outer_step() -> None:
    """`Synchronizer._merge` drops the contributions' payloads from the caller's list once merged, so no
    float32 delta is alive while the outer step allocates the new fragment."""
    sync = fresh_synchronizer()
    payloads = [{n: torch.full(s, 1e-3 * (i + 1)) for n, s in sync.expected[0].items()} for i in range(2)]
    watched = [weakref.ref(t) for payload in payloads for t in payload.values()]
    contributions = [
        Contribution(sender, 0, tokens=64, steps=4, received_at=0.0, payload=payload)
        for sender, payload in zip("ba", payloads)
    ]
    del payloads
    record, pending, _ = sync.merger.merge(0, contributions, live=2, term=sync.term)
    gc.collect()
    assert [c.sender for c in contributions] == ["a", "b"] and all(c.payload is None for c in contributions)
    assert all(ref() is None for ref in watched)
    assert record.checksum == pending.checksum and [s for s, _ in record.contributors] == ["a", "b"]
