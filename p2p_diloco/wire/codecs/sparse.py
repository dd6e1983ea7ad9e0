"""Sparse top-k tensor bodies: codecs "topk-int8" and "topk-int4" inside `wire.codecs.codec` frames.

This module owns the body of one tensor entry of a sparse frame (the entry head, name, dtype, shape
and block size, is `wire.codecs.codec`'s). The tensor is cut into chunks of `CHUNK` = 65536 elements (the
last may be shorter); per chunk only the `chunk_keep(len, density)` entries of largest magnitude are
sent, the rest stays in the sender's error feedback. All integers little-endian::

    counts u32 * ceil(numel / CHUNK) | offsets u16 * k (chunk-local, strictly increasing in a chunk) |
    absmax f32 * ceil(k / block) | codes: topk-int8 u8 * k, topk-int4 ceil(k / 2) bytes (two 4-bit
    codes a byte, low nibble first; an odd count leaves the last high nibble 0)

where k = sum(counts). Values are quantized blockwise over the k kept values in frame order: int8
with `CODE_TABLE`, 4-bit with `INT4_TABLE` (sign and 8 magnitudes 1/8..1 of the block absmax: kept
values are the largest, so no code is spent on zero). Decoding is deterministic: a table lookup,
exactly one float32 multiply by the block absmax, then a scatter into zeros at distinct indices.
The decoder checks counts against the chunk lengths before claiming anything, then indices (in range,
strictly increasing), padding and absmax, and raises only `DecodeError` (tags of `wire.codecs.blockwise`
and `SparseReason`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.union_merge import SparseTensor
from p2p_diloco.wire.codecs.bitpack import PackReason, pack_codes, unpack_codes
from p2p_diloco.wire.codecs.blockwise import (
    BAD_HEADER,
    CODE_TABLE,
    NON_FINITE,
    ByteReader,
    Codec,
    all_finite,
    quantize_blockwise_cpu,
    scale_blocks,
)

CHUNK = 65536  # chunk-local offsets fit u16
DEFAULT_DENSITY = 0.03
INT4_TABLE = torch.tensor(
    [-(8 - i) / 8 for i in range(8)] + [(i + 1) / 8 for i in range(8)], dtype=torch.float32
)
INT4_BOUNDS = (INT4_TABLE[:-1] + INT4_TABLE[1:]) / 2


class SparseReason(StrEnum):
    """DecodeError reason tags only sparse bodies raise."""

    BAD_COUNT = "bad count"  # a chunk claims more kept entries than it has elements
    BAD_INDEX = "bad index"  # an offset out of its chunk, or not strictly increasing
    BAD_PADDING = PackReason.BAD_PADDING  # the unused high nibble of an odd 4-bit code count is not 0


def check_density(density: float) -> None:
    """ValueError unless 0 < density <= 1."""
    if isinstance(density, bool) or not (isinstance(density, int | float) and 0.0 < density <= 1.0):
        raise ValueError(f"sparse density must be in (0, 1], got {density!r}")


def chunk_lengths(numel: int) -> list[int]:
    full, rest = divmod(numel, CHUNK)
    return [CHUNK] * full + ([rest] if rest else [])


def chunk_keep(length: int, density: float) -> int:
    """Entries kept of a chunk of `length`: ceil(density x length), at least 1, at most `length`."""
    return min(length, max(1, math.ceil(density * length)))


def body_size(numel: int, *, codec: Codec, density: float, block_size: int) -> int:
    """Exact byte length of `encode_body` for a tensor of `numel` elements."""
    lengths = chunk_lengths(numel)
    k = sum(chunk_keep(n, density) for n in lengths)
    codes = k if codec == Codec.TOPK_INT8 else -(-k // 2)
    return 4 * len(lengths) + 2 * k + 4 * (-(-k // block_size)) + codes


def top_offsets(mags: torch.Tensor, keep: int) -> torch.Tensor:
    """Sorted chunk-local offsets of the `keep` largest of each row of `mags`."""
    return torch.topk(mags, keep, dim=1, sorted=False).indices.sort(dim=1).values


def encode_body(tensor: torch.Tensor, *, codec: Codec, density: float, block_size: int) -> bytes:
    """The sparse body of one tensor (any float dtype and device); selection runs on its device."""
    flat = tensor.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    lengths = chunk_lengths(n)
    if not lengths:
        return b""
    full = n // CHUNK
    parts = []
    if full:
        parts.append(top_offsets(flat[: full * CHUNK].abs().view(full, CHUNK), chunk_keep(CHUNK, density)))
    if n % CHUNK:
        parts.append(top_offsets(flat[full * CHUNK :].abs().view(1, -1), chunk_keep(n % CHUNK, density)))
    counts = [chunk_keep(length, density) for length in lengths]
    offsets = torch.cat([p.reshape(-1) for p in parts])
    base = torch.repeat_interleave(
        torch.arange(len(lengths), device=flat.device) * CHUNK,
        torch.tensor(counts, device=flat.device),
    )
    values = flat[base + offsets].cpu()
    bounds = None if codec == Codec.TOPK_INT8 else INT4_BOUNDS
    codes, absmax = quantize_blockwise_cpu(values, block_size, bounds)
    absmax_np = absmax.numpy().astype("<f4")
    if not all_finite(flat):  # mark the tensor so receivers reject it, as the dense int8 path does
        absmax_np = np.full_like(absmax_np, np.nan)
    return b"".join(
        (
            np.asarray(counts, dtype="<u4").tobytes(),
            offsets.cpu().numpy().astype("<u2").tobytes(),
            absmax_np.tobytes(),
            pack_codes(codes.numpy(), 8 if codec == Codec.TOPK_INT8 else 4),
        )
    )


@dataclass(frozen=True)
class SparseLayout:
    """Where one tensor's sparse body lies in the frame, as `claim_body` proved it fits."""

    counts: tuple[int, ...]
    kept: int
    offsets_at: int
    absmax_at: int
    codes_at: int


