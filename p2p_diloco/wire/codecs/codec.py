"""Self-describing tensor frames (int8 blockwise, raw fp32, sparse top-k) and their strict decoder
(error feedback over them lives in `wire.codecs.feedback`).

Frame layout, all integers little-endian::

    magic b"PDTF" | format version u8 | codec id u8 | tensor count u32
    per tensor: name length u16 | name (utf-8) | dtype code u8 | ndim u8 | shape u64 * ndim |
                block size u32 | int8: absmax f32 * ceil(numel / block) then codes u8 * numel
                                 fp32: values f32 * numel (block size 0)
                                 topk-int8 / topk-int4: the sparse body of `wire.codecs.sparse`

Chunked codecs (topk4k-*) name no tensors (the receiver knows its fragment's): after the tensor count
come block size u32, an 8-byte digest of the names and shapes and one body of all tensors in name order
(`wire.codecs.chunked.read_frame`); decoding needs `expected_shapes`, whose count and digest must match.

Encoding uses `bitsandbytes.functional.quantize_blockwise` on accelerators and the same algorithm on the
CPU (`quantize_blockwise_cpu`: the C kernels of `protocol.fused` when built, else plain torch, with the same
codes). Decoding never calls bitsandbytes: every replica applies the same decoded update and compares
checksums, so dequantization is a table lookup in `CODE_TABLE` followed by exactly one float32 multiply by
the block's absmax (`kernels.dequantize_into`: in C or in torch, the same IEEE operation), identical bit
for bit on every machine. `decode_tensors(lazy=True)` leaves int8 tensors in that form
(`kernels.QuantizedTensor`) for the outer step to decode on the fly. The decoder checks every field
before it allocates anything and raises only `DecodeError` with one of the reason tags of
`wire.codecs.blockwise` (re-exported here), `wire.codecs.sparse.SparseReason` or
`wire.codecs.bitpack.PackReason`. The shared primitives (tags, code table, byte reader, CPU quantizer) live in
`wire.codecs.blockwise`; sparse bodies in `wire.codecs.sparse` and `wire.codecs.chunked`, which
`decode_sparse` hands over as index/value sets.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.kernels import QuantizedTensor
from p2p_diloco.protocol.union_merge import SparseTensor
from p2p_diloco.wire.codecs import chunked, sparse
from p2p_diloco.wire.codecs.blockwise import (  # noqa: F401  (tags and primitives re-exported for callers)
    BAD_HEADER,
    BAD_MAGIC,
    CODE_TABLE,
    MISSING_TENSOR,
    NON_FINITE,
    OVERSIZED,
    TRAILING_BYTES,
    TRUNCATED,
    UNEXPECTED_TENSOR,
    UNKNOWN_CODEC,
    UNSUPPORTED_VERSION,
    WRONG_SHAPE,
    ByteReader,
    Codec,
    byte_view,
    quantize_blockwise_cpu,
    zero_blocks_as_cpu,
)
from p2p_diloco.wire.codecs.blockwise import all_finite as _all_finite
from p2p_diloco.wire.codecs.placement import Int8Encoder, int8_encoder
from p2p_diloco.wire.codecs.sparse import DEFAULT_DENSITY

MAGIC = b"PDTF"
FORMAT_VERSION = 1
CODEC_IDS = {
    Codec.INT8: 1,
    Codec.FP32: 2,
    Codec.TOPK_INT8: 3,
    Codec.TOPK_INT4: 4,
    Codec.TOPK4K_INT2: 5,
    Codec.TOPK4K_INT4: 6,
    Codec.TOPK4K_INT8: 7,
}
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' blockwise kernels accept
MAX_NAME_BYTES = 256
MAX_NDIM = 8
MAX_SPAN = 2**48  # bound on the product of a shape's nonzero dims, so even empty shapes stay sane
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

_CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_KNOWN_DTYPE_CODES = frozenset(_DTYPE_CODES.values())
_FRAME_HEAD = struct.Struct("<BBI")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_DTYPE_NDIM = struct.Struct("<BB")
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]
_MIN_ENTRY_BYTES = _U16.size + 1 + _DTYPE_NDIM.size + _U32.size


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    numel: int
    block_size: int
    absmax_at: int
    data_at: int
    layout: sparse.SparseLayout | None = None


def check_codec(codec: str, block_size: int, density: float = DEFAULT_DENSITY) -> Codec:
    """`codec` as a `Codec` once it, the block size and the density are valid; ValueError naming the fix."""
    if codec not in CODEC_IDS:
        raise ValueError(f"codec must be one of {[str(c) for c in CODEC_IDS]}, got {codec!r}")
    codec = Codec(codec)
    if codec != Codec.FP32 and block_size not in BLOCK_SIZES:
        raise ValueError(f"{codec} block_size must be one of {BLOCK_SIZES}, got {block_size}")
    if codec.sparse:
        sparse.check_density(density)
    return codec


def _entry_head(name: str, tensor: torch.Tensor, block: int) -> bytes:
    if not isinstance(name, str) or not 1 <= len(name.encode("utf-8")) <= MAX_NAME_BYTES:
        raise ValueError(f"tensor name must be a str of 1-{MAX_NAME_BYTES} utf-8 bytes, got {name!r}")
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _DTYPE_CODES:
        raise ValueError(f"tensor {name!r} must be a float tensor ({', '.join(map(str, _DTYPE_CODES))})")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"tensor {name!r} has {tensor.dim()} dims, at most {MAX_NDIM} are supported")
    raw = name.encode("utf-8")
    return b"".join(
        (
            _U16.pack(len(raw)),
            raw,
            _DTYPE_NDIM.pack(_DTYPE_CODES[tensor.dtype], tensor.dim()),
            _SHAPES[tensor.dim()].pack(*tensor.shape),
            _U32.pack(block),
        )
    )


def _quantize_int8(tensors: list[torch.Tensor], block_size: int) -> list[tuple[bytes, memoryview]]:
    """(absmax bytes, code bytes) per tensor; a tensor holding NaN/inf gets NaN absmax so receivers reject it.

    The encoder is `placement.int8_encoder`'s choice for the tensors' device. The CPU kernel
    (`quantize_blockwise_cpu`) quantizes each tensor on the CPU (copied there first from elsewhere), and
    NaN/inf show in its absmax (the max of |x| propagates them), so no pass checks finiteness. On a CUDA
    device with bitsandbytes all tensors go through ONE bitsandbytes call (~12 ms per call whatever the
    size): each is zero-padded to whole blocks, which changes neither its absmax nor its codes.
    """
    flats = [t.detach().reshape(-1).to(torch.float32) for t in tensors]
    device = flats[0].device if flats else torch.device("cpu")
    if int8_encoder(device) == Int8Encoder.CPU:  # the CPU, MPS, CUDA without bitsandbytes (`placement`)
        flats = [flat.to("cpu") for flat in flats]
        out = []
        for flat in flats:
            codes, absmax_t = quantize_blockwise_cpu(flat.contiguous(), block_size)
            absmax = absmax_t.numpy().astype("<f4")
            if not np.isfinite(absmax).all():
                absmax = np.full_like(absmax, np.nan)
            out.append((absmax.tobytes(), memoryview(codes.numpy())))
        return out
    padded_blocks = [-(-f.numel() // block_size) for f in flats]
    if sum(padded_blocks) == 0:
        return [(b"", memoryview(b"")) for _ in flats]
    pieces = []
    for i, (flat, n_blocks) in enumerate(zip(flats, padded_blocks)):
        pieces.append(flat.to(device))
        if i < len(flats) - 1 and n_blocks * block_size > flat.numel():  # the last block may stay short
            pieces.append(flat.new_zeros(n_blocks * block_size - flat.numel(), device=device))
    buffer = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
    from bitsandbytes.functional import quantize_blockwise  # imported lazily: only for accelerators

    codes, state = quantize_blockwise(buffer, code=CODE_TABLE.to(device), blocksize=block_size)
    codes_np, absmax_np = codes.cpu().numpy(), state.absmax.cpu().numpy().astype("<f4")
    zero_blocks_as_cpu(codes_np, absmax_np, block_size)
    out, block = [], 0
    for flat, n_blocks in zip(flats, padded_blocks):
        absmax = absmax_np[block : block + n_blocks]
        if not _all_finite(flat):  # bitsandbytes skips NaN in absmax: mark the tensor so receivers reject it
            absmax = np.full_like(absmax, np.nan)
        first = block * block_size
        out.append((absmax.tobytes(), memoryview(codes_np[first : first + flat.numel()])))
        block += n_blocks
    return out


def encode_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    codec: str = "int8",
    block_size: int = 4096,
    density: float = DEFAULT_DENSITY,
) -> bytes:
    """One frame holding `tensors` in the given order; float tensors on any device (CUDA: same device).
    `density` is the fraction of each chunk a sparse codec keeps (ignored by dense codecs)."""
    codec = check_codec(codec, block_size, density)
    if codec in chunked.VALUE_BITS:
        for name, tensor in tensors.items():
            _entry_head(name, tensor, block_size)  # the same checks of names, dtypes and dims
        head = MAGIC + _FRAME_HEAD.pack(FORMAT_VERSION, CODEC_IDS[codec], len(tensors))
        return head + chunked.encode_frame(tensors, codec=codec, density=density, block_size=block_size)
    block = 0 if codec == Codec.FP32 else block_size
    heads = [_entry_head(name, tensor, block) for name, tensor in tensors.items()]
    chunks = [MAGIC, _FRAME_HEAD.pack(FORMAT_VERSION, CODEC_IDS[codec], len(tensors))]
    if codec == Codec.INT8:
        for head, (absmax, codes) in zip(heads, _quantize_int8(list(tensors.values()), block_size)):
            chunks += (head, absmax, codes)
    elif codec.sparse:
        for head, tensor in zip(heads, tensors.values()):
            chunks += (
                head,
                sparse.encode_body(tensor, codec=codec, density=density, block_size=block_size),
            )
    else:
        for head, tensor in zip(heads, tensors.values()):
            values = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
            chunks += (head, values.numpy().astype("<f4", copy=False).tobytes())
    return b"".join(chunks)


def frame_size(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    codec: str = "int8",
    block_size: int = 4096,
    density: float = DEFAULT_DENSITY,
) -> int:
    """Exact length of `encode_tensors` output for tensors of these names and shapes."""
    codec = check_codec(codec, block_size, density)
    size = len(MAGIC) + _FRAME_HEAD.size
    if codec in chunked.VALUE_BITS:
        return size + chunked.frame_size(shapes, codec=codec, density=density, block_size=block_size)
    for name, shape in shapes.items():
        numel = math.prod(shape)
        size += _MIN_ENTRY_BYTES - 1 + len(name.encode("utf-8")) + 8 * len(shape)
        if codec == Codec.INT8:
            size += 4 * (-(-numel // block_size)) + numel
        elif codec.sparse:
            size += sparse.body_size(numel, codec=codec, density=density, block_size=block_size)
        else:
            size += 4 * numel
    return size


def _read_entry(
    reader: ByteReader,
    codec: Codec,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    seen: set[str],
) -> _Entry:
    (name_len,) = reader.unpack(_U16, "name length")
    if not 1 <= name_len <= MAX_NAME_BYTES:
        raise DecodeError(BAD_HEADER, f"name length {name_len} outside 1..{MAX_NAME_BYTES}")
    try:
        name = reader.take(name_len, "name").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(BAD_HEADER, f"tensor name is not utf-8 ({exc.reason})") from exc
    if name in seen:
        raise DecodeError(BAD_HEADER, f"tensor {name!r} appears twice")
    dtype_code, ndim = reader.unpack(_DTYPE_NDIM, f"dtype of {name!r}")
    if dtype_code not in _KNOWN_DTYPE_CODES:
        raise DecodeError(BAD_HEADER, f"tensor {name!r} has unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise DecodeError(BAD_HEADER, f"tensor {name!r} has {ndim} dims, at most {MAX_NDIM}")
    shape = tuple(reader.unpack(_SHAPES[ndim], f"shape of {name!r}"))
    (block,) = reader.unpack(_U32, f"block size of {name!r}")
    if expected_shapes is not None:
        if name not in expected_shapes:
            raise DecodeError(UNEXPECTED_TENSOR, f"{name!r} is not among the {len(expected_shapes)} expected")
        if tuple(expected_shapes[name]) != shape:
            raise DecodeError(
                WRONG_SHAPE, f"{name!r} has shape {shape}, expected {tuple(expected_shapes[name])}"
            )
    if math.prod(max(d, 1) for d in shape) > MAX_SPAN:
        raise DecodeError(OVERSIZED, f"tensor {name!r} claims shape {shape}")
    numel = math.prod(shape)
    layout = None
    if codec != Codec.FP32 and block not in BLOCK_SIZES:
        raise DecodeError(BAD_HEADER, f"tensor {name!r} has block size {block}, not one of {BLOCK_SIZES}")
    if codec == Codec.INT8:
        absmax_at = reader.claim(4 * (-(-numel // block)), f"absmax of {name!r}")
        data_at = reader.claim(numel, f"codes of {name!r}")
    elif codec.sparse:
        absmax_at = data_at = -1
        layout = sparse.claim_body(reader, name, numel, codec, block)
    else:
        if block != 0:
            raise DecodeError(BAD_HEADER, f"fp32 tensor {name!r} has block size {block}, expected 0")
        absmax_at, data_at = -1, reader.claim(4 * numel, f"values of {name!r}")
    seen.add(name)
    return _Entry(name, shape, numel, block, absmax_at, data_at, layout)


def _quantized(view: memoryview, entry: _Entry) -> QuantizedTensor | torch.Tensor:
    """An int8 entry, checked, still in int8 form (an empty one as its zero-size tensor)."""
    if entry.numel == 0:
        return torch.zeros(entry.shape, dtype=torch.float32)
    n_blocks = -(-entry.numel // entry.block_size)
    scales = np.frombuffer(view, "<f4", n_blocks, entry.absmax_at).astype(np.float32)
    # checked in numpy: a few blocks a tensor, where a torch call costs more than the check (issue #40)
    if not np.isfinite(scales).all():
        raise DecodeError(NON_FINITE, f"tensor {entry.name!r} has a non-finite block absmax")
    if (scales < 0).any():
        raise DecodeError(BAD_HEADER, f"tensor {entry.name!r} has a negative block absmax")
    codes = np.frombuffer(view, np.uint8, entry.numel, entry.data_at)
    return QuantizedTensor(entry.shape, codes, torch.from_numpy(scales), entry.block_size, CODE_TABLE)


def _dequantize(view: memoryview, entry: _Entry) -> torch.Tensor:
    q = _quantized(view, entry)
    # One table lookup and one multiply per value (`kernels.dequantize_into`), into one huge-page tensor.
    return q if isinstance(q, torch.Tensor) else q.decode()


def _read_fp32(view: memoryview, entry: _Entry) -> torch.Tensor:
    if entry.numel == 0:
        return torch.zeros(entry.shape, dtype=torch.float32)
    values = torch.from_numpy(np.frombuffer(view, "<f4", entry.numel, entry.data_at).astype(np.float32))
    if not _all_finite(values):
        raise DecodeError(NON_FINITE, f"tensor {entry.name!r} holds NaN or inf")
    return values.reshape(entry.shape)


def _read_frame(
    data: bytes, expected_shapes: Mapping[str, tuple[int, ...]] | None, max_bytes: int
) -> tuple[memoryview, Codec, list[_Entry] | chunked.ChunkedFrame]:
    """The frame's view, codec and entries, every size checked and claimed; raises only `DecodeError`."""
    view = byte_view(data)
    if len(view) > max_bytes:
        raise DecodeError(OVERSIZED, f"frame of {len(view)} bytes exceeds the limit of {max_bytes}")
    reader = ByteReader(view, max_bytes)
    reader.expect_magic(MAGIC, "tensor frame")
    version, codec_id, count = reader.unpack(_FRAME_HEAD, "frame header")
    if version != FORMAT_VERSION:
        raise DecodeError(
            UNSUPPORTED_VERSION, f"tensor frame version {version}, this peer reads {FORMAT_VERSION}"
        )
    if codec_id not in _CODEC_NAMES:
        raise DecodeError(UNKNOWN_CODEC, f"codec id {codec_id}, known: {CODEC_IDS}")
    codec = Codec(_CODEC_NAMES[codec_id])
    if codec in chunked.VALUE_BITS:
        frame = chunked.read_frame(reader, codec, count, expected_shapes)
        if reader.pos != len(view):
            raise DecodeError(TRAILING_BYTES, f"{len(view) - reader.pos} bytes after the chunked body")
        return view, codec, frame
    table_start = reader.pos
    reader.claim(count * _MIN_ENTRY_BYTES, f"table of {count} tensors")  # count bounded before looping
    reader.pos = table_start
    seen: set[str] = set()
    entries = [_read_entry(reader, codec, expected_shapes, seen) for _ in range(count)]
    if reader.pos != len(view):
        raise DecodeError(TRAILING_BYTES, f"{len(view) - reader.pos} bytes after the last tensor")
    if expected_shapes is not None:
        missing = [name for name in expected_shapes if name not in seen]
        if missing:
            raise DecodeError(MISSING_TENSOR, f"{len(missing)} expected tensors absent, first {missing[0]!r}")
    return view, codec, entries


