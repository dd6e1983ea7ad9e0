"""Fast kernels behind throughput at model scale (#14 item 5): each must equal the plain algorithm it
replaces bit for bit (the int8 code search vs `torch.bucketize`, the chunked outer step vs whole-tensor
float32 kernels, the chunked quantizer and decoder vs the padded, unchunked ones), the chunked merge must
be deterministic, and the fragment checksum must be the documented BLAKE3 layout (v1 files still load)."""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import pytest
import torch

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import fused
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.kernels import (
    CHUNK,
    QuantizedTensor,
    float32_scalar,
    fresh,
    nesterov_into,
    nesterov_quantized_into,
    norm64,
)
from p2p_diloco.protocol.merge import GRAM_MAX_DELTAS, merge_deltas
from p2p_diloco.protocol.outer_step import nesterov_step
from p2p_diloco.protocol.replica import GlobalReplica, fragment_checksum, fragment_checksum_v1
from p2p_diloco.wire.codecs.blockwise import (
    _CODE_BOUNDS,
    CODE_TABLE,
    _lut,
    nearest_codes,
    quantize_blockwise_cpu,
)
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.codecs.sparse import INT4_BOUNDS as SPARSE_BOUNDS


def reference(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(x, bounds, out_int32=True).to(torch.uint8)


def test_lookup_codes_equal_bucketize_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(-(2**31), 2**31 - 1, (2_000_000,), generator=gen, dtype=torch.int64)
    floats = raw.to(torch.int32).view(torch.float32)
    values = floats[torch.isfinite(floats) & (floats.abs() <= 1)]
    normal = torch.clamp(torch.randn(1_000_000, generator=gen) * 0.2, -1, 1)
    for bounds in (_CODE_BOUNDS, SPARSE_BOUNDS):
        b = bounds.to(torch.float32)
        assert _lut(b) is not None  # the table is exact for this code book
        up, down = torch.nextafter(b, torch.full_like(b, 2.0)), torch.nextafter(b, torch.full_like(b, -2.0))
        edges = torch.cat([b, up, down, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30])])
        for x in (values, normal, edges):
            assert torch.equal(nearest_codes(x, b), reference(x, b))


# ---- protocol.kernels and the chunked paths built on them (#14 item 5) ---------------------------------

SIZES = (1, 1000, CHUNK, 2 * CHUNK + 4097)  # one element, one partial chunk, exactly one, several + tail


def whole_tensor_nesterov(theta, m, g, lr: float, mu: float):  # noqa: ANN001, ANN201
    """The outer step as whole-tensor float32 kernels (the implementation before chunking)."""
    mu_t, rate = torch.tensor(mu, dtype=torch.float32), torch.tensor(lr, dtype=torch.float32)
    new_m = m * mu_t
    new_m.add_(g)
    d = new_m * mu_t
    d.add_(g)
    d.mul_(rate)
    return theta - d, new_m