def claim_body(reader: ByteReader, name: str, numel: int, codec: Codec, block_size: int) -> SparseLayout:
    """Read the chunk counts, check them against the chunk lengths, then claim the rest of the body."""
    n_chunks = -(-numel // CHUNK)
    at = reader.claim(4 * n_chunks, f"chunk counts of {name!r}")  # bounds n_chunks before any allocation
    lengths = chunk_lengths(numel)
    counts = np.frombuffer(reader.view, "<u4", n_chunks, at).astype(np.int64)
    over = np.flatnonzero(counts > np.asarray(lengths, dtype=np.int64))
    if over.size:
        i = int(over[0])
        raise DecodeError(
            SparseReason.BAD_COUNT, f"chunk {i} of {name!r} keeps {int(counts[i])} of {lengths[i]} entries"
        )
    kept = int(counts.sum())
    offsets_at = reader.claim(2 * kept, f"offsets of {name!r}")
    absmax_at = reader.claim(4 * (-(-kept // block_size)), f"absmax of {name!r}")
    codes_at = reader.claim(kept if codec == Codec.TOPK_INT8 else -(-kept // 2), f"codes of {name!r}")
    return SparseLayout(tuple(int(c) for c in counts), kept, offsets_at, absmax_at, codes_at)


def decode_sparse(
    view: memoryview, name: str, shape: tuple[int, ...], layout: SparseLayout, codec: Codec, block_size: int
) -> SparseTensor:
    """The kept entries of a claimed sparse body: flat indices and float32 values."""
    numel = math.prod(shape)
    k = layout.kept
    if k == 0:
        return SparseTensor(shape, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32))
    offsets = np.frombuffer(view, "<u2", k, layout.offsets_at).astype(np.int64)
    chunk_of = np.repeat(np.arange(len(layout.counts), dtype=np.int64), layout.counts)
    index = chunk_of * CHUNK + offsets
    if int(index.max()) >= numel:
        raise DecodeError(SparseReason.BAD_INDEX, f"{name!r} has an offset past its last chunk ({numel})")
    # Offsets are < CHUNK, so global indices increase strictly iff offsets do within every chunk.
    if k > 1 and not bool((np.diff(index) > 0).all()):
        raise DecodeError(SparseReason.BAD_INDEX, f"{name!r} has offsets not strictly increasing in a chunk")
    absmax = torch.from_numpy(
        np.frombuffer(view, "<f4", -(-k // block_size), layout.absmax_at).astype(np.float32)
    )
    if not bool(torch.isfinite(absmax).all()):
        raise DecodeError(NON_FINITE, f"tensor {name!r} has a non-finite block absmax")
    if bool((absmax < 0).any()):
        raise DecodeError(BAD_HEADER, f"tensor {name!r} has a negative block absmax")
    int8 = codec == Codec.TOPK_INT8
    codes = unpack_codes(view, layout.codes_at, k, 8 if int8 else 4, f"{name!r}: odd 4-bit code count")
    table = CODE_TABLE if int8 else INT4_TABLE
    values = scale_blocks(torch.index_select(table, 0, torch.from_numpy(codes)), absmax, block_size)
    return SparseTensor(shape, torch.from_numpy(index), values)


def decode_body(
    view: memoryview, name: str, shape: tuple[int, ...], layout: SparseLayout, codec: Codec, block_size: int
) -> torch.Tensor:
    """The dense float32 tensor of a claimed sparse body; zeros where nothing was kept."""
    return decode_sparse(view, name, shape, layout, codec, block_size).to_dense()
