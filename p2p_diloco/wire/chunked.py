"""Chunked top-k tensor bodies in SparseLoCo's layout: codecs "topk4k-int2", "topk4k-int4" and
"topk4k-int8" inside `wire.codec` frames (the entry head, name, dtype, shape and block size, is
`wire.codec`'s).

The flattened tensor is cut into chunks of `CHUNK` = 4096 entries, the last one shorter when the size is
not a multiple; every full chunk keeps `chunk_keep(4096, density)` entries of largest magnitude, the short
last chunk `chunk_keep(its length, density)`; the rest stays in the sender's error feedback. Chunk-local
offsets fit 12 bits. All integers little-endian::

    keep_full u16 | keep_last u16 | offsets: 12 bits each (`wire.bitpack.pack12`), ceil(3k / 2) bytes |
    scales | codes

with k = full chunks x keep_full + keep_last, offsets chunk after chunk, strictly increasing within a
chunk. Values are quantized in blocks of the entry's block size over the k kept values in frame order:

- int8: absmax f32 per block, codes u8 (`CODE_TABLE`, as the dense int8 codec);
- int4 and int2: per block 8 or 2 magnitude levels f32 (`wire.levels`: non-negative, non-decreasing,
  fitted to the block's magnitudes), codes 4-bit two a byte or 2-bit four a byte (`wire.bitpack`), each a
  sign bit (the highest; set: negative) and a level index.

Decoding is deterministic: a table lookup and one float32 multiply by the absmax (int8), or a copy of a
level and an exact negation (int4, int2), then a scatter into zeros at distinct indices. The decoder
checks the keep counts against the chunk lengths before claiming anything, then offsets (in range,
strictly increasing in their chunk), padding bits and scales, and raises only `DecodeError`
(tags of `wire.blockwise`, `wire.sparse.SparseReason` and `wire.bitpack.PackReason`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.union_merge import SparseTensor
from p2p_diloco.wire.bitpack import (
    pack12,
    pack_codes,
    packed12_size,
    packed_codes_size,
    unpack12,
    unpack_codes,
)
from p2p_diloco.wire.blockwise import (
    BAD_HEADER,
    CODE_TABLE,
    NON_FINITE,
    ByteReader,
    Codec,
    all_finite,
    quantize_blockwise_cpu,
    scale_blocks,
)
from p2p_diloco.wire.levels import check_levels, dequantize_levels, level_count, quantize_levels
from p2p_diloco.wire.sparse import SparseReason, chunk_keep, top_offsets

CHUNK = 4096  # chunk-local offsets fit 12 bits
VALUE_BITS = {Codec.TOPK4K_INT2: 2, Codec.TOPK4K_INT4: 4, Codec.TOPK4K_INT8: 8}
_KEEPS = struct.Struct("<HH")


def _keeps(numel: int, density: float) -> tuple[int, int, int, int]:
    """(full chunks, keep per full chunk, last chunk's length, its keep)."""
    full, rest = divmod(numel, CHUNK)
    return full, chunk_keep(CHUNK, density) if full else 0, rest, chunk_keep(rest, density) if rest else 0


def _scales_per_block(bits: int) -> int:
    """float32 scales a block of values sends: its absmax (int8) or its levels (2 and 4 bits)."""
    return 1 if bits == 8 else level_count(bits)


def _scale_bytes(kept: int, bits: int, block_size: int) -> int:
    return 4 * _scales_per_block(bits) * (-(-kept // block_size))


def body_size(numel: int, *, codec: Codec, density: float, block_size: int) -> int:
    """Exact byte length of `encode_body` for a tensor of `numel` elements."""
    full, keep_full, _, keep_last = _keeps(numel, density)
    k, bits = full * keep_full + keep_last, VALUE_BITS[codec]
    return _KEEPS.size + packed12_size(k) + _scale_bytes(k, bits, block_size) + packed_codes_size(k, bits)


def encode_body(tensor: torch.Tensor, *, codec: Codec, density: float, block_size: int) -> bytes:
    """The chunked body of one tensor (any float dtype and device); selection runs on its device."""
    flat = tensor.detach().reshape(-1).to(torch.float32)
    full, keep_full, rest, keep_last = _keeps(flat.numel(), density)
    parts = []
    if full:
        parts.append(top_offsets(flat[: full * CHUNK].abs().view(full, CHUNK), keep_full).reshape(-1))
    if rest:
        parts.append(top_offsets(flat[full * CHUNK :].abs().view(1, -1), keep_last).reshape(-1))
    offsets = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=flat.device)
    base = torch.repeat_interleave(
        torch.arange(full + (1 if rest else 0), device=flat.device) * CHUNK,
        torch.tensor(
            [keep_full] * full + ([keep_last] if rest else []), device=flat.device, dtype=torch.int64
        ),
    )
    values = flat[base + offsets].cpu().contiguous()
    bits = VALUE_BITS[codec]
    if bits == 8:
        codes_t, absmax = quantize_blockwise_cpu(values, block_size)
        scales, codes = absmax.numpy(), codes_t.numpy()
    else:
        scales, codes = quantize_levels(values, block_size, bits)
    scales = np.ascontiguousarray(scales, dtype="<f4")
    if not all_finite(flat):  # mark the tensor so receivers reject it, as the dense int8 path does
        scales = np.full_like(scales, np.nan)
    return b"".join(
        (
            _KEEPS.pack(keep_full, keep_last),
            pack12(offsets.cpu().numpy()),
            scales.tobytes(),
            pack_codes(codes, bits),
        )
    )


@dataclass(frozen=True)
class ChunkedLayout:
    """Where one tensor's chunked body lies in the frame, as `claim_body` proved it fits."""

    full: int
    keep_full: int
    rest: int
    keep_last: int
    offsets_at: int
    scales_at: int
    codes_at: int

    @property
    def kept(self) -> int:
        return self.full * self.keep_full + self.keep_last


def claim_body(reader: ByteReader, name: str, numel: int, codec: Codec, block_size: int) -> ChunkedLayout:
    """Read the keep counts, check them against the chunk lengths, then claim the rest of the body."""
    keep_full, keep_last = reader.unpack(_KEEPS, f"keep counts of {name!r}")
    full, rest = divmod(numel, CHUNK)
    if keep_full > (CHUNK if full else 0) or keep_last > rest:
        raise DecodeError(
            SparseReason.BAD_COUNT,
            f"{name!r} keeps {keep_full} per full chunk ({full} of {CHUNK}) and {keep_last} of its last {rest}",
        )
    k, bits = full * keep_full + keep_last, VALUE_BITS[codec]
    offsets_at = reader.claim(packed12_size(k), f"offsets of {name!r}")  # bounds k before any allocation
    scales_at = reader.claim(_scale_bytes(k, bits, block_size), f"scales of {name!r}")
    codes_at = reader.claim(packed_codes_size(k, bits), f"codes of {name!r}")
    return ChunkedLayout(full, keep_full, rest, keep_last, offsets_at, scales_at, codes_at)


def _indices(view: memoryview, name: str, layout: ChunkedLayout) -> np.ndarray:
    """Flat int64 indices of the kept entries, checked: in their chunk and strictly increasing in it."""
    offsets = unpack12(view, layout.offsets_at, layout.kept, f"offsets of {name!r}")
    head = offsets[: layout.full * layout.keep_full].reshape(layout.full, layout.keep_full)
    tail = offsets[layout.full * layout.keep_full :]
    if tail.size and int(tail.max()) >= layout.rest:
        raise DecodeError(
            SparseReason.BAD_INDEX, f"{name!r} has an offset past its last chunk ({layout.rest})"
        )
    if (head.shape[1] > 1 and not bool((np.diff(head, axis=1) > 0).all())) or (
        tail.size > 1 and not bool((np.diff(tail) > 0).all())
    ):
        raise DecodeError(SparseReason.BAD_INDEX, f"{name!r} has offsets not strictly increasing in a chunk")
    head += (np.arange(layout.full, dtype=np.int64) * CHUNK)[:, None]
    return np.concatenate([head.reshape(-1), tail + layout.full * CHUNK])


def _values(
    view: memoryview, name: str, layout: ChunkedLayout, codec: Codec, block_size: int
) -> torch.Tensor:
    k, bits = layout.kept, VALUE_BITS[codec]
    width = _scales_per_block(bits)
    scales = np.frombuffer(view, "<f4", -(-k // block_size) * width, layout.scales_at).astype(np.float32)
    if bits == 8:
        if not np.isfinite(scales).all():
            raise DecodeError(NON_FINITE, f"tensor {name!r} has a non-finite block absmax")
        if bool((scales < 0).any()):
            raise DecodeError(BAD_HEADER, f"tensor {name!r} has a negative block absmax")
    else:
        check_levels(scales.reshape(-1, width), name)
    codes = unpack_codes(view, layout.codes_at, k, bits, f"codes of {name!r}")
    if bits == 8:
        values = torch.index_select(CODE_TABLE, 0, torch.from_numpy(codes))
        return scale_blocks(values, torch.from_numpy(scales), block_size)
    return dequantize_levels(scales.reshape(-1, width), codes, block_size, bits)


def decode_sparse(
    view: memoryview, name: str, shape: tuple[int, ...], layout: ChunkedLayout, codec: Codec, block_size: int
) -> SparseTensor:
    """The kept entries of a claimed chunked body: flat indices and float32 values."""
    if layout.kept == 0:
        return SparseTensor(shape, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32))
    index = _indices(view, name, layout)
    return SparseTensor(shape, torch.from_numpy(index), _values(view, name, layout, codec, block_size))


def decode_body(
    view: memoryview, name: str, shape: tuple[int, ...], layout: ChunkedLayout, codec: Codec, block_size: int
) -> torch.Tensor:
    """The dense float32 tensor of a claimed chunked body; zeros where nothing was kept."""
    return decode_sparse(view, name, shape, layout, codec, block_size).to_dense()