def decode_tensors(
    data: bytes,
    *,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    lazy: bool = False,
) -> dict[str, torch.Tensor]:
    """CPU float32 tensors from a frame, in frame order; raises only `DecodeError`.

    With `expected_shapes`, the frame must hold exactly those names with exactly those shapes.
    `lazy`: the tensors of an int8 frame come back as `kernels.QuantizedTensor` (checked the same way, not
    yet decoded; they keep views of `data`), which `GlobalReplica.apply` decodes inside the outer step.
    """
    view, codec, entries = _read_frame(data, expected_shapes, max_bytes)
    if codec.sparse:
        return {name: t.to_dense() for name, t in _sparse_entries(view, codec, entries).items()}
    read = (_quantized if lazy else _dequantize) if codec == Codec.INT8 else _read_fp32
    return {entry.name: read(view, entry) for entry in entries}


def _sparse_entries(
    view: memoryview, codec: Codec, entries: list[_Entry] | chunked.ChunkedFrame
) -> dict[str, SparseTensor]:
    if isinstance(entries, chunked.ChunkedFrame):
        return entries.decode(view)
    return {
        e.name: sparse.decode_sparse(view, e.name, e.shape, e.layout, codec, e.block_size) for e in entries
    }


def decode_sparse(
    data: bytes,
    *,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, SparseTensor]:
    """The entries a sparse frame sent, per tensor in frame order (flat indices, float32 values), checked
    exactly as `decode_tensors` checks them; a dense frame is a `DecodeError` (UNKNOWN_CODEC)."""
    view, codec, entries = _read_frame(data, expected_shapes, max_bytes)
    if not codec.sparse:
        raise DecodeError(UNKNOWN_CODEC, f"codec {codec} is not sparse: its tensors are not index/value sets")
    return _sparse_entries(view, codec, entries)


def frame_codec(data: bytes) -> Codec | None:
    """The codec a tensor frame says it uses, from its first bytes; None if it is not a tensor frame."""
    head = bytes(byte_view(data)[: len(MAGIC) + _FRAME_HEAD.size])
    if len(head) < len(MAGIC) + _FRAME_HEAD.size or not head.startswith(MAGIC):
        return None
    _, codec_id, _ = _FRAME_HEAD.unpack(head[len(MAGIC) :])
    return _CODEC_NAMES.get(codec_id)
