"""The fused C kernels (`protocol/_fused.c`): loading them, switching them off, and their typed wrappers.

This module owns the optional compiled library behind the throughput goal of issue #14 item 5 (outer step,
int8 encode and decode at >= 1 GB/s of fp32 parameters per core). Each kernel makes one pass over its
tensors instead of several torch kernels, and does per element exactly the float32 operations, in the
same order, of the torch path it replaces (`kernels.nesterov_into`,
`wire.codecs.blockwise.quantize_blockwise_cpu`, `wire.codecs.codec`'s decoder): the library is built with
-O3 -ffp-contract=off and without -ffast-math (setup.py), so no multiply-add becomes an FMA and nothing is
reassociated. Results are the same bit for bit either way (tests/unit/test_scale_kernels.py runs both paths);
replicas with and without the library agree. (Only the payload bits of a NaN may differ, in outputs nobody
uses: a NaN makes the outer step refuse the update and the encoder mark the whole tensor non-finite.)

Kernels: `nesterov` (the outer step, with an exact finiteness test of Θ' by its exponent bits),
`dequantize_nesterov` (the same step on a gradient still in int8 form, decoded value by value: the gradient
is never written out), `quantize` (blockwise absmax and the code search of `wire.codecs.blockwise`) and
`dequantize` (code table lookup and one multiply per value). The two steps can hand Θ' to a callback a
PIECE at a time, right after computing it, so the replica hashes it while it is in cache.

The library is built by `pip install -e .` / `pip install .` (setup.py, an optional extension: without a
C compiler the install succeeds and every caller uses its torch path). It is skipped when
P2P_DILOCO_FUSED=0 is set in the environment, or, at run time, inside `torch_only()`.

The wrappers take contiguous CPU tensors of the right dtype and sizes (checked: a wrong argument raises
ValueError rather than reaching C); callers check `active()` first and keep their torch path otherwise.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

ENV_SWITCH = "P2P_DILOCO_FUSED"  # "0": never load the library (the torch path everywhere)
ABI_VERSION = 1  # what `pd_abi_version` must return

_f32, _i64, _ptr = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p


def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, why not) — the library is None when it is absent, switched off or of another ABI."""
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return None, f"{ENV_SWITCH}=0"
    try:
        spec = importlib.util.find_spec("p2p_diloco.protocol._fused")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None, "p2p_diloco/protocol/_fused is not built (no C compiler at install?)"
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as exc:
        return None, f"cannot load {spec.origin}: {exc}"
    lib.pd_abi_version.restype = ctypes.c_int
    if lib.pd_abi_version() != ABI_VERSION:
        return None, f"{spec.origin} has ABI {lib.pd_abi_version()}, this code needs {ABI_VERSION}"
    lib.pd_nesterov.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _f32, _f32]
    lib.pd_nesterov.restype = ctypes.c_int
    lib.pd_dequantize_nesterov.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _f32, _f32]
    lib.pd_dequantize_nesterov.restype = ctypes.c_int
    lib.pd_quantize.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _f32, _ptr, _ptr]
    lib.pd_quantize.restype = None
    lib.pd_dequantize.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr]
    lib.pd_dequantize.restype = None
    return lib, ""


_LIB, WHY_NOT = _load()
_state = threading.local()  # `torch_only()` is per thread: another thread's kernels keep their path


def available() -> bool:
    """Whether the compiled library loaded (built, not switched off by the environment)."""
    return _LIB is not None


def active() -> bool:
    """Whether callers should use the C kernels now: loaded, and not inside `torch_only()` on this thread."""
    return _LIB is not None and not getattr(_state, "torch_only", False)


@contextmanager
def torch_only() -> Iterator[None]:
    """Within this block (on this thread), every kernel takes its torch path: for tests comparing the two."""
    before = getattr(_state, "torch_only", False)
    _state.torch_only = True
    try:
        yield
    finally:
        _state.torch_only = before


def _lib() -> ctypes.CDLL:
    if _LIB is None:
        raise RuntimeError(f"the fused kernels are not available: {WHY_NOT}")
    return _LIB


def _check(t: Tensor, dtype: torch.dtype, numel: int, what: str) -> int:
    """The data pointer of `t` after checking it is a contiguous CPU tensor of `dtype` and `numel`
    elements."""
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(
            f"{what}: need a contiguous CPU {dtype} tensor of {numel} elements, got "
            f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})"
        )
    return t.data_ptr()


def _scalar(value: Tensor | float) -> float:
    """A float32 scalar as the Python float ctypes passes on exactly (it converts to float once more, a
    no-op)."""
    return float(torch.as_tensor(value, dtype=torch.float32))


OnTheta = Callable[[memoryview], object]  # called with the bytes of each piece of Θ' once it is computed
# Elements per call when a caller hashes Θ' as it goes: 512 KiB of Θ' stays in a core's L2 cache until
# hashed (measured on the 32M-parameter fragment of bench_scale.py: ~4% faster than hashing whole tensors
# after computing them; 256 KiB and 128 KiB pieces were slower, the Python call per piece costs ~5 µs).
# A multiple of every int8 block size (at most 4096), so a piece of the fused decode starts on a block.
PIECE = 1 << 17


