"""Sparse top-k frames ("topk-int8", "topk-int4"): round trips, error feedback, strict decoding, config.
The synchronizer's and the replicas' side of sparse rounds: tests/unit/test_sparse_rounds.py."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.config import RunManifest, WireConfig
from p2p_diloco.errors import ConfigError, DecodeError
from p2p_diloco.wire.codecs import codec
from p2p_diloco.wire.codecs.blockwise import Codec
from p2p_diloco.wire.codecs.codec import CODE_TABLE, decode_tensors, encode_tensors, frame_size
from p2p_diloco.wire.codecs.feedback import ErrorFeedback
from p2p_diloco.wire.codecs.sparse import CHUNK, INT4_TABLE, SparseReason, chunk_keep

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPARSE = ["topk-int8", "topk-int4"]
IDS = {"topk-int8": 3, "topk-int4": 4}
GAP = {"topk-int8": float(torch.diff(CODE_TABLE).max()), "topk-int4": float(torch.diff(INT4_TABLE).max())}


def _frame(entries: list[bytes], codec_id: int) -> bytes:
    return codec.MAGIC + struct.pack("<BBI", 1, codec_id, len(entries)) + b"".join(entries)


def _entry(shape: tuple[int, ...], block: int, body: bytes, name: bytes = b"w") -> bytes:
    head = struct.pack("<H", len(name)) + name + struct.pack("<BB", 1, len(shape))
    return head + struct.pack(f"<{len(shape)}Q", *shape) + struct.pack("<I", block) + body


def _body(counts, offsets, absmax, codes: bytes) -> bytes:
    return (
        np.asarray(counts, "<u4").tobytes()
        + np.asarray(offsets, "<u2").tobytes()
        + np.asarray(absmax, "<f4").tobytes()
        + codes
    )


def _reason(data: bytes) -> str:
    with pytest.raises(DecodeError) as info:
        decode_tensors(data, max_bytes=1 << 24)
    return info.value.reason


@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("density", [0.01, 0.03, 0.1, 1.0])
def test_round_trip_keeps_the_top_entries_of_each_chunk(name, density):
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "big": torch.randn(2 * CHUNK + 1000, generator=gen),  # two full chunks and a short one
        "mat": torch.randn(33, 17, generator=gen) * 1e-3,
        "tiny": torch.randn(3, generator=gen),
        "empty": torch.zeros(0, 4),
    }
    frame = encode_tensors(tensors, codec=name, block_size=256, density=density)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    assert len(frame) == frame_size(shapes, codec=name, block_size=256, density=density)
    out = decode_tensors(frame, expected_shapes=shapes)
    assert list(out) == list(tensors)
    for n, t in tensors.items():
        flat, got = t.reshape(-1), out[n].reshape(-1)
        assert got.shape == flat.shape and got.dtype == torch.float32
        for start in range(0, flat.numel(), CHUNK):
            chunk, dec = flat[start : start + CHUNK], got[start : start + CHUNK]
            keep = chunk_keep(chunk.numel(), density)
            kept = torch.topk(chunk.abs(), keep).indices
            assert set(dec.nonzero().reshape(-1).tolist()) <= set(kept.tolist())
            # each kept value within one gap of the code table times its block's absmax
            bound = GAP[name] * float(chunk.abs().max()) + 1e-6
            assert float((dec[kept] - chunk[kept]).abs().max()) <= bound
            assert bool(torch.all(dec[kept] * chunk[kept] >= 0))  # signs kept


def test_sparse_frames_are_small_and_decoding_is_deterministic():
    x = {"w": torch.randn(4 * CHUNK, generator=torch.Generator().manual_seed(1))}
    dense = len(encode_tensors(x))
    sparse = encode_tensors(x, codec="topk-int8", density=0.03)
    int4 = encode_tensors(x, codec="topk-int4", density=0.03)
    assert len(sparse) / x["w"].numel() < 0.095 and len(int4) / x["w"].numel() < 0.08
    assert len(sparse) < dense / 10
    a, b = decode_tensors(sparse)["w"], decode_tensors(bytes(sparse))["w"]
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_all_zero_and_non_finite_tensors():
    out = decode_tensors(encode_tensors({"z": torch.zeros(100)}, codec="topk-int4", density=0.1))
    assert float(out["z"].abs().sum()) == 0.0
    for bad in (float("nan"), float("inf")):
        t = torch.randn(100)
        t[5] = bad
        assert _reason(encode_tensors({"w": t}, codec="topk-int8", density=0.5)) == "non-finite"


@pytest.mark.parametrize("name", SPARSE)
@FAST
@given(seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 8), density=st.sampled_from([0.01, 0.05, 0.2]))
def test_error_feedback_residual_is_exactly_what_was_not_delivered(name, seed, rounds, density):
    gen = torch.Generator().manual_seed(seed)
    feedback = ErrorFeedback(name, 64, density=density)
    true_sum = torch.zeros(300, dtype=torch.float64)
    sent_sum = torch.zeros(300, dtype=torch.float64)
    for _ in range(rounds):
        delta = torch.randn(300, generator=gen)
        residual_before = feedback._residuals.get(0, {"w": torch.zeros(300)})["w"]
        frame, decoded = feedback.compress(0, {"w": delta})
        assert torch.equal(decode_tensors(frame)["w"], decoded["w"])
        # residual = error-fed delta minus what was sent
        assert torch.equal(feedback._residuals[0]["w"], (delta + residual_before) - decoded["w"])
        true_sum += delta.double()
        sent_sum += decoded["w"].double()
    residual = feedback._residuals[0]["w"].double()
    assert torch.allclose(true_sum, sent_sum + residual, atol=1e-4)
    assert feedback.residual_norm(0) == pytest.approx(float(residual.norm()), rel=1e-6)


def test_error_feedback_eventually_delivers_entries_left_out():
    feedback = ErrorFeedback("topk-int8", 64, density=0.1)
    delta = {"w": torch.linspace(1.0, 0.1, 100)}  # always the same ranking: small entries wait
    delivered = torch.zeros(100)
    for _ in range(200):  # the 0.1 entry waits until its residual reaches ~ sum / k = 5.5
        delivered += feedback.compress(0, delta)[1]["w"]
    assert bool((delivered != 0).all())  # every entry got through at least once


def test_error_feedback_decay_fades_the_residual_before_the_next_delta():
    gen = torch.Generator().manual_seed(5)
    faded, kept = (ErrorFeedback("topk-int8", 64, density=0.05, decay=d) for d in (0.5, 1.0))
    first = {"w": torch.randn(200, generator=gen)}
    for feedback in (faded, kept):
        feedback.compress(0, first)
    residual = faded._residuals[0]["w"].clone()
    second = {"w": torch.randn(200, generator=gen)}
    _, decoded = faded.compress(0, second)
    assert torch.equal(faded._residuals[0]["w"], (second["w"] + residual * 0.5) - decoded["w"])
    _, decoded_kept = kept.compress(0, second)
    assert not torch.equal(decoded["w"], decoded_kept["w"])  # the faded residual changed what went out
    with pytest.raises(ValueError, match="decay must be in"):
        ErrorFeedback("topk-int8", 64, decay=0.0)


def test_well_formed_hand_built_frame_decodes():
    codes8 = bytes([255, 0])  # the largest and smallest codes of CODE_TABLE
    out = decode_tensors(_frame([_entry((10,), 64, _body([2], [1, 7], [2.0], codes8))], 3))["w"]
    low = float(CODE_TABLE[0] * 2.0)
    assert out.tolist() == [0, 2.0, 0, 0, 0, 0, 0, low, 0, 0]
    codes4 = bytes([0x0F, 0x07])  # codes 15 (+1), 0 (-1), then 7 (-1/8) with a zero high nibble
    out = decode_tensors(_frame([_entry((5,), 64, _body([3], [0, 2, 4], [8.0], codes4))], 4))["w"]
    assert out.tolist() == [8.0, 0, -8.0, 0, -1.0]


@pytest.mark.parametrize(
    "codec_id, shape, block, body, reason",
    [
        # a chunk claims more entries than it has
        (3, (4,), 64, _body([5], [0, 1, 2, 3, 3], [1.0], bytes(5)), SparseReason.BAD_COUNT),
        (3, (CHUNK + 4,), 64, _body([1, 5], [0], [], b""), SparseReason.BAD_COUNT),
        # offsets out of the last (short) chunk, decreasing, repeated
        (3, (4,), 64, _body([1], [4], [1.0], bytes(1)), SparseReason.BAD_INDEX),
        (3, (CHUNK + 4,), 64, _body([1, 1], [9, 4], [1.0], bytes(2)), SparseReason.BAD_INDEX),
        (3, (10,), 64, _body([2], [5, 3], [1.0], bytes(2)), SparseReason.BAD_INDEX),
        (3, (10,), 64, _body([2], [3, 3], [1.0], bytes(2)), SparseReason.BAD_INDEX),
        # 4-bit padding nibble of an odd count
        (4, (10,), 64, _body([1], [3], [1.0], bytes([0x10])), SparseReason.BAD_PADDING),
        # absmax not finite, negative
        (3, (10,), 64, _body([1], [3], [float("nan")], bytes(1)), "non-finite"),
        (3, (10,), 64, _body([1], [3], [-1.0], bytes(1)), "bad header"),
        # a block size the format does not know
        (3, (10,), 100, _body([1], [3], [1.0], bytes(1)), "bad header"),
        (4, (10,), 0, _body([1], [3], [1.0], bytes(1)), "bad header"),
        # sizes: too short for the counts' claims, bytes left over
        (3, (10,), 64, _body([2], [3, 4], [1.0], bytes(1)), "truncated"),
        (4, (10,), 64, _body([3], [3, 4, 5], [1.0], bytes(1)), "truncated"),
        (3, (10,), 64, _body([1], [3], [1.0], bytes(2)), "trailing bytes"),
        (3, (CHUNK * 3,), 64, _body([1, 1], [], [], b""), "truncated"),
    ],
)
def test_malformed_sparse_bodies_are_rejected_with_their_reason(codec_id, shape, block, body, reason):
    assert _reason(_frame([_entry(shape, block, body)], codec_id)) == reason


def test_huge_shapes_are_refused_before_listing_their_chunks():
    shape = (2**24, 2**24)  # 2**32 chunks: the counts alone would need 16 GiB
    assert _reason(_frame([_entry(shape, 4096, b"")], 4)) == "oversized"


def test_huge_counts_are_refused_before_allocating():
    shape = (CHUNK * 1000,)
    body = np.full(1000, CHUNK, "<u4").tobytes()  # claims 65.5M kept entries in a tiny frame
    assert _reason(_frame([_entry(shape, 4096, body)], 3)) in ("truncated", "oversized")


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=300), codec_id=st.sampled_from([3, 4]))
def test_garbage_after_a_sparse_header_only_raises_decode_error(data, codec_id):
    try:
        out = decode_tensors(codec.MAGIC + struct.pack("<BBI", 1, codec_id, 1) + data, max_bytes=1 << 20)
    except DecodeError:
        return
    assert all(bool(torch.isfinite(t).all()) for t in out.values())


def test_wire_config_validation_names_the_fix():
    assert WireConfig().codec == Codec.INT8 and WireConfig(codec="topk-int4").codec.sparse
    for kwargs, words in [
        ({"codec": "topk"}, "[wire] codec = 'topk': must be one of"),
        ({"codec": "int4"}, "topk-int4"),
        ({"density": 0.0}, "[wire] density = 0.0: must be in (0, 1]"),
        ({"density": 1.5}, "[wire] density = 1.5: must be in (0, 1]"),
        ({"density": "0.1"}, "[wire] density = '0.1' (a string): must be a number"),
        ({"density": True}, "[wire] density = true (a boolean): must be a number"),
        (
            {"codec": "topk-int8", "error_feedback": False},
            "[wire] error_feedback = false: codec = 'topk-int8' needs error_feedback = true",
        ),
        ({"feedback_decay": 0.0}, "[wire] feedback_decay = 0.0: must be in (0, 1]"),
        ({"feedback_decay": 1.5}, "[wire] feedback_decay = 1.5: must be in (0, 1]"),
        ({"feedback_decay": True}, "[wire] feedback_decay = true (a boolean): must be a number"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            WireConfig(**kwargs)
    with pytest.raises(ConfigError, match=re.escape("[wire] density = -1: must be in (0, 1]")):
        RunManifest.from_dict({"run_id": "x", "wire": {"codec": "topk-int8", "density": -1}})
    m = RunManifest.from_dict({"run_id": "x", "wire": {"codec": "topk-int8", "density": 0.05}})
    assert m.wire.codec == Codec.TOPK_INT8 and m.manifest_hash != RunManifest(run_id="x").manifest_hash


def test_encoder_rejects_bad_density_and_block_size():
    for kwargs in ({"density": 0.0}, {"density": 2.0}, {"block_size": 100}):
        with pytest.raises(ValueError):
            encode_tensors({"w": torch.randn(4)}, codec="topk-int8", **kwargs)
    with pytest.raises(ValueError):
        ErrorFeedback("topk-int4", 4096, density=0.0)
    encode_tensors({"w": torch.randn(4)}, codec="int8", density=0.0)  # dense codecs ignore it
