"""Chunked top-k frames in SparseLoCo's layout ("topk4k-int2/-int4/-int8"): round trips, 12-bit and code
packing, the 2-bit levels, strict decoding of hostile bodies, `decode_sparse`, and the codec-dependent
feedback decay of `[wire]`."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.config import RunManifest, WireConfig
from p2p_diloco.errors import DecodeError
from p2p_diloco.wire.codecs import chunked, codec
from p2p_diloco.wire.codecs.bitpack import PackReason, pack12, pack_codes, unpack12, unpack_codes
from p2p_diloco.wire.codecs.chunked import CHUNK
from p2p_diloco.wire.codecs.codec import decode_sparse, decode_tensors, encode_tensors, frame_size
from p2p_diloco.wire.codecs.feedback import ErrorFeedback
from p2p_diloco.wire.codecs.levels import fit_levels
from p2p_diloco.wire.codecs.sparse import SparseReason, chunk_keep

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHUNKED = ["topk4k-int2", "topk4k-int4", "topk4k-int8"]
IDS = {"topk4k-int2": 5, "topk4k-int4": 6, "topk4k-int8": 7}


def _frame(shape: tuple[int, ...], body: bytes, codec_id: int, block: int = 64) -> bytes:
    """A chunked frame of one tensor "w" of `shape`: no names, the digest of {"w": shape}, then `body`."""
    head = codec.MAGIC + struct.pack("<BBI", 1, codec_id, 1) + struct.pack("<I", block)
    return head + chunked.table_digest({"w": shape}) + body


def _int2_body(keep_full: int, offsets, levels, codes) -> bytes:
    return (
        struct.pack("<H", keep_full)
        + pack12(np.asarray(offsets))
        + np.asarray(levels, "<f4").tobytes()
        + pack_codes(np.asarray(codes, np.uint8), 2)
    )


def _reason(data: bytes, shape: tuple[int, ...]) -> str:
    with pytest.raises(DecodeError) as info:
        decode_tensors(data, expected_shapes={"w": shape}, max_bytes=1 << 24)
    return info.value.reason


@pytest.mark.parametrize("name", CHUNKED)
@pytest.mark.parametrize("density", [0.01, 0.03, 0.1, 1.0])
def test_round_trip_keeps_the_top_entries_of_each_4096_chunk(name, density):
    gen = torch.Generator().manual_seed(5)
    tensors = {
        "big": torch.randn(3 * CHUNK + 1000, generator=gen),  # three full chunks and a short one
        "mat": torch.randn(64, 64, generator=gen) * 1e-3,  # exactly one chunk
        "tiny": torch.randn(3, generator=gen),
        "empty": torch.zeros(0, 4),
    }
    frame = encode_tensors(tensors, codec=name, block_size=256, density=density)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    assert len(frame) == frame_size(shapes, codec=name, block_size=256, density=density)
    assert codec.frame_codec(frame) == name
    out = decode_tensors(frame, expected_shapes=shapes)
    sparse = decode_sparse(frame, expected_shapes=shapes)
    assert list(out) == list(sparse) == list(tensors)
    for n, t in tensors.items():
        flat, got = t.reshape(-1), out[n].reshape(-1)
        assert got.dtype == torch.float32 and torch.equal(sparse[n].to_dense().reshape(-1), got)
        sent = set(sparse[n].indices.tolist())
        keep_full = chunk_keep(CHUNK, density)
        keeps = [
            keep_full if s + CHUNK <= flat.numel() else chunked.short_keep(flat.numel() - s, keep_full)
            for s in range(0, flat.numel(), CHUNK)
        ]
        assert len(sent) == sum(keeps)
        for start, keep in zip(range(0, flat.numel(), CHUNK), keeps):
            chunk = flat[start : start + CHUNK]
            top = {start + int(i) for i in torch.topk(chunk.abs(), keep).indices}
            assert {i for i in sent if start <= i < start + CHUNK} == top
        if sent:
            kept = sparse[n].indices
            err = float((got[kept] - flat[kept]).norm() / flat[kept].norm())
            assert err < {"topk4k-int2": 0.35, "topk4k-int4": 0.15, "topk4k-int8": 0.02}[name]
            assert bool(torch.all(got[kept] * flat[kept] >= 0))  # signs kept


def test_sizes_match_sparseloco_budget():
    x = {"w": torch.randn(64 * CHUNK, generator=torch.Generator().manual_seed(1))}
    sizes = {c: len(encode_tensors(x, codec=c, density=0.03)) / x["w"].numel() for c in CHUNKED}
    # 123 of 4096 kept (3.0 %): 12-bit offsets + 2, 4, 8-bit values = 1.75, 2, 2.5 bytes a kept entry
    for name, per_kept in (("topk4k-int2", 1.75), ("topk4k-int4", 2.0), ("topk4k-int8", 2.5)):
        assert sizes[name] == pytest.approx(123 / 4096 * per_kept, rel=0.02)
    assert (
        sizes["topk4k-int2"] < 0.054 < len(encode_tensors(x, codec="topk-int4", density=0.03)) / (64 * CHUNK)
    )


@pytest.mark.parametrize("name", CHUNKED)
def test_decoding_is_deterministic_and_non_finite_is_refused(name):
    x = {"w": torch.randn(5000, generator=torch.Generator().manual_seed(2))}
    frame = encode_tensors(x, codec=name, density=0.05)
    w = {"w": (5000,)}
    a, b = (
        decode_tensors(frame, expected_shapes=w)["w"],
        decode_tensors(bytearray(frame), expected_shapes=w)["w"],
    )
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    zeros = encode_tensors({"z": torch.zeros(100)}, codec=name, density=0.1)
    assert float(decode_tensors(zeros, expected_shapes={"z": (100,)})["z"].abs().sum()) == 0
    for bad in (float("nan"), float("inf")):
        t = torch.randn(100)
        t[5] = bad
        assert _reason(encode_tensors({"w": t}, codec=name, density=0.5), (100,)) == "non-finite"


@FAST
@given(values=st.lists(st.integers(0, 4095), max_size=41))
def test_12_bit_packing_round_trips_and_sizes(values):
    packed = pack12(np.asarray(values, dtype=np.int64))
    assert len(packed) == math.ceil(1.5 * len(values))
    assert unpack12(memoryview(packed), 0, len(values), "x").tolist() == values


@FAST
@given(bits=st.sampled_from([2, 4, 8]), data=st.data())
def test_code_packing_round_trips(bits, data):
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=33))
    packed = pack_codes(np.asarray(codes, dtype=np.uint8), bits)
    assert len(packed) == math.ceil(len(codes) * bits / 8)
    assert unpack_codes(memoryview(packed), 0, len(codes), bits, "x").tolist() == codes


def test_padding_bits_must_be_zero():
    with pytest.raises(DecodeError) as info:
        unpack12(memoryview(bytes([0x01, 0x10])), 0, 1, "x")  # one offset: high nibble of byte 2 is padding
    assert info.value.reason == PackReason.BAD_PADDING
    with pytest.raises(DecodeError) as info:
        unpack_codes(memoryview(bytes([0b01_000000])), 0, 3, 2, "x")  # 3 codes: bits 6-7 are padding
    assert info.value.reason == PackReason.BAD_PADDING
    with pytest.raises(ValueError):
        pack12(np.asarray([4096]))


def test_levels_minimize_the_squared_error():
    mags = torch.tensor([[1.0, 1.1, 0.9, 5.0, 5.2], [2.0, 2.0, 2.0, 2.0, 2.0]])
    levels = fit_levels(mags, 2)
    assert levels.tolist() == [pytest.approx([1.0, 5.1]), pytest.approx([2.0, 2.0])]
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(4, 257, generator=gen).abs() + 2.0  # top-k magnitudes: none near zero
    one_level = float(((m - m.mean(dim=1, keepdim=True)) ** 2).sum())
    errors = []
    for count in (2, 8):
        levels = fit_levels(m, count)
        assert bool((torch.diff(levels, dim=1) >= 0).all())
        nearest = levels.gather(1, (m.double()[:, :, None] - levels[:, None, :]).abs().argmin(dim=2))
        errors.append(float(((m - nearest) ** 2).sum()))
    assert errors[1] < 0.15 * errors[0] and errors[0] < 0.4 * one_level


@pytest.mark.parametrize(
    ("name", "bound"), [("topk4k-int2", 0.3), ("topk4k-int4", 0.05), ("topk4k-int8", 0.02)]
)
def test_heavy_tails_cost_the_bulk_no_precision(name, bound):
    # Student-t (df 3): a block's absmax is far above its typical kept value; levels follow the bulk
    gen = torch.Generator().manual_seed(0)
    x = (
        torch.randn(8 * CHUNK, generator=gen)
        / (torch.randn(3, 8 * CHUNK, generator=gen).pow(2).mean(0)).sqrt()
    )
    got = decode_sparse(encode_tensors({"w": x}, codec=name, density=0.03), expected_shapes={"w": x.shape})[
        "w"
    ]
    sent = x[got.indices]
    assert float(((got.values - sent).abs() / sent.abs()).median()) < bound


def test_hostile_bodies_get_specific_reasons():
    shape, name = (10,), "topk4k-int2"  # a short chunk of 10: keep_full 3000 keeps ceil(3000 x 10 / 4096) = 8
    assert chunked.short_keep(10, 820) == 3 and chunked.short_keep(10, 1) == 1
    ok = _int2_body(820, [3, 7, 8], [1.0, 2.0], [0, 3, 1])
    out = decode_tensors(_frame(shape, ok, IDS[name]), expected_shapes={"w": shape})["w"]
    assert out.tolist() == [0, 0, 0, 1.0, 0, 0, 0, -2.0, 2.0, 0]
    for body, reason in [
        (_int2_body(0, [], [], []), SparseReason.BAD_COUNT),  # keeps nothing
        (_int2_body(4097, [0] * 10, [1.0, 2.0], [0] * 10), SparseReason.BAD_COUNT),  # more than a chunk
        (_int2_body(820, [7, 3, 8], [1.0, 2.0], [0, 3, 1]), SparseReason.BAD_INDEX),  # decreasing
        (_int2_body(820, [3, 3, 8], [1.0, 2.0], [0, 3, 1]), SparseReason.BAD_INDEX),  # repeated
        (_int2_body(820, [3, 7, 10], [1.0, 2.0], [0, 3, 1]), SparseReason.BAD_INDEX),  # past the tensor
        (_int2_body(820, [3, 7, 8], [2.0, 1.0], [0, 3, 1]), codec.BAD_HEADER),  # levels decreasing
        (_int2_body(820, [3, 7, 8], [-1.0, 2.0], [0, 3, 1]), codec.BAD_HEADER),  # negative level
        (_int2_body(820, [3, 7, 8], [1.0, float("inf")], [0, 3, 1]), codec.NON_FINITE),
        (ok[:-1] + bytes([ok[-1] | 0b1100_0000]), PackReason.BAD_PADDING),  # a 4th code in a 3-code byte
        (ok[:-1], codec.TRUNCATED),
        (ok + b"\x00", codec.TRAILING_BYTES),
        (
            struct.pack("<H", 820) + pack12(np.asarray([3, 7])) + bytes([0x08, 0x10]) + ok[-9:],
            PackReason.BAD_PADDING,
        ),
    ]:
        assert _reason(_frame(shape, body, IDS[name]), shape) == reason, body


def test_full_chunks_are_checked_one_by_one():
    shape = (2 * CHUNK,)  # two full chunks, 2 kept of each: offsets increase within a chunk, restart after
    levels = [0.5, 1.0]
    body = _int2_body(2, [5, 9, 1, 4095], levels, [0, 1, 2, 3])
    got = decode_sparse(_frame(shape, body, 5), expected_shapes={"w": shape})["w"]
    assert got.indices.tolist() == [5, 9, CHUNK + 1, CHUNK + 4095]
    assert got.values.tolist() == [0.5, 1.0, -0.5, -1.0]
    bad = _int2_body(2, [5, 9, 4, 1], levels, [0, 0, 0, 0])  # the second chunk decreases
    assert _reason(_frame(shape, bad, 5), shape) == SparseReason.BAD_INDEX
    huge = _frame((CHUNK * 10**6,), struct.pack("<H", 4096), 5)  # 4G kept in a tiny frame
    assert _reason(huge, (CHUNK * 10**6,)) in ("truncated", "oversized")


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=300), codec_id=st.sampled_from([5, 6, 7]), numel=st.integers(0, 9000))
def test_garbage_bodies_only_raise_decode_error(data, codec_id, numel):
    frame = _frame((numel,), data, codec_id)
    try:
        out = decode_sparse(frame, expected_shapes={"w": (numel,)}, max_bytes=1 << 20)
    except DecodeError:
        return
    t = out["w"]
    assert bool(torch.isfinite(t.values).all()) and bool((t.indices[1:] > t.indices[:-1]).all())
    dense = decode_tensors(frame, expected_shapes={"w": (numel,)})["w"]
    assert torch.equal(dense.reshape(-1), t.to_dense().reshape(-1))


@FAST
@given(seed=st.integers(0, 2**31), cut=st.integers(0, 10_000), flip=st.integers(0, 255))
def test_mutated_valid_frames_only_raise_decode_error(seed, cut, flip):
    gen = torch.Generator().manual_seed(seed)
    name = CHUNKED[seed % 3]
    frame = bytearray(encode_tensors({"w": torch.randn(CHUNK + 77, generator=gen)}, codec=name, density=0.02))
    frame[cut % len(frame)] ^= flip
    try:
        out = decode_tensors(bytes(frame), expected_shapes={"w": (CHUNK + 77,)}, max_bytes=1 << 20)
    except DecodeError:
        return
    assert all(bool(torch.isfinite(t).all()) for t in out.values())


@pytest.mark.parametrize("name", CHUNKED)
def test_frames_name_no_tensors_and_only_the_expected_table_decodes(name):
    tensors = {"b": torch.randn(300), "a": torch.randn(2, 2100), "c": torch.randn(64)}
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    frame = encode_tensors(tensors, codec=name, density=0.05)
    bodies = sum(len(encode_tensors({n: t}, codec=name, density=0.05)) - 22 for n, t in tensors.items())
    # magic, head, block size, digest and keep count once: nothing per tensor but its kept entries and scales
    assert len(frame) == frame_size(shapes, codec=name, density=0.05) <= 22 + bodies - 2 * 2
    out = decode_tensors(frame, expected_shapes=shapes)
    assert list(out) == list(shapes)  # in the caller's order (bodies travel in name order)
    alone = decode_tensors(
        encode_tensors({"a": tensors["a"]}, codec=name, density=0.05), expected_shapes={"a": (2, 2100)}
    )
    assert torch.equal(out["a"], alone["a"])
    for expected, reason in [
        (None, codec.BAD_HEADER),  # nothing to decode it by
        ({**shapes, "d": (4,)}, codec.MISSING_TENSOR),
        ({"a": (2, 2100), "b": (300,)}, codec.UNEXPECTED_TENSOR),
        ({**shapes, "c": (65,)}, codec.WRONG_SHAPE),  # a shape differs
        ({"a": (2, 2100), "b": (300,), "e": (64,)}, codec.WRONG_SHAPE),  # a name differs
    ]:
        with pytest.raises(DecodeError) as info:
            decode_tensors(frame, expected_shapes=expected)
        assert info.value.reason == reason, expected
    bad_block = bytearray(frame)
    bad_block[10:14] = struct.pack("<I", 100)
    with pytest.raises(DecodeError) as info:
        decode_tensors(bytes(bad_block), expected_shapes=shapes)
    assert info.value.reason == codec.BAD_HEADER


def test_decode_sparse_refuses_dense_frames():
    with pytest.raises(DecodeError) as info:
        decode_sparse(encode_tensors({"w": torch.randn(10)}))
    assert info.value.reason == codec.UNKNOWN_CODEC


@pytest.mark.parametrize("name", CHUNKED)
def test_error_feedback_residual_is_what_was_not_delivered(name):
    gen = torch.Generator().manual_seed(9)
    feedback = ErrorFeedback(name, 64, density=0.05, decay=None)
    assert feedback.decay == 0.95
    residual = torch.zeros(5000)
    for _ in range(3):
        delta = torch.randn(5000, generator=gen)
        frame, decoded = feedback.compress(0, {"w": delta})
        assert torch.equal(decode_tensors(frame, expected_shapes={"w": (5000,)})["w"], decoded["w"])
        corrected = delta + residual * 0.95
        residual = feedback._residuals[0]["w"]
        assert torch.allclose(residual, corrected - decoded["w"], atol=1e-6)


def test_feedback_decay_defaults_by_codec_and_dense_hashes_stay():
    assert WireConfig().feedback_decay == 1.0 and WireConfig(codec="fp32").feedback_decay == 1.0
    for name in [*CHUNKED, "topk-int8", "topk-int4"]:
        assert WireConfig(codec=name).feedback_decay == 0.95
        assert WireConfig(codec=name, feedback_decay=1.0).feedback_decay == 1.0
    explicit = RunManifest.from_dict({"run_id": "x", "wire": {"codec": "int8", "feedback_decay": 1.0}})
    assert explicit.manifest_hash == RunManifest(run_id="x").manifest_hash  # dense default is 1.0, as before
    sparse = RunManifest.from_dict({"run_id": "x", "wire": {"codec": "topk4k-int2"}})
    assert sparse.wire.feedback_decay == 0.95 and "0.95" in str(sparse.to_dict()["wire"])
    assert ErrorFeedback("topk4k-int2", 64).decay == 1.0  # the class keeps its explicit default
