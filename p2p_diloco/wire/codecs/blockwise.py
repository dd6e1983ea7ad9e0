"""Shared wire primitives: reason tags of `DecodeError`, codec names, the int8 code table, bounds-checked
byte reading and blockwise absmax quantization in plain torch.

`wire.codecs.codec` (dense frames), `wire.codecs.sparse` (top-k bodies) and `wire.frames` build on these;
nothing here knows a frame layout.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import torch

from p2p_diloco.config import Codec  # noqa: F401 - the codecs of `[wire] codec`, re-exported
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import fused
from p2p_diloco.protocol.kernels import Scratch, scale_blocks, scratch  # noqa: F401 (scale_blocks re-exported)

# Reason tags of DecodeError (shared with `wire.frames`).
TRUNCATED = "truncated"
OVERSIZED = "oversized"
BAD_MAGIC = "bad magic"
UNSUPPORTED_VERSION = "unsupported version"
UNKNOWN_CODEC = "unknown codec"
BAD_HEADER = "bad header"
WRONG_SHAPE = "wrong shape"
UNEXPECTED_TENSOR = "unexpected tensor"
MISSING_TENSOR = "missing tensor"
NON_FINITE = "non-finite"
TRAILING_BYTES = "trailing bytes"


# bitsandbytes' default signed dynamic map (create_dynamic_map(signed=True)), as float32 bit patterns.
# Fixed bits rather than recomputed, so the table never depends on a torch version's linspace rounding;
# tests/unit/test_codec.py checks it against bitsandbytes.
_CODE_TABLE_HEX = (
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf"
    "000053bf66664fbfcdcc4bbf333348bf9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbf"
    "cdcc27bf343324bf9a9920bf00001dbf666619bfcdcc15bf343312bf9a990ebf00000bbf666607bfcccc03bf333300bf"
    "3233f9be0000f2becccceabe9a99e3be6666dcbe3333d5be0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabe"
    "cccca2be9a999bbe666694be34338dbe000086be99997dbe33336fbecdcc60be666652be000044be9a9935be333327be"
    "cdcc18be66660abe0000f8bd3433dbbd85ebc9bdf728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd2a5ca7bd9a99a1bd"
    "0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd5d8f72bd3d0a67bd1f855bbd000050bde17a44bdc3f538bd"
    "a3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc"
    "643b1fbc180416bccdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb0d02abbb749398bbdd2486bb8a6c67bb"
    "5c8f42bb2db21dbbfca9f1ba9defa7baff6577ba3ee859ba806a3cbac1ec1eba016f01ba83e2c7b905e78cb90bd723b9"
    "4b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6b7a313b500000000b7a31335941a5a36ff0502370642b237"
    "34803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a806a3c3a3ee8593aff65773a9defa73a"
    "fca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b6abcf43b8195033c"
    "cdcc0c3c1804163c643b1f3c48e13a3cc3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d"
    "6766163d85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d5d8f723d7b147e3dcdcc843d5d8f8a3d"
    "eb51903d7b14963d0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d"
    "0000f83d66660a3ecdcc183e3333273e9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e"
    "6666943e9a999b3ecccca23e0000aa3e3333b13e6666b83e9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33e"
    "ccccea3e0000f23e3233f93e3333003fcccc033f6666073f00000b3f9a990e3f3433123fcdcc153f6666193f00001d3f"
    "9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f3433363fcdcc393f66663d3f0000413f9a99443f3333483f"
    "cdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f0000653f9a99683f33336c3fcdcc6f3f6666733f"
    "0000773f9a997a3f33337e3f0000803f"
)
CODE_TABLE = torch.from_numpy(np.frombuffer(bytes.fromhex(_CODE_TABLE_HEX), dtype="<f4").astype(np.float32))
CODE_TABLE.requires_grad_(False)


class ByteReader:
    """Bounds-checked cursor over a frame: every read first proves the bytes exist and fit the limit."""

    def __init__(self, view: memoryview, max_bytes: int):
        self.view = view
        self.pos = 0
        self.max_bytes = max_bytes

    def claim(self, nbytes: int, what: str) -> int:
        """Reserve `nbytes` at the cursor; returns their start offset and advances."""
        end = self.pos + nbytes
        if end > self.max_bytes:
            raise DecodeError(
                OVERSIZED, f"{what} claims {nbytes} bytes at offset {self.pos}, limit {self.max_bytes}"
            )
        if end > len(self.view):
            raise DecodeError(
                TRUNCATED, f"{what} needs {nbytes} bytes at offset {self.pos}, frame has {len(self.view)}"
            )
        start, self.pos = self.pos, end
        return start

    def unpack(self, layout: struct.Struct, what: str) -> tuple:
        return layout.unpack_from(self.view, self.claim(layout.size, what))

    def take(self, nbytes: int, what: str) -> bytes:
        start = self.claim(nbytes, what)
        return bytes(self.view[start : start + nbytes])

    def expect_magic(self, magic: bytes, what: str) -> None:
        got = self.take(len(magic), f"{what} magic")
        if got != magic:
            raise DecodeError(BAD_MAGIC, f"expected {what} magic {magic!r}, got {got!r}")


def byte_view(data: object) -> memoryview:
    """A flat byte view of bytes-like `data`; anything else is a DecodeError, never a TypeError."""
    try:
        return memoryview(data).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise DecodeError(BAD_HEADER, f"expected bytes, got {type(data).__name__}") from exc


def all_finite(t: torch.Tensor) -> bool:
    # A finite sum proves every element finite (NaN/inf propagate); only an overflowing sum needs the full
    # scan.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


_CODE_BOUNDS = (CODE_TABLE[:-1] + CODE_TABLE[1:]) / 2


def quantize_blockwise_cpu(
    flat: torch.Tensor, block_size: int, bounds: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' blockwise quantization (its pure-torch reference kernel: absmax per block, nearest
    code by the midpoints of the sorted table) for CPU tensors. Used instead of bitsandbytes on the CPU:
    importing bitsandbytes costs 4-7 s and ~115 MiB per peer, and its CPU call ~12 ms whatever the size.
    tests/unit/test_codec.py checks it against bitsandbytes' CPU kernel. `bounds` (the midpoints of another
    sorted code table, e.g. `wire.codecs.sparse`'s 4-bit one) defaults to those of `CODE_TABLE`.

    Runs CACHE_ELEMENTS values at a time through work buffers kept from call to call
    (`protocol.kernels.scratch`: a fresh temporary per kernel would cost a page fault per 4 KiB); a short
    last block is quantized on its own, exactly as if zero-padded (zeros change neither its absmax nor its
    other codes)."""
    n = flat.numel()
    full = n // block_size
    bounds = _CODE_BOUNDS if bounds is None else bounds
    absmax = torch.empty(-(-n // block_size), dtype=flat.dtype)
    codes = torch.empty(n, dtype=torch.uint8)
    if fused.active() and flat.dtype == torch.float32 and flat.device.type == "cpu":
        table = _lut(bounds)
        if table is not None:  # one pass per block in C: the same float32 operations and table lookups
            counts, padded = _lut_u8(table)
            fused.quantize(flat.contiguous(), block_size, counts, padded, CLAMP_MIN, codes, absmax)
            return codes, absmax
    step = max(1, CACHE_ELEMENTS // block_size)  # whole blocks at a time: temporaries stay in cache
    blocks = flat[: full * block_size].reshape(full, block_size)
    with scratch() as buffers:
        work = _Work(min(step * block_size, max(n, 1)), flat.dtype, buffers)
        for first in range(0, full, step):
            part = blocks[first : first + step]
            _quantize_part(
                part, absmax[first : first + part.shape[0]], codes[first * block_size :], bounds, work
            )
        if full * block_size < n:
            tail = flat[full * block_size :].reshape(1, -1)
            _quantize_part(tail, absmax[full:], codes[full * block_size :], bounds, work)
    return codes, absmax


@functools.cache
def zero_code() -> int:
    """The code `quantize_blockwise_cpu` gives every value of an all-zero block (absmax 0)."""
    codes, _ = quantize_blockwise_cpu(torch.zeros(1), 1)
    return int(codes[0])


def zero_blocks_as_cpu(codes: np.ndarray, absmax: np.ndarray, block_size: int) -> None:
    """Give the all-zero blocks of bitsandbytes' `codes` (in place) the CPU kernel's zero code.

    bitsandbytes divides by an absmax of 0 where the CPU kernel clamps it (`CLAMP_MIN`), so its codes for
    an all-zero block differ from the CPU's (127 steps apart, measured on an H200:
    docs/results/gpu/). Both decode to zeros; this makes the frames equal byte for byte.
    """
    zero = absmax == 0
    if zero.any():
        codes[np.repeat(zero, block_size)[: codes.size]] = zero_code()


class _Work:
    """Work buffers for `capacity` values, reused chunk after chunk (from `buffers` when given)."""

    def __init__(self, capacity: int, dtype: torch.dtype, buffers: Scratch | None = None):
        get = (buffers or Scratch()).get
        self.values = get("quantize.values", capacity, dtype)
        self.index = get("quantize.index", capacity, torch.int32)
        self.below = get("quantize.below", capacity, torch.int32)
        self.bound = get("quantize.bound", capacity, torch.float32)
        self.above = get("quantize.above", capacity, torch.bool)


def _quantize_part(
    part: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor, bounds: torch.Tensor, work: _Work
) -> None:
    """Blocks `part` (rows) -> their absmax and, from the start of `codes`, their codes."""
    size = part.numel()
    values = work.values[:size].view(part.shape)
    torch.abs(part, out=values)
    torch.amax(values, dim=1, out=absmax)
    torch.mul(part, (1.0 / absmax.clamp(min=CLAMP_MIN)).view(-1, 1), out=values)
    # No clamp to [-1, 1]: x * (1/absmax) exceeds 1 in magnitude by at most two ulps, which shares 1.0's
    # 16-bit prefix and lies beyond every bound, so its code is that of ±1 either way (tested).
    nearest_codes(values.view(-1), bounds, out=codes[:size], work=work)


CACHE_ELEMENTS = 1 << 18  # values quantized per pass (1 MiB of float32)
# The smallest absmax a block is scaled by, as float32 (torch.clamp rounds the Python float to float32
# the same way), so an all-zero block gets finite codes.
CLAMP_MIN = float(torch.tensor(1e-38, dtype=torch.float32))
_LUTS: dict[tuple[str, bytes], tuple[torch.Tensor, torch.Tensor] | None] = {}
_LUTS_U8: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _lut_u8(table: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`_lut`'s table with its counts as uint8 (at most 255 bounds: 64 KiB instead of 256 KiB, which stays
    in a core's L2 cache), for the C quantizer; cached beside it."""
    key = id(table[0])  # `_LUTS` keeps its tables for the life of the process, so ids are never reused
    if key not in _LUTS_U8:
        counts, padded = table
        if int(counts.max()) > 255:
            raise ValueError("a code table of more than 256 codes")
        _LUTS_U8[key] = (counts.to(torch.uint8).contiguous(), padded.contiguous())
    return _LUTS_U8[key]


def _lut(bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For sorted `bounds`: per 16-bit prefix of a float32 (sign, exponent, 7 mantissa bits), how many
    bounds lie below the smallest value with that prefix, and the bounds padded with +inf. None if some
    prefix's range inside [-1, 1] holds two bounds (then one comparison would not settle a code)."""
    key = (str(bounds.dtype), bounds.detach().cpu().contiguous().numpy().tobytes())  # exact, ~1 µs
    if key not in _LUTS:
        b32 = bounds.to(torch.float32).contiguous()
        prefix = np.arange(1 << 16, dtype=np.uint32)
        low = (prefix << 16).view(np.float32)
        high = ((prefix << 16) | 0xFFFF).view(np.float32)
        lo = torch.from_numpy(np.minimum(low, high).copy())
        hi = torch.from_numpy(np.maximum(low, high).copy())
        count_lo = torch.bucketize(lo, b32)
        count_hi = torch.bucketize(hi.clamp(-1.0, 1.0), b32)
        inside = torch.isfinite(lo) & (lo <= 1.0) & (hi >= -1.0)
        exact = bool(((count_hi - count_lo)[inside] <= 1).all())
        padded = torch.cat([b32, torch.tensor([float("inf")])])
        _LUTS[key] = (count_lo.to(torch.int32), padded) if exact else None
    return _LUTS[key]


def nearest_codes(
    scaled: torch.Tensor, bounds: torch.Tensor, *, out: torch.Tensor | None = None, work: _Work | None = None
) -> torch.Tensor:
    """`torch.bucketize(scaled, bounds)` as uint8 (the number of bounds below each value) for float32 values
    in [-1, 1], bit for bit, about 6x faster: a table lookup on the value's top 16 bits, then one comparison
    with the single bound that can fall inside that prefix's range (`_lut` checks there is at most one).
    `out`: a uint8 tensor of the same size to write to; `work`: scratch buffers at least that large."""
    table = _lut(bounds) if scaled.dtype == torch.float32 else None
    if out is None:
        out = torch.empty(scaled.numel(), dtype=torch.uint8)
    if table is None:
        return out.copy_(torch.bucketize(scaled, bounds, out_int32=True).view(-1)).view(scaled.shape)
    counts, padded = table
    n = scaled.numel()
    work = work if work is not None else _Work(n, torch.float32)
    prefix, below, bound, above = work.index[:n], work.below[:n], work.bound[:n], work.above[:n]
    torch.bitwise_right_shift(scaled.contiguous().view(torch.int32).view(-1), 16, out=prefix)
    prefix.bitwise_and_(0xFFFF)
    torch.index_select(counts, 0, prefix, out=below)  # ~5x faster than `counts[prefix]`, the same gather
    torch.index_select(padded, 0, below, out=bound)
    torch.gt(scaled.reshape(-1), bound, out=above)
    return torch.add(below, above, out=out.view(-1)).view(scaled.shape)  # codes <= 255: exact in uint8
