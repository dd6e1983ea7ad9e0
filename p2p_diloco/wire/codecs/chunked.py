"""Chunked top-k bodies in SparseLoCo's layout: codecs "topk4k-int2", "topk4k-int4" and "topk4k-int8",
the body of a `wire.codecs.codec` chunked frame (whose head, tensor count, block size and table digest, is
`wire.codecs.codec`'s: the frame names no tensors, the receiver knows them).

Each flattened tensor, in the frame's (name) order, is cut into chunks of `CHUNK` = 4096 entries, the
last one shorter when the size is not a multiple; every full chunk keeps `keep_full` entries of largest
magnitude and a short last chunk of r entries `short_keep(r, keep_full)` = ceil(keep_full x r / 4096)
(at least 1); the rest stays in the sender's error feedback. Chunk-local offsets fit 12 bits. One body
covers all tensors of the frame, integers little-endian::

    keep_full u16 | offsets: 12 bits each (`wire.codecs.bitpack.pack12`), ceil(3K / 2) bytes | scales | codes

with K the kept entries of all tensors, offsets tensor after tensor and chunk after chunk, strictly
increasing within a chunk; scales tensor after tensor; codes in one stream of K. Each tensor's kept values
are quantized in blocks of the block size over its own kept values (a block never spans two tensors, whose
magnitudes may differ by orders):

- int8: absmax f32 per block, codes u8 (`CODE_TABLE`, as the dense int8 codec);
- int4 and int2: per block 8 or 2 magnitude levels f32 (`wire.codecs.levels`: non-negative, non-decreasing,
  fitted to the block's magnitudes), codes 4-bit two a byte or 2-bit four a byte (`wire.codecs.bitpack`), each
  a sign bit (the highest; set: negative) and a level index.

Decoding is deterministic: a table lookup and one float32 multiply by the absmax (int8), or a copy of a
level and an exact negation (int4, int2), then a scatter into zeros at distinct indices. The decoder
checks keep_full (1..4096) before claiming anything, then offsets (in range, strictly increasing in
their chunk), padding bits and scales, and raises only `DecodeError` (tags of `wire.codecs.blockwise`,
`wire.codecs.sparse.SparseReason` and `wire.codecs.bitpack.PackReason`).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.union_merge import SparseTensor
from p2p_diloco.wire.codecs.bitpack import (
    pack12,
    pack_codes,
    packed12_size,
    packed_codes_size,
    unpack12,
    unpack_codes,
)
from p2p_diloco.wire.codecs.blockwise import (
    BAD_HEADER,
    CODE_TABLE,
    MISSING_TENSOR,
    NON_FINITE,
    UNEXPECTED_TENSOR,
    WRONG_SHAPE,
    ByteReader,
    Codec,
    all_finite,
    quantize_blockwise_cpu,
    scale_blocks,
)
from p2p_diloco.wire.codecs.levels import check_levels, dequantize_levels, level_count, quantize_levels
from p2p_diloco.wire.codecs.sparse import SparseReason, chunk_keep, top_offsets

CHUNK = 4096  # chunk-local offsets fit 12 bits
VALUE_BITS = {Codec.TOPK4K_INT2: 2, Codec.TOPK4K_INT4: 4, Codec.TOPK4K_INT8: 8}
_KEEP = struct.Struct("<H")
_U32 = struct.Struct("<I")
TABLE_DIGEST_BYTES = 8
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # as `wire.codecs.codec.BLOCK_SIZES`


def table_digest(shapes: Mapping[str, tuple[int, ...]]) -> bytes:
    """What a chunked frame sends instead of its tensors' names and shapes: a digest of them, in name
    order."""
    table = [[name, [int(d) for d in shapes[name]]] for name in sorted(shapes)]
    raw = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.blake2b(raw, digest_size=TABLE_DIGEST_BYTES, person=b"PDTF-table").digest()


def short_keep(length: int, keep_full: int) -> int:
    """Entries kept of a short last chunk of `length` (0 < length < CHUNK): keep_full's share, at least 1."""
    return min(length, max(1, -(-keep_full * length // CHUNK)))


def _split(numel: int, keep_full: int) -> tuple[int, int, int]:
    """(full chunks, last chunk's length, its keep) of a tensor of `numel` entries."""
    full, rest = divmod(numel, CHUNK)
    return full, rest, short_keep(rest, keep_full) if rest else 0


def _kept(numel: int, keep_full: int) -> int:
    full, _, keep_last = _split(numel, keep_full)
    return full * keep_full + keep_last


def _scales_per_block(bits: int) -> int:
    """float32 scales a block of values sends: its absmax (int8) or its levels (2 and 4 bits)."""
    return 1 if bits == 8 else level_count(bits)


def _scale_bytes(kept: int, bits: int, block_size: int) -> int:
    return 4 * _scales_per_block(bits) * (-(-kept // block_size))


def _size(kept: Sequence[int], bits: int, block_size: int) -> int:
    k, scales = sum(kept), sum(_scale_bytes(n, bits, block_size) for n in kept)
    return _KEEP.size + packed12_size(k) + scales + packed_codes_size(k, bits)


def bodies_size(numels: Sequence[int], *, codec: Codec, density: float, block_size: int) -> int:
    """Exact byte length of `encode_bodies` for tensors of these element counts."""
    keep_full = chunk_keep(CHUNK, density)
    return _size([_kept(n, keep_full) for n in numels], VALUE_BITS[codec], block_size)


def _quantize(values: torch.Tensor, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales, codes) of one tensor's kept values."""
    if bits == 8:
        codes_t, absmax = quantize_blockwise_cpu(values, block_size)
        return absmax.numpy().reshape(-1), codes_t.numpy()
    levels, codes = quantize_levels(values, block_size, bits)
    return levels.reshape(-1), codes


def _select(flat: torch.Tensor, keep_full: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk-local offsets, values) of one flattened float32 tensor's kept entries, chunk after chunk."""
    full, rest, keep_last = _split(flat.numel(), keep_full)
    parts, counts = [], []
    if full:
        parts.append(top_offsets(flat[: full * CHUNK].abs().view(full, CHUNK), keep_full).reshape(-1))
        counts += [keep_full] * full
    if rest:
        parts.append(top_offsets(flat[full * CHUNK :].abs().view(1, -1), keep_last).reshape(-1))
        counts.append(keep_last)
    if not parts:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, torch.zeros(0, dtype=torch.float32)
    offsets = torch.cat(parts)
    starts = torch.arange(len(counts), device=flat.device) * CHUNK
    base = torch.repeat_interleave(starts, torch.tensor(counts, device=flat.device, dtype=torch.int64))
    return offsets.cpu(), flat[base + offsets].cpu()


def encode_bodies(tensors: Sequence[torch.Tensor], *, codec: Codec, density: float, block_size: int) -> bytes:
    """The chunked body of `tensors` in this order (any float dtype and device; selection runs there)."""
    keep_full, bits = chunk_keep(CHUNK, density), VALUE_BITS[codec]
    offsets, scales, codes = [np.zeros(0, np.int64)], [np.zeros(0, "<f4")], [np.zeros(0, np.uint8)]
    finite = True
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        finite = finite and all_finite(flat)
        index, values = _select(flat, keep_full)
        scale, code = _quantize(values.contiguous(), bits, block_size)
        offsets.append(index.numpy())
        scales.append(np.asarray(scale, dtype="<f4"))
        codes.append(np.asarray(code, dtype=np.uint8))
    scale_bytes = np.ascontiguousarray(np.concatenate(scales), dtype="<f4")
    if not finite:  # mark the frame so receivers reject it, as the dense int8 path does
        scale_bytes = np.full_like(scale_bytes, np.nan)
    packed = (pack12(np.concatenate(offsets)), scale_bytes.tobytes(), pack_codes(np.concatenate(codes), bits))
    return _KEEP.pack(keep_full) + b"".join(packed)


@dataclass(frozen=True)
class ChunkedLayout:
    """Where a frame's chunked body lies, as `claim_bodies` proved it fits: per tensor (full chunks, last
    chunk's length, its keep)."""

    keep_full: int
    splits: tuple[tuple[int, int, int], ...]
    offsets_at: int
    scales_at: int
    codes_at: int

    def kept_of(self, i: int) -> int:
        full, _, keep_last = self.splits[i]
        return full * self.keep_full + keep_last

    @property
    def kept(self) -> int:
        return sum(self.kept_of(i) for i in range(len(self.splits)))


def claim_bodies(reader: ByteReader, numels: Sequence[int], codec: Codec, block_size: int) -> ChunkedLayout:
    """Read keep_full, check it, then claim the body of tensors of these element counts."""
    (keep_full,) = reader.unpack(_KEEP, "keep count")
    if not 1 <= keep_full <= CHUNK:
        raise DecodeError(SparseReason.BAD_COUNT, f"keeps {keep_full} per full chunk, not 1..{CHUNK}")
    splits = tuple(_split(n, keep_full) for n in numels)
    kept, bits = [f * keep_full + last for f, _, last in splits], VALUE_BITS[codec]
    k = sum(kept)
    offsets_at = reader.claim(packed12_size(k), "offsets")  # bounds k before any allocation
    scales_at = reader.claim(sum(_scale_bytes(n, bits, block_size) for n in kept), "scales")
    codes_at = reader.claim(packed_codes_size(k, bits), "codes")
    return ChunkedLayout(keep_full, splits, offsets_at, scales_at, codes_at)


def _indices(offsets: np.ndarray, name: str, keep_full: int, split: tuple[int, int, int]) -> np.ndarray:
    """Flat int64 indices of one tensor's kept entries, checked: in their chunk, strictly increasing in it."""
    full, rest, _ = split
    head = offsets[: full * keep_full].reshape(full, keep_full)
    tail = offsets[full * keep_full :]
    if tail.size and int(tail.max()) >= rest:
        raise DecodeError(SparseReason.BAD_INDEX, f"{name!r} has an offset past its last chunk ({rest})")
    if (head.shape[1] > 1 and not bool((np.diff(head, axis=1) > 0).all())) or (
        tail.size > 1 and not bool((np.diff(tail) > 0).all())
    ):
        raise DecodeError(SparseReason.BAD_INDEX, f"{name!r} has offsets not strictly increasing in a chunk")
    head = head + (np.arange(full, dtype=np.int64) * CHUNK)[:, None]
    return np.concatenate([head.reshape(-1), tail + full * CHUNK])


def _values(
    view: memoryview, name: str, scales_at: int, codes: np.ndarray, codec: Codec, block_size: int
) -> torch.Tensor:
    """One tensor's kept values from its scales at `scales_at` and its codes."""
    bits, k = VALUE_BITS[codec], codes.size
    width = _scales_per_block(bits)
    scales = np.frombuffer(view, "<f4", -(-k // block_size) * width, scales_at).astype(np.float32)
    if bits == 8:
        if not np.isfinite(scales).all():
            raise DecodeError(NON_FINITE, f"tensor {name!r} has a non-finite block absmax")
        if bool((scales < 0).any()):
            raise DecodeError(BAD_HEADER, f"tensor {name!r} has a negative block absmax")
    else:
        check_levels(scales.reshape(-1, width), name)
    if bits == 8:
        values = torch.index_select(CODE_TABLE, 0, torch.from_numpy(codes))
        return scale_blocks(values, torch.from_numpy(scales), block_size)
    return dequantize_levels(scales.reshape(-1, width), codes, block_size, bits)


def decode_bodies(
    view: memoryview,
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    layout: ChunkedLayout,
    codec: Codec,
    block_size: int,
) -> list[SparseTensor]:
    """The kept entries of a claimed chunked body, per tensor: flat indices and float32 values."""
    k, bits = layout.kept, VALUE_BITS[codec]
    offsets = unpack12(view, layout.offsets_at, k, "offsets")
    codes = unpack_codes(view, layout.codes_at, k, bits, "codes")
    out, at, scales_at = [], 0, layout.scales_at
    for i, (name, shape) in enumerate(zip(names, shapes)):
        n = layout.kept_of(i)
        index = _indices(offsets[at : at + n], name, layout.keep_full, layout.splits[i])
        values = _values(view, name, scales_at, codes[at : at + n], codec, block_size)
        out.append(SparseTensor(shape, torch.from_numpy(index), values))
        at, scales_at = at + n, scales_at + _scale_bytes(n, bits, block_size)
    return out


# --- the frame's part after `wire.codecs.codec`'s head: block size u32 | table digest | body (name order) ---
def encode_frame(
    tensors: Mapping[str, torch.Tensor], *, codec: Codec, density: float, block_size: int
) -> bytes:
    names = sorted(tensors)
    digest = table_digest({name: tuple(tensors[name].shape) for name in names})
    body = encode_bodies([tensors[n] for n in names], codec=codec, density=density, block_size=block_size)
    return b"".join((_U32.pack(block_size), digest, body))


def frame_size(
    shapes: Mapping[str, tuple[int, ...]], *, codec: Codec, density: float, block_size: int
) -> int:
    numels = [math.prod(shape) for shape in shapes.values()]
    return (
        _U32.size
        + TABLE_DIGEST_BYTES
        + bodies_size(numels, codec=codec, density=density, block_size=block_size)
    )


@dataclass(frozen=True)
class ChunkedFrame:
    """A chunked frame's tensors (name order) and body, every size checked and claimed."""

    codec: Codec
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    block_size: int
    layout: ChunkedLayout
    order: tuple[str, ...]  # the receiver's order of the names, in which `decode` hands them over

    def decode(self, view: memoryview) -> dict[str, SparseTensor]:
        """The kept entries per tensor."""
        decoded = decode_bodies(view, self.names, self.shapes, self.layout, self.codec, self.block_size)
        by_name = dict(zip(self.names, decoded))
        return {name: by_name[name] for name in self.order}


def read_frame(
    reader: ByteReader, codec: Codec, count: int, expected_shapes: Mapping[str, tuple[int, ...]] | None
) -> ChunkedFrame:
    """The rest of a chunked frame, which only the expected names and shapes describe."""
    if expected_shapes is None:
        raise DecodeError(BAD_HEADER, f"a {codec} frame names no tensors: decode it with expected_shapes")
    if count != len(expected_shapes):
        reason = MISSING_TENSOR if count < len(expected_shapes) else UNEXPECTED_TENSOR
        raise DecodeError(reason, f"{codec} frame holds {count} tensors, expected {len(expected_shapes)}")
    (block,) = reader.unpack(_U32, "block size")
    if block not in BLOCK_SIZES:
        raise DecodeError(BAD_HEADER, f"block size {block}, not one of {BLOCK_SIZES}")
    shapes = {name: tuple(int(d) for d in expected_shapes[name]) for name in sorted(expected_shapes)}
    if reader.take(TABLE_DIGEST_BYTES, "table digest") != table_digest(shapes):
        raise DecodeError(WRONG_SHAPE, "the frame's names and shapes are not the expected ones")
    layout = claim_bodies(reader, [math.prod(shape) for shape in shapes.values()], codec, block)
    return ChunkedFrame(codec, tuple(shapes), tuple(shapes.values()), block, layout, tuple(expected_shapes))