@pytest.mark.parametrize("n", SIZES)
def test_chunked_nesterov_equals_whole_tensor_kernels_bit_for_bit(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    theta, m, g = (torch.randn(n, generator=gen) * scale for scale in (1.0, 1e-3, 3e-2))
    g[::7] *= 1e30  # large values: any change of rounding order would show
    ref_theta, ref_m = whole_tensor_nesterov(theta, m, g, 0.7, 0.9)
    out_theta, out_m = fresh((n,)), fresh((n,))
    finite = nesterov_into(theta, m, g, out_theta, out_m, mu=float32_scalar(0.9), rate=float32_scalar(0.7))
    assert finite
    assert out_theta.numpy().tobytes() == ref_theta.numpy().tobytes()
    assert out_m.numpy().tobytes() == ref_m.numpy().tobytes()
    new_theta, new_m = nesterov_step(
        theta.reshape(1, n), m.reshape(1, n), g.reshape(1, n), lr=0.7, momentum=0.9
    )
    assert new_theta.shape == (1, n) and torch.equal(new_theta.reshape(-1), ref_theta)
    assert torch.equal(new_m.reshape(-1), ref_m)


def test_chunked_nesterov_reports_overflow_in_any_chunk() -> None:
    n = 2 * CHUNK + 5
    theta, m, g = torch.zeros(n), torch.zeros(n), torch.full((n,), 1e-3)
    g[n - 1] = 3e38  # finite input whose lookahead overflows, in the last (partial) chunk
    out = fresh((n,)), fresh((n,))
    assert not nesterov_into(theta, m, g, *out, mu=float32_scalar(0.9), rate=float32_scalar(0.7))
    g[n - 1] = 1e-3
    g[CHUNK + 3 : CHUNK + 6] = 2e38  # finite everywhere, but the chunk's float32 sum overflows: a full scan
    assert nesterov_into(theta, m, g, *out, mu=float32_scalar(0.0), rate=float32_scalar(1.0))


def test_fresh_tensors_are_independent_writable_and_sized() -> None:
    for shape, dtype in (((3,), torch.float32), ((768, 1024), torch.float32), ((5, 2**19), torch.float64)):
        a, b = fresh(shape, dtype), fresh(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
        a.fill_(1.5)
        b.fill_(-2.0)
        assert bool((a == 1.5).all()) and bool((b == -2.0).all())
        assert a.clone().numpy().tobytes() == a.numpy().tobytes()


def reference_quantize(flat: torch.Tensor, block_size: int):  # noqa: ANN201
    """The quantizer before chunking: zero-pad to whole blocks, abs-max per block, bucketize."""
    n = flat.numel()
    blocks = -(-n // block_size)
    padded = torch.cat([flat, flat.new_zeros(blocks * block_size - n)]).reshape(blocks, block_size)
    top = padded.abs().amax(dim=1)
    scaled = (padded * (1.0 / top.clamp(min=1e-38)).view(-1, 1)).clamp_(-1, 1).reshape(-1)
    return reference(scaled, _CODE_BOUNDS)[:n], top


@pytest.mark.parametrize("n", (*SIZES, 4095, 4097))
@pytest.mark.parametrize("block_size", (64, 4096))
def test_quantizer_and_decoder_equal_the_unchunked_algorithm(n: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(n + block_size)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4  # uneven scales across blocks
    codes, absmax = quantize_blockwise_cpu(x, block_size)
    ref_codes, ref_absmax = reference_quantize(x, block_size)
    assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax)
    decoded = decode_tensors(encode_tensors({"x": x}, block_size=block_size))["x"]
    expected = CODE_TABLE[ref_codes.long()] * ref_absmax.repeat_interleave(block_size)[:n]
    assert decoded.numpy().tobytes() == expected.numpy().tobytes()


def unchunked_rda(parts, weights):  # noqa: ANN001, ANN201
    total = sum(weights)
    direction = torch.zeros(parts[0].shape, dtype=torch.float64)
    norm_sum = 0.0
    for v, w in zip(parts, weights):
        norm = float(torch.linalg.vector_norm(v, dtype=torch.float64))
        direction += v.double() * (w / norm)
        norm_sum += w * norm
    direction_norm = float(torch.linalg.vector_norm(direction)) / total
    return (direction * ((norm_sum / total) / (direction_norm * total))).float()


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_chunked_merge_is_deterministic_and_matches_the_float64_formula(rule: str) -> None:
    gen = torch.Generator().manual_seed(5)
    n = 2 * CHUNK + 77
    deltas = [{"w": torch.randn(n, generator=gen) * s} for s in (1e-3, 5e-3, 2e-4)]
    weights = [1.0, 2.5, 0.5]
    merged = merge_deltas(deltas, weights, rule=rule)["w"]
    again = merge_deltas(deltas, weights, rule=rule)["w"]
    assert merged.dtype == torch.float32 and merged.numpy().tobytes() == again.numpy().tobytes()
    parts = [d["w"] for d in deltas]
    if rule == "rda":
        expected = unchunked_rda(parts, weights)
    else:
        expected = (sum(p.double() * w for p, w in zip(parts, weights)) / sum(weights)).float()
    torch.testing.assert_close(merged, expected, rtol=1e-6, atol=1e-12)


def test_norm64_matches_vector_norm_in_float64() -> None:
    x = torch.randn(3 * CHUNK + 11, generator=torch.Generator().manual_seed(2)) * 1e20  # squares overflow f32
    assert math.isclose(norm64(x), float(torch.linalg.vector_norm(x, dtype=torch.float64)), rel_tol=1e-12)
    assert norm64(torch.zeros(0)) == 0.0


# ---- the fragment checksum: BLAKE3 (format v2), v1 files still load -------------------------------------

TINY_PARAMS = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 8, "b": torch.tensor([-1.5, 2.0])}
TINY_MOMENTUM = {"w": torch.full((2, 3), 0.25), "b": torch.zeros(2)}


def test_checksum_is_the_documented_blake3_layout() -> None:
    # Pinned: the value any machine must compute (little-endian float32 bytes, the docstring's layout).
    assert (
        fragment_checksum(["w", "b"], TINY_PARAMS, TINY_MOMENTUM, 7)
        == "e6b793432cab616e7972309a78e90e98ba689db3ffc3cce7b28746568f163e1d"
    )
    # The v1 (blake2b) checksum of the same fragment, as the code before v2 computed it.
    assert (
        fragment_checksum_v1(["w", "b"], TINY_PARAMS, TINY_MOMENTUM, 7)
        == "e536f3c0da7b3e56b249a2c23cc3b4c8016bcb7ec4636519bf5117011dbf5447"
    )


def test_checksum_covers_names_shapes_values_momentum_and_version() -> None:
    base = fragment_checksum(["w", "b"], TINY_PARAMS, TINY_MOMENTUM, 7)
    flipped = {**TINY_PARAMS, "b": TINY_PARAMS["b"].clone()}
    flipped["b"].view(torch.int32)[0] ^= 1  # one bit of Θ
    moved = {**TINY_MOMENTUM, "w": TINY_MOMENTUM["w"].clone()}
    moved["w"][1, 2] = -0.0 if float(moved["w"][1, 2]) == 0.0 else 0.0  # one value of m
    reshaped = {**TINY_PARAMS, "w": TINY_PARAMS["w"].reshape(3, 2)}
    reshaped_m = {**TINY_MOMENTUM, "w": TINY_MOMENTUM["w"].reshape(3, 2)}
    renamed = (
        {"v": TINY_PARAMS["w"], "b": TINY_PARAMS["b"]},
        {"v": TINY_MOMENTUM["w"], "b": TINY_MOMENTUM["b"]},
    )
    others = {
        fragment_checksum(["w", "b"], flipped, TINY_MOMENTUM, 7),
        fragment_checksum(["w", "b"], TINY_PARAMS, moved, 7),
        fragment_checksum(["w", "b"], reshaped, reshaped_m, 7),
        fragment_checksum(["v", "b"], *renamed, 7),
        fragment_checksum(["b", "w"], TINY_PARAMS, TINY_MOMENTUM, 7),
        fragment_checksum(["w", "b"], TINY_PARAMS, TINY_MOMENTUM, 8),
    }
    assert base not in others and len(others) == 6


def test_a_fragment_saved_with_a_v1_checksum_still_loads() -> None:
    plan = plan_fragments([(n, tuple(t.shape)) for n, t in TINY_PARAMS.items()], 1)
    names = plan.names(0)
    old = fragment_checksum_v1(names, TINY_PARAMS, TINY_MOMENTUM, 7)
    replica = GlobalReplica.from_fragments(plan, lambda p: (7, TINY_PARAMS, TINY_MOMENTUM, old))
    assert replica.version(0) == 7
    assert replica.checksum(0) == fragment_checksum(names, TINY_PARAMS, TINY_MOMENTUM, 7) != old
    with pytest.raises(ValueError, match="checksum mismatch"):
        GlobalReplica.from_fragments(plan, lambda p: (7, TINY_PARAMS, TINY_MOMENTUM, "0" * 64))


def test_the_outer_step_hashes_as_it_goes_to_the_documented_checksum() -> None:
    gen = torch.Generator().manual_seed(9)
    shapes = {"a": (3, CHUNK // 2 + 5), "b": (7,), "c": (2, 3, 4)}
    plan = plan_fragments(list(shapes.items()), 1)
    replica = GlobalReplica(plan, {n: torch.randn(s, generator=gen) for n, s in shapes.items()})
    grad = {n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()}
    pending = replica.compute_update(0, grad, lr=0.7, momentum=0.9)
    names = plan.names(0)
    assert pending.checksum == fragment_checksum(names, pending.params, pending.momentum, 1)
    assert list(pending.params) == list(names)


@pytest.mark.parametrize("count", [1, GRAM_MAX_DELTAS, GRAM_MAX_DELTAS + 1])
def test_rda_with_and_without_the_gram_matrix_matches_the_float64_formula(count: int) -> None:
    gen = torch.Generator().manual_seed(count)
    n = CHUNK + 999
    parts = [torch.randn(n, generator=gen) * (i + 1) * 1e-3 for i in range(count)]
    weights = [1.0 + 0.5 * i for i in range(count)]
    merged = merge_deltas([{"w": p} for p in parts], weights)["w"]
    torch.testing.assert_close(merged, unchunked_rda(parts, weights), rtol=1e-6, atol=1e-12)


def test_rda_of_nearly_cancelling_deltas_sums_the_direction_itself() -> None:
    v = torch.randn(CHUNK + 3, generator=torch.Generator().manual_seed(4)) * 1e-2
    w = -v.clone()
    w[5] *= 1.0001  # the directions cancel but for one coordinate: the Gram form would be all rounding
    merged = merge_deltas([{"w": v}, {"w": w}], [1.0, 1.0])["w"]
    torch.testing.assert_close(merged, unchunked_rda([v, w], [1.0, 1.0]), rtol=1e-5, atol=1e-12)
    assert float(merged.abs().max()) == pytest.approx(float(merged[5].abs()))
    exact = merge_deltas([{"w": v}, {"w": -v}], [2.0, 2.0])["w"]
    assert bool((exact == 0).all())


@pytest.mark.parametrize(("mu", "rate"), [(0.9, 0.7), (0.0, 0.7), (0.9, 0.0), (0.0, 0.0)])
def test_a_momentum_overflow_shows_in_the_parameters(mu: float, rate: float) -> None:
    n = CHUNK + 10
    theta, m, g = torch.ones(n), torch.zeros(n), torch.zeros(n)
    m[CHUNK + 2], g[CHUNK + 2] = 3e38, 3e38  # m' = mu*m + g overflows unless mu = 0
    out = fresh((n,)), fresh((n,))
    finite = nesterov_into(theta, m, g, *out, mu=float32_scalar(mu), rate=float32_scalar(rate))
    both = bool(torch.isfinite(out[0]).all()) and bool(torch.isfinite(out[1]).all())
    assert finite == both
    assert both == (mu == 0.0)  # with mu = 0, m' = g and the step stay finite


def test_a_non_finite_gradient_is_refused_with_the_gradient_check_reason() -> None:
    shapes = {"a": (4, 5), "b": (CHUNK + 3,)}
    plan = plan_fragments(list(shapes.items()), 1)
    replica = GlobalReplica(plan, {n: torch.zeros(s) for n, s in shapes.items()})
    grad = {"a": torch.full((4, 5), 3e38), "b": torch.zeros(CHUNK + 3)}  # "a" overflows in the step
    grad["b"][CHUNK + 1] = math.nan  # and "b" itself is bad: the gradient check reports it, as before
    expected = replica.check_outer_grad(0, grad).reason
    assert expected.startswith("non-finite: b has 1 NaN/inf")
    decision = replica.apply(0, 0, grad, lr=0.7, momentum=0.9, expected_checksum=None)
    assert decision.reason == expected and replica.versions() == (0,)
    grad["b"][CHUNK + 1] = 0.0
    assert "overflows in a" in replica.apply(0, 0, grad, lr=0.7, momentum=0.9, expected_checksum=None).reason


def test_values_just_beyond_one_get_the_codes_of_one() -> None:
    one = torch.tensor([1.0, -1.0])
    beyond = torch.nextafter(one, one * 2)
    beyond2 = torch.nextafter(beyond, one * 2)
    for bounds in (_CODE_BOUNDS, SPARSE_BOUNDS.to(torch.float32)):
        for x in (beyond, beyond2):
            assert torch.equal(nearest_codes(x, bounds), nearest_codes(one, bounds))
            assert torch.equal(nearest_codes(x, bounds), reference(one, bounds))


# ---- the fused C kernels (protocol.fused) equal the torch path bit for bit ------------------------------

needs_fused = pytest.mark.skipif(not fused.available(), reason=f"fused kernels not built: {fused.WHY_NOT}")
FUSED_SIZES = (1, 3, 4095, 4097, CHUNK + 13)  # tails that are no multiple of a vector, a block or a chunk


def special_values(n: int, seed: int) -> torch.Tensor:
    """Random float32 bit patterns mixed with normal values, denormals, ±0, ±inf and NaNs of both signs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 1e-2
    raw = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    pick = torch.rand(n, generator=gen)
    x = torch.where(pick < 0.05, raw.view(torch.float32), x)  # any bits: NaN payloads, huge, tiny
    specials = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-45, -1e-45, 1e-40, 3e38, -3e38, 1.0, -1.0]
    )
    where = torch.randint(0, max(n, 1), (max(1, n // 50) if n else 0,), generator=gen)
    x[where] = specials[torch.randint(0, len(specials), (where.numel(),), generator=gen)]
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (its payload is not part of any result: a NaN
    makes the outer step and the int8 encoder refuse the whole tensor)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    return a[~nan_a].numpy().tobytes() == b[~nan_b].numpy().tobytes()


def both_paths(fn, *args):  # noqa: ANN001, ANN002, ANN201
    """fn(*args) with the C kernels, then within `fused.torch_only()`."""
    assert fused.active()
    with_c = fn(*args)
    with fused.torch_only():
        assert not fused.active()
        with_torch = fn(*args)
    return with_c, with_torch


@needs_fused
@pytest.mark.parametrize("n", FUSED_SIZES)
@pytest.mark.parametrize("kind", ["normal", "denormal", "special"])
def test_fused_outer_step_equals_the_torch_kernels_bit_for_bit(n: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(n)
    theta, m, g = (torch.randn(n, generator=gen) * scale for scale in (1.0, 1e-3, 3e-2))
    if kind == "denormal":  # products and sums in the subnormal range (no flush to zero on either path)
        theta, m, g = theta * 1e-38, m * 1e-36, g * 1e-39
    elif kind == "special":
        theta, m, g = special_values(n, n), special_values(n, n + 1), special_values(n, n + 2)

    def step():  # noqa: ANN202
        out = fresh((n,)), fresh((n,))
        finite = nesterov_into(theta, m, g, *out, mu=float32_scalar(0.9), rate=float32_scalar(0.7))
        return finite, out

    (finite_c, (theta_c, m_c)), (finite_t, (theta_t, m_t)) = both_paths(step)
    assert finite_c == finite_t == bool(torch.isfinite(theta_t).all())
    assert same_bits(theta_c, theta_t) and same_bits(m_c, m_t)
    if kind != "special":
        assert finite_c and theta_c.numpy().tobytes() == theta_t.numpy().tobytes()
        assert m_c.numpy().tobytes() == m_t.numpy().tobytes()


@needs_fused
@pytest.mark.parametrize(("mu", "rate"), [(0.9, 0.7), (0.0, 0.7), (0.9, 0.0), (0.0, 0.0)])
def test_fused_outer_step_detects_every_overflow_like_the_torch_path(mu: float, rate: float) -> None:
    n = 4096 + 5
    for where in (0, 4095, n - 1):
        for bad_m, bad_g in ((3e38, 3e38), (0.0, math.inf), (math.nan, 0.0), (0.0, -3.4e38)):
            theta, m, g = torch.ones(n), torch.zeros(n), torch.full((n,), 1e-3)
            m[where], g[where] = bad_m, bad_g

            def step(theta, m, g):  # noqa: ANN001, ANN202
                out = fresh((n,)), fresh((n,))
                finite = nesterov_into(theta, m, g, *out, mu=float32_scalar(mu), rate=float32_scalar(rate))
                return finite, bool(torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all())

            (finite_c, both_c), (finite_t, both_t) = both_paths(step, theta, m, g)
            assert finite_c == finite_t == both_c == both_t


@needs_fused
@pytest.mark.parametrize("n", (*FUSED_SIZES, 0, 2 * CHUNK + 4097))
@pytest.mark.parametrize("block_size", (64, 4096))
@pytest.mark.parametrize("kind", ["normal", "denormal", "special", "zeros"])
def test_fused_quantizer_equals_the_torch_quantizer(n: int, block_size: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(n + block_size)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4
    if kind == "denormal":
        x = x * 1e-39  # absmax below the 1e-38 clamp in some blocks
    elif kind == "special":
        x = special_values(n, n)
    elif kind == "zeros":
        x = torch.zeros(n)
        x[::3] = -0.0
    for bounds in (None, SPARSE_BOUNDS.to(torch.float32)):
        (codes_c, absmax_c), (codes_t, absmax_t) = both_paths(quantize_blockwise_cpu, x, block_size, bounds)
        assert torch.equal(codes_c, codes_t)
        assert same_bits(absmax_c, absmax_t)


@needs_fused
@pytest.mark.parametrize("block_size", (64, 4096))
def test_fused_decoder_equals_the_torch_decoder(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    tensors = {
        "big": torch.randn(3, CHUNK + 7, generator=gen) * 1e-3,
        "tail": torch.randn(4097, generator=gen),
        "one": torch.tensor([2.5]),
        "zeros": torch.zeros(5, 5),
        "tiny": torch.randn(100, generator=gen) * 1e-40,
        "empty": torch.zeros(0, 3),
    }
    frame = encode_tensors(tensors, block_size=block_size)
    decoded_c, decoded_t = both_paths(lambda: decode_tensors(frame))
    assert list(decoded_c) == list(tensors)
    for name in tensors:
        assert decoded_c[name].shape == decoded_t[name].shape == tensors[name].shape
        assert decoded_c[name].numpy().tobytes() == decoded_t[name].numpy().tobytes()
    bad = bytearray(frame)  # a NaN absmax is still refused before any decoding
    with fused.torch_only():
        assert encode_tensors(tensors, block_size=block_size) == frame  # the encoders agree byte for byte
    nan_frame = encode_tensors({"x": torch.tensor([1.0, math.nan])}, block_size=block_size)
    for fn in (lambda: decode_tensors(nan_frame), lambda: decode_tensors(bytes(bad[:-1]))):
        with pytest.raises(DecodeError):
            fn()


@needs_fused
def test_fused_replica_update_has_the_same_checksum_as_the_torch_path() -> None:
    gen = torch.Generator().manual_seed(11)
    shapes = {"a": (3, CHUNK // 2 + 5), "b": (7,), "c": (2, 3, 4)}
    plan = plan_fragments(list(shapes.items()), 1)
    replica = GlobalReplica(plan, {n: torch.randn(s, generator=gen) for n, s in shapes.items()})
    grad = {n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()}
    frame = encode_tensors(grad)

    def apply():  # noqa: ANN202
        twin = replica.frozen()
        pending = twin.compute_update(0, decode_tensors(frame), lr=0.7, momentum=0.9)
        return frame == encode_tensors(grad), pending.checksum

    (same_c, checksum_c), (same_t, checksum_t) = both_paths(apply)
    assert same_c and same_t and checksum_c == checksum_t


@needs_fused
def test_fused_wrappers_refuse_bad_arguments() -> None:
    x, out = torch.zeros(8), torch.zeros(8)
    mu = float32_scalar(0.9)
    with pytest.raises(ValueError, match="contiguous CPU"):
        fused.nesterov(x, x, x.double(), out, out.clone(), mu, mu)
    with pytest.raises(ValueError, match="contiguous CPU"):
        fused.nesterov(x, x, torch.zeros(16)[::2], out, out.clone(), mu, mu)
    with pytest.raises(ValueError, match="8 elements"):
        fused.nesterov(x, x, x, torch.zeros(7), out, mu, mu)
    with pytest.raises(ValueError, match="codes"):
        fused.dequantize(np.zeros(8, np.int8), torch.ones(1), 64, CODE_TABLE, out)
    with pytest.raises(ValueError, match="absmax"):
        fused.dequantize(np.zeros(8, np.uint8), torch.ones(2), 64, CODE_TABLE, out)


def test_the_fused_switch() -> None:
    """P2P_DILOCO_FUSED=0 keeps the library unloaded (a fresh interpreter); torch_only() nests and restores."""
    import subprocess
    import sys

    code = "from p2p_diloco.protocol import fused; print(fused.available(), fused.active(), fused.WHY_NOT)"
    env = {**os.environ, fused.ENV_SWITCH: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[:2] == ["False", "False"] and fused.ENV_SWITCH in out.stdout
    before = fused.active()
    with fused.torch_only():
        with fused.torch_only():
            assert not fused.active()
        assert not fused.active()
    assert fused.active() == before == fused.available()


# ---- the int8 gradient decoded inside the outer step (decode_tensors(lazy=True)) ------------------------


@pytest.mark.parametrize("block_size", (64, 4096))
def test_lazy_decode_keeps_int8_tensors_quantized_and_checked(block_size: int) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(5, 4097, generator=gen),
        "empty": torch.zeros(0),
        "b": torch.randn(3, generator=gen),
    }
    frame = encode_tensors(tensors, block_size=block_size)
    eager, lazy = decode_tensors(frame), decode_tensors(frame, lazy=True)
    assert list(lazy) == list(eager)
    assert isinstance(lazy["w"], QuantizedTensor) and lazy["w"].shape == (5, 4097)
    assert isinstance(lazy["empty"], torch.Tensor) and lazy["empty"].shape == (0,)
    for name in ("w", "b"):
        assert lazy[name].decode().numpy().tobytes() == eager[name].numpy().tobytes()
    fp32 = decode_tensors(encode_tensors(tensors, codec="fp32"), lazy=True)
    assert all(isinstance(t, torch.Tensor) for t in fp32.values())
    nan_frame = encode_tensors({"x": torch.tensor([1.0, math.nan])}, block_size=block_size)
    with pytest.raises(DecodeError, match="non-finite block absmax"):
        decode_tensors(nan_frame, lazy=True)


@pytest.mark.parametrize("n", (1, 4095, 4097, CHUNK + 13))
def test_the_step_on_a_quantized_gradient_equals_decoding_first(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    theta, m = (
        special_values(n, n) if n > 4096 else torch.randn(n, generator=gen),
        torch.randn(n, generator=gen),
    )
    grad = decode_tensors(
        encode_tensors({"g": torch.randn(n, generator=gen) * 1e-2}, block_size=64), lazy=True
    )["g"]
    mu, rate = float32_scalar(0.9), float32_scalar(0.7)
    ref = fresh((n,)), fresh((n,))
    ref_finite = nesterov_into(theta, m, grad.decode(), *ref, mu=mu, rate=rate)

    def step():  # noqa: ANN202
        out = fresh((n,)), fresh((n,))
        return nesterov_quantized_into(theta, m, grad, *out, mu=mu, rate=rate), out

    paths = both_paths(step) if fused.available() else [step()]
    for finite, (new_theta, new_m) in paths:
        assert finite == ref_finite
        assert same_bits(new_theta, ref[0]) and same_bits(new_m, ref[1])
    with pytest.raises(ValueError, match="shape"):
        nesterov_quantized_into(theta.reshape(1, n), m, grad, *ref, mu=mu, rate=rate)


def test_a_replica_applies_a_lazy_update_exactly_as_a_decoded_one() -> None:
    gen = torch.Generator().manual_seed(21)
    shapes = {"a": (3, CHUNK // 2 + 5), "b": (7,), "c": (2, 3, 4)}
    plan = plan_fragments(list(shapes.items()), 1)
    replica = GlobalReplica(plan, {n: torch.randn(s, generator=gen) for n, s in shapes.items()})
    frame = encode_tensors({n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()})
    expected = replica.compute_update(0, decode_tensors(frame), lr=0.7, momentum=0.9).checksum
    for lazy in (True, False):
        twin = replica.frozen()
        grad = decode_tensors(frame, expected_shapes=twin.shapes(0), lazy=lazy)
        decision = twin.apply(0, 0, grad, lr=0.7, momentum=0.9, expected_checksum=expected)
        assert decision.action == "apply" and twin.checksum(0) == expected
    lazy_grad = decode_tensors(frame, lazy=True)
    wrong = {**lazy_grad, "b": decode_tensors(encode_tensors({"b": torch.zeros(8)}), lazy=True)["b"]}
    assert (
        "wrong shape: b is (8,)"
        in replica.frozen().apply(0, 0, wrong, lr=0.7, momentum=0.9, expected_checksum=None).reason
    )
    missing = {n: g for n, g in lazy_grad.items() if n != "c"}
    assert replica.check_outer_grad(0, lazy_grad).action == "accept"
    assert (
        "missing tensor"
        in replica.frozen().apply(0, 0, missing, lr=0.7, momentum=0.9, expected_checksum=None).reason
    )


def test_a_lazy_update_that_overflows_is_refused_with_the_overflow_reason() -> None:
    shapes = {"a": (4, 5), "b": (9,)}
    plan = plan_fragments(list(shapes.items()), 1)
    replica = GlobalReplica(plan, {n: torch.zeros(s) for n, s in shapes.items()})
    grad = decode_tensors(encode_tensors({"a": torch.full((4, 5), 3e38), "b": torch.zeros(9)}), lazy=True)
    for torch_path in (False, True):
        with fused.torch_only() if torch_path else contextlib.nullcontext():
            decision = replica.apply(0, 0, grad, lr=0.7, momentum=0.9, expected_checksum=None)
        assert (
            decision.action == "refuse" and "overflows in a" in decision.reason and replica.versions() == (0,)
        )