def nesterov(
    theta: Tensor,
    m: Tensor,
    g: Tensor,
    out_theta: Tensor,
    out_m: Tensor,
    mu: Tensor | float,
    rate: Tensor | float,
    on_theta: OnTheta | None = None,
) -> bool:
    """`kernels.nesterov_into` in one pass: writes Θ' and m'; True when Θ' (and so m') is all finite.
    `on_theta`: called with each PIECE of Θ' right after it is written (while it is in cache), in order."""
    n = theta.numel()
    t_in, m_in, g_in = (_check(t, torch.float32, n, what) for t, what in ((theta, "Θ"), (m, "m"), (g, "g")))
    t_out, m_out = (_check(t, torch.float32, n, what) for t, what in ((out_theta, "Θ'"), (out_m, "m'")))
    mu32, rate32, kernel = _scalar(mu), _scalar(rate), _lib().pd_nesterov
    finite = True
    for start, stop, piece in _pieces(out_theta, n, on_theta):
        at = 4 * start
        finite &= bool(
            kernel(t_in + at, m_in + at, g_in + at, t_out + at, m_out + at, stop - start, mu32, rate32)
        )
        if on_theta is not None:
            on_theta(piece)
    return finite


def dequantize_nesterov(
    codes: np.ndarray,
    absmax: Tensor,
    block_size: int,
    table: Tensor,
    theta: Tensor,
    m: Tensor,
    out_theta: Tensor,
    out_m: Tensor,
    mu: Tensor | float,
    rate: Tensor | float,
    on_theta: OnTheta | None = None,
) -> bool:
    """The outer step on the int8 gradient `codes` (uint8) with its block `absmax`, decoded on the fly as
    `dequantize` would (one multiply per value): the same Θ' and m' as decoding first, then `nesterov`."""
    n = theta.numel()
    if block_size <= 0 or PIECE % block_size:
        raise ValueError(f"block size {block_size} does not divide {PIECE}")
    code_ptr = _codes(codes, n)
    scales = _check(absmax, torch.float32, -(-n // block_size), "absmax")
    tab = _check(table, torch.float32, 256, "code table")
    t_in, m_in = (_check(t, torch.float32, n, what) for t, what in ((theta, "Θ"), (m, "m")))
    t_out, m_out = (_check(t, torch.float32, n, what) for t, what in ((out_theta, "Θ'"), (out_m, "m'")))
    mu32, rate32, kernel = _scalar(mu), _scalar(rate), _lib().pd_dequantize_nesterov
    finite = True
    for start, stop, piece in _pieces(out_theta, n, on_theta):  # pieces start on a block boundary
        at, block = 4 * start, start // block_size
        code, scale, count = code_ptr + start, scales + 4 * block, stop - start
        ins, outs = (t_in + at, m_in + at), (t_out + at, m_out + at)
        finite &= bool(kernel(code, block_size, tab, scale, *ins, *outs, count, mu32, rate32))
        if on_theta is not None:
            on_theta(piece)
    return finite


def _pieces(out: Tensor, n: int, on_theta: OnTheta | None) -> Iterator[tuple[int, int, memoryview]]:
    """(start, stop, bytes of out[start:stop]): the whole range at once without `on_theta`, else PIECEs."""
    if on_theta is None:
        yield 0, n, memoryview(b"")
        return
    raw = memoryview(out.detach().view(-1).numpy()).cast("B")
    for start in range(0, n, PIECE):
        stop = min(start + PIECE, n)
        yield start, stop, raw[4 * start : 4 * stop]


def quantize(
    flat: Tensor,
    block_size: int,
    counts: Tensor,
    padded: Tensor,
    clamp_min: float,
    codes: Tensor,
    absmax: Tensor,
) -> None:
    """Blockwise absmax quantization of `flat` (float32) into `codes` (uint8, same size) and `absmax` (one
    per block, the last block may be short), the code of each value found by `wire.codecs.blockwise`'s 16-bit
    prefix table: `counts` (uint8, 65536 entries) and `padded` (the bounds then +inf, float32)."""
    n = flat.numel()
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    x = _check(flat, torch.float32, n, "values")
    lut = _check(counts, torch.uint8, 1 << 16, "prefix counts")
    if padded.dtype != torch.float32 or not padded.is_contiguous() or not 2 <= padded.numel() <= 256:
        raise ValueError("padded bounds: need a contiguous float32 tensor of 2..256 elements")
    if int(counts.max()) > padded.numel() - 1:
        raise ValueError("prefix counts point beyond the padded bounds")
    out = _check(codes, torch.uint8, n, "codes")
    top = _check(absmax, torch.float32, -(-n // block_size), "absmax")
    _lib().pd_quantize(x, n, block_size, lut, padded.data_ptr(), _scalar(clamp_min), out, top)


def dequantize(codes: np.ndarray, absmax: Tensor, block_size: int, table: Tensor, out: Tensor) -> Tensor:
    """`out[i] = table[codes[i]] * absmax[i // block_size]` (uint8 codes, float32 out): one multiply each."""
    n = out.numel()
    code_ptr = _codes(codes, n)
    scales = _check(absmax, torch.float32, -(-n // block_size), "absmax")
    tab = _check(table, torch.float32, 256, "code table")
    _lib().pd_dequantize(code_ptr, n, block_size, tab, scales, _check(out, torch.float32, n, "out"))
    return out


def _codes(codes: np.ndarray, n: int) -> int:
    if codes.dtype != np.uint8 or codes.ndim != 1 or codes.size != n or not codes.flags.c_contiguous:
        raise ValueError(
            f"codes: need a contiguous 1-D uint8 array of {n} values, got {codes.dtype} {codes.shape}"
        )
    return codes.ctypes.data
