"""Tensor frames: int8/fp32 round trips, deterministic dequantization, error feedback, strict decoding."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.errors import DecodeError
from p2p_diloco.wire.codecs import codec
from p2p_diloco.wire.codecs.codec import (
    CODE_TABLE,
    decode_tensors,
    encode_tensors,
    frame_size,
)
from p2p_diloco.wire.codecs.feedback import ErrorFeedback
from tests.support.frames import VALID_FRAMES

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# bitsandbytes rounds to one of the two neighbouring codes, so the error is at most one gap of the table.
MAX_GAP = float(torch.diff(CODE_TABLE).max())


def _tensor_frame(
    entries: list[bytes], *, codec_id: int = 1, version: int = 1, count: int | None = None
) -> bytes:
    n = len(entries) if count is None else count
    return codec.MAGIC + struct.pack("<BBI", version, codec_id, n) + b"".join(entries)


def _entry(name: bytes, shape: tuple[int, ...], block: int, body: bytes, dtype_code: int = 1) -> bytes:
    head = struct.pack("<H", len(name)) + name + struct.pack("<BB", dtype_code, len(shape))
    return head + struct.pack(f"<{len(shape)}Q", *shape) + struct.pack("<I", block) + body


def _reason(data: bytes, **kwargs) -> str:
    with pytest.raises(DecodeError) as info:
        decode_tensors(data, **kwargs)
    return info.value.reason


def _random_tensors(seed: int, count: int, heavy: bool) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(count):
        shape = tuple(int(d) for d in rng.integers(0, 70, size=rng.integers(0, 4)))
        values = rng.standard_t(2, size=shape) if heavy else rng.normal(size=shape)
        out[f"layer{i}.weight"] = torch.from_numpy(
            np.asarray(values * 10.0 ** rng.integers(-6, 4), np.float32)
        )
    return out


def test_code_table_is_bitsandbytes_default_signed_dynamic_map():
    from bitsandbytes.functional import create_dynamic_map

    reference = create_dynamic_map(signed=True)
    assert CODE_TABLE.dtype == torch.float32 and CODE_TABLE.shape == (256,)
    assert torch.equal(CODE_TABLE.view(torch.int32), reference.view(torch.int32))


def test_dequantization_is_lookup_then_one_float32_multiply():
    x = torch.from_numpy(np.random.default_rng(0).standard_t(3, size=5000).astype(np.float32))
    frame = encode_tensors({"w": x}, block_size=256)
    decoded = decode_tensors(frame)["w"].numpy()
    n_blocks = math.ceil(5000 / 256)
    header = len(codec.MAGIC) + 6 + 2 + 1 + 2 + 8 + 4
    absmax = np.frombuffer(frame, "<f4", n_blocks, header)
    codes = np.frombuffer(frame, np.uint8, 5000, header + 4 * n_blocks)
    expected = CODE_TABLE.numpy()[codes] * np.repeat(absmax, 256)[:5000]  # float32 * float32 in numpy
    assert decoded.tobytes() == expected.astype(np.float32).tobytes()
    assert decode_tensors(frame)["w"].numpy().tobytes() == decoded.tobytes()


def test_decode_agrees_with_bitsandbytes_cpu_dequantize():
    from bitsandbytes.functional import dequantize_blockwise

    from p2p_diloco.wire.codecs.codec import quantize_blockwise_cpu

    x = torch.randn(10_000) * torch.rand(10_000) ** 4
    codes, absmax = quantize_blockwise_cpu(x, 64)
    ours = decode_tensors(encode_tensors({"x": x}, block_size=64))["x"]
    assert torch.equal(ours, dequantize_blockwise(codes, absmax=absmax, code=codec.CODE_TABLE, blocksize=64))


@FAST
@given(
    seed=st.integers(0, 2**32 - 1),
    count=st.integers(0, 4),
    heavy=st.booleans(),
    block=st.sampled_from([64, 256, 4096]),
)
def test_int8_round_trip_error_bounded_by_block_absmax(seed, count, heavy, block):
    tensors = _random_tensors(seed, count, heavy)
    frame = encode_tensors(tensors, codec="int8", block_size=block)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    assert len(frame) == frame_size(shapes, codec="int8", block_size=block)
    decoded = decode_tensors(frame, expected_shapes=shapes)
    assert list(decoded) == list(tensors)
    for name, original in tensors.items():
        got = decoded[name]
        assert got.dtype == torch.float32 and got.shape == original.shape
        if original.numel() == 0:
            continue
        flat = original.reshape(-1)
        pad = (-flat.numel()) % block
        blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
        bound = (blocks.abs().amax(dim=1, keepdim=True) * (MAX_GAP * 1.0001)).expand_as(blocks).reshape(-1)
        error = (got.reshape(-1) - flat).abs()
        assert bool((error <= bound[: flat.numel()]).all())


@FAST
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(0, 4))
def test_fp32_round_trip_is_exact(seed, count):
    tensors = _random_tensors(seed, count, heavy=True)
    tensors["edge"] = torch.tensor([-0.0, 1e-45, -3.4e38, 1.0])
    frame = encode_tensors(tensors, codec="fp32")
    assert len(frame) == frame_size({n: tuple(t.shape) for n, t in tensors.items()}, codec="fp32")
    decoded = decode_tensors(frame)
    for name, original in tensors.items():
        assert decoded[name].shape == original.shape
        assert decoded[name].numpy().tobytes() == original.numpy().tobytes()


def test_half_precision_inputs_round_trip_through_fp32_exactly():
    x = torch.randn(100)
    tensors = {"h": x.half(), "b": x.bfloat16()}
    decoded = decode_tensors(encode_tensors(tensors, codec="fp32"))
    assert torch.equal(decoded["h"], x.half().float()) and torch.equal(decoded["b"], x.bfloat16().float())


def test_tensors_batched_into_one_quantizer_call_match_separate_encodes():
    tensors = {
        "a": torch.randn(100),
        "e": torch.zeros(0),
        "b": torch.randn(3, 50) * 100,
        "c": torch.randn(64),
    }
    together = decode_tensors(encode_tensors(tensors, block_size=64))
    for name, tensor in tensors.items():
        alone = decode_tensors(encode_tensors({name: tensor}, block_size=64))[name]
        assert together[name].numpy().tobytes() == alone.numpy().tobytes()
    tensors["b"][1, 7] = math.nan
    assert _reason(encode_tensors(tensors, block_size=64)) == codec.NON_FINITE


def test_zero_and_empty_tensors():
    decoded = decode_tensors(
        encode_tensors({"z": torch.zeros(300), "e": torch.zeros(0, 5), "s": torch.tensor(3.0)})
    )
    assert bool((decoded["z"] == 0).all()) and decoded["e"].shape == (0, 5)
    assert decoded["s"].shape == () and float(decoded["s"]) == 3.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["int8", "fp32"])
def test_non_finite_inputs_are_rejected_on_decode(name, bad):
    x = torch.randn(5000)
    x[4321] = bad
    assert _reason(encode_tensors({"x": x}, codec=name)) == codec.NON_FINITE


def test_error_feedback_tracks_the_sum_of_true_deltas():
    rng = np.random.default_rng(7)
    # One large value per block and many small ones that sit between codes: plain int8 loses the small
    # ones systematically, error feedback carries them forward.
    base = np.full(4096, 0.00173, np.float32)
    base[::512] = 1.0
    feedback, plain = ErrorFeedback(block_size=512), ErrorFeedback(block_size=512, enabled=False)
    true_sum = torch.zeros(4096, dtype=torch.float64)
    fed_sum, plain_sum = true_sum.clone(), true_sum.clone()
    for _ in range(60):
        delta = torch.from_numpy(base * rng.uniform(0.9, 1.1, size=4096).astype(np.float32))
        true_sum += delta.double()
        frame, decoded = feedback.compress(3, {"w": delta})
        assert torch.equal(decoded["w"], decode_tensors(frame)["w"])
        fed_sum += decoded["w"].double()
        plain_sum += plain.compress(3, {"w": delta})[1]["w"].double()
        # The residual is what has not been delivered yet, and it stays within one quantization step.
        assert feedback.residual_norm(3) <= MAX_GAP * 1.1 * math.sqrt(4096) * 1.2
    residual = math.sqrt(float(((true_sum - fed_sum) ** 2).sum()))
    assert residual == pytest.approx(feedback.residual_norm(3), rel=1e-3, abs=1e-5)
    plain_error = math.sqrt(float(((true_sum - plain_sum) ** 2).sum()))
    assert residual < 0.1 * plain_error  # plain int8 drifts linearly with the rounds
    assert plain.residual_norm(3) == 0.0


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 12))
def test_error_feedback_residual_is_the_undelivered_sum_up_to_bfloat16_rounding(seed, rounds):
    rng = np.random.default_rng(seed)
    feedback = ErrorFeedback(block_size=64)
    true_sum = np.zeros((7, 33))
    sent_sum = np.zeros((7, 33))
    rounded_off = 0.0  # what storing each residual in bfloat16 may drop: half a unit in its 8th bit
    for _ in range(rounds):
        delta = rng.standard_t(3, size=(7, 33)).astype(np.float32)
        true_sum += delta
        sent_sum += feedback.compress(0, {"w": torch.from_numpy(delta)})[1]["w"].double().numpy()
        rounded_off += 2.0**-8 * feedback.residual_norm(0)
    residual = feedback._residuals[0]["w"].double().numpy()
    assert np.linalg.norm(true_sum - sent_sum - residual) <= rounded_off + 1e-6


def test_error_feedback_keeps_a_dense_residual_in_bfloat16_and_a_sparse_one_in_float32():
    dense, sparse = ErrorFeedback(block_size=64), ErrorFeedback("topk-int8", block_size=64, density=0.1)
    delta = {"w": torch.randn(4, 64)}
    dense.compress(0, delta)
    sparse.compress(0, delta)
    assert dense._residuals[0]["w"].dtype == torch.bfloat16  # half the memory (issue #14)
    assert sparse._residuals[0]["w"].dtype == torch.float32  # accumulates unsent values: full precision


def test_error_feedback_reset_names_and_non_finite():
    feedback = ErrorFeedback(block_size=64)
    feedback.compress(1, {"w": torch.randn(100)})
    feedback.compress(2, {"w": torch.randn(100)})
    assert feedback.residual_norm(1) > 0
    before = feedback.residual_norm(1)
    with pytest.raises(ValueError, match="NaN or inf"):
        feedback.compress(1, {"w": torch.full((100,), math.nan)})
    assert feedback.residual_norm(1) == before
    with pytest.raises(ValueError, match="names changed"):
        feedback.compress(1, {"v": torch.randn(100)})
    feedback.reset(1)
    assert feedback.residual_norm(1) == 0.0 and feedback.residual_norm(2) > 0
    feedback.compress(1, {"v": torch.randn(100)})


def test_expected_shapes_are_enforced():
    frame = encode_tensors({"a": torch.randn(4, 3), "b": torch.randn(5)})
    assert _reason(frame, expected_shapes={"a": (3, 4), "b": (5,)}) == codec.WRONG_SHAPE
    assert _reason(frame, expected_shapes={"a": (4, 3)}) == codec.UNEXPECTED_TENSOR
    assert _reason(frame, expected_shapes={"a": (4, 3), "b": (5,), "c": (1,)}) == codec.MISSING_TENSOR
    assert set(decode_tensors(frame, expected_shapes={"b": [5], "a": (4, 3)})) == {"a", "b"}


def test_oversized_claims_are_rejected_before_allocating():
    huge = _tensor_frame([_entry(b"w", (10**6, 10**6), 4096, b"")])
    assert _reason(huge) == codec.OVERSIZED
    assert _reason(_tensor_frame([_entry(b"w", (10**6, 10**6), 0, b"")], codec_id=2)) == codec.OVERSIZED
    assert _reason(_tensor_frame([], count=2**32 - 1)) == codec.OVERSIZED
    empty_but_absurd = _entry(b"w", (0, 2**63), 64, b"")  # no elements, yet no tensor could have that shape
    assert _reason(_tensor_frame([empty_but_absurd])) == codec.OVERSIZED
    frame = encode_tensors({"w": torch.randn(1000)})
    assert _reason(frame, max_bytes=len(frame) - 1) == codec.OVERSIZED
    assert decode_tensors(frame, max_bytes=len(frame))["w"].shape == (1000,)


def test_structural_errors_have_their_own_reasons():
    frame = encode_tensors({"w": torch.randn(100)}, block_size=64)
    assert _reason(b"XXXX" + frame[4:]) == codec.BAD_MAGIC
    assert _reason(frame[:4] + b"\x09" + frame[5:]) == codec.UNSUPPORTED_VERSION
    assert _reason(frame[:5] + b"\x08" + frame[6:]) == codec.UNKNOWN_CODEC
    assert _reason(frame + b"\x00") == codec.TRAILING_BYTES
    for cut in range(len(frame)):
        assert _reason(frame[:cut]) == codec.TRUNCATED
    assert _reason("not bytes") == codec.BAD_HEADER  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "entries",
    [
        [_entry(b"w", (2,), 64, b"\0" * 6), _entry(b"w", (2,), 64, b"\0" * 6)],  # duplicate name
        [_entry(b"\xff\xfe", (2,), 64, b"\0" * 6)],  # name not utf-8
        [_entry(b"", (2,), 64, b"\0" * 6)],  # empty name
        [_entry(b"w", (2,), 64, b"\0" * 6, dtype_code=99)],
        [_entry(b"w", (1,) * 9, 64, b"\0" * 5)],  # too many dims
        [_entry(b"w", (2,), 100, b"\0" * 6)],  # unsupported block size
        [_entry(b"w", (2,), 64, struct.pack("<f", -1.0) + b"\0\0")],  # negative absmax
    ],
)
def test_bad_headers(entries):
    assert _reason(_tensor_frame(entries)) == codec.BAD_HEADER


def test_fp32_frame_with_block_size_and_inf_absmax_rejected():
    assert _reason(_tensor_frame([_entry(b"w", (1,), 64, b"\0" * 4)], codec_id=2)) == codec.BAD_HEADER
    inf_absmax = _entry(b"w", (2,), 64, struct.pack("<f", math.inf) + b"\x01\x02")
    assert _reason(_tensor_frame([inf_absmax])) == codec.NON_FINITE


def test_encoder_rejects_what_it_cannot_encode():
    with pytest.raises(ValueError):
        encode_tensors({"w": torch.arange(4)})
    with pytest.raises(ValueError):
        encode_tensors({"w": torch.randn(4)}, codec="int4")
    with pytest.raises(ValueError):
        encode_tensors({"w": torch.randn(4)}, block_size=100)
    with pytest.raises(ValueError):
        encode_tensors({"": torch.randn(4)})


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_only_raises_decode_error(data):
    for candidate in (data, codec.MAGIC + data, codec.MAGIC + b"\x01" + data):
        try:
            out = decode_tensors(candidate, max_bytes=1 << 20)
        except DecodeError:
            continue
        assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in out.values())


@settings(max_examples=150, deadline=None)
@given(
    which=st.integers(0, len(VALID_FRAMES) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 10_000),
    tail=st.binary(max_size=8),
)
def test_mutated_frames_only_raise_decode_error(which, edits, cut, tail):
    frame = bytearray(VALID_FRAMES[which])
    for position, value in edits:
        frame[position % len(frame)] = value
    candidate = bytes(frame[: max(cut % (len(frame) + 1), 1)]) + tail
    try:
        out = decode_tensors(candidate, max_bytes=1 << 20)
    except DecodeError:
        return
    assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in out.values())


@pytest.mark.parametrize("block_size", [64, 4096])
def test_cpu_quantizer_matches_bitsandbytes(block_size):
    from bitsandbytes.functional import quantize_blockwise

    from p2p_diloco.wire.codecs.codec import quantize_blockwise_cpu

    gen = torch.Generator().manual_seed(block_size)
    x = torch.cat(
        [torch.randn(100_003, generator=gen), torch.zeros(block_size), torch.randn(7, generator=gen) * 1e3]
    )
    codes, absmax = quantize_blockwise_cpu(x, block_size)
    ref_codes, state = quantize_blockwise(x, code=codec.CODE_TABLE, blocksize=block_size)
    assert torch.equal(absmax, state.absmax)
    scale = absmax.repeat_interleave(block_size)[: x.numel()]
    ours = codec.CODE_TABLE[codes.long()] * scale
    theirs = codec.CODE_TABLE[ref_codes.long()] * scale
    # bitsandbytes' CPU kernel searches the table approximately near zero; ours takes the nearest code,
    # so it is never less accurate.
    assert (ours - x).norm() <= (theirs - x).norm() * 1.0001
    assert float((codes != ref_codes).float().mean()) < 0.05


def test_zero_blocks_of_bitsandbytes_codes_get_the_cpu_zero_code():
    # On an H200 bitsandbytes coded an all-zero block 127 steps from the CPU kernel (it divides by an
    # absmax of 0): the codec rewrites those blocks so that both encoders give the same frame.
    from p2p_diloco.wire.codecs.blockwise import quantize_blockwise_cpu, zero_blocks_as_cpu

    values = torch.cat([torch.randn(4), torch.zeros(4), torch.randn(4), torch.zeros(2)])
    cpu_codes, absmax = quantize_blockwise_cpu(values, 4)
    gpu_codes = cpu_codes.numpy().copy()
    gpu_codes[4:8] = 0
    gpu_codes[12:] = 254
    zero_blocks_as_cpu(gpu_codes, absmax.numpy(), 4)
    np.testing.assert_array_equal(gpu_codes, cpu_codes.numpy())
    assert absmax[1] == 0 and absmax[0] > 0
