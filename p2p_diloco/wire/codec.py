"""Self-describing tensor frames (int8 blockwise or raw fp32), their strict decoder, and error feedback.

Frame layout, all integers little-endian::

    magic b"PDTF" | format version u8 | codec id u8 | tensor count u32
    per tensor: name length u16 | name (utf-8) | dtype code u8 | ndim u8 | shape u64 * ndim |
                block size u32 | int8: absmax f32 * ceil(numel / block) then codes u8 * numel
                                 fp32: values f32 * numel (block size 0)

Encoding uses `bitsandbytes.functional.quantize_blockwise` on accelerators and the same algorithm in
plain torch on the CPU (`quantize_blockwise_cpu`). Decoding never calls a fused
kernel: every replica applies the same decoded update and compares checksums, so dequantization is a
table lookup in `CODE_TABLE` followed by exactly one float32 multiply by the block's absmax, in plain
torch on CPU, identical bit for bit on every machine. The decoder checks every field before it allocates
anything and raises only `DecodeError` with one of the reason tags below.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from p2p_diloco.errors import DecodeError

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

MAGIC = b"PDTF"
FORMAT_VERSION = 1
CODEC_IDS = {"int8": 1, "fp32": 2}
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


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    numel: int
    block_size: int
    absmax_at: int
    data_at: int


def _check_codec(codec: str, block_size: int) -> None:
    if codec not in CODEC_IDS:
        raise ValueError(f"codec must be one of {sorted(CODEC_IDS)}, got {codec!r}")
    if codec == "int8" and block_size not in BLOCK_SIZES:
        raise ValueError(f"int8 block_size must be one of {BLOCK_SIZES}, got {block_size}")


def _all_finite(t: torch.Tensor) -> bool:
    # A finite sum proves every element finite (NaN/inf propagate); only an overflowing sum needs the full scan.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


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


_CODE_BOUNDS = (CODE_TABLE[:-1] + CODE_TABLE[1:]) / 2


def quantize_blockwise_cpu(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' blockwise quantization (its pure-torch reference kernel: absmax per block, nearest
    code by the midpoints of the sorted table) for CPU tensors. Used instead of bitsandbytes on the CPU:
    importing bitsandbytes costs 4-7 s and ~115 MiB per peer, and its CPU call ~12 ms whatever the size.
    tests/unit/test_codec.py checks it against bitsandbytes' CPU kernel."""
    n = flat.numel()
    n_blocks = -(-n // block_size)
    padded = torch.cat([flat, flat.new_zeros(n_blocks * block_size - n)]) if n % block_size else flat
    blocks = padded.reshape(n_blocks, block_size)
    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), -1, 1).reshape(-1)[:n]
    codes = torch.bucketize(scaled, _CODE_BOUNDS, out_int32=True).to(torch.uint8)
    return codes, absmax


def _quantize_int8(tensors: list[torch.Tensor], block_size: int) -> list[tuple[bytes, bytes]]:
    """(absmax bytes, code bytes) per tensor; a tensor holding NaN/inf gets NaN absmax so receivers reject it.

    All tensors go through ONE bitsandbytes call (its CPU kernel costs ~12 ms per call whatever the size):
    each is zero-padded to whole blocks, which changes neither its absmax nor its codes.
    """
    flats = [t.detach().reshape(-1).to(torch.float32) for t in tensors]
    device = flats[0].device if flats else torch.device("cpu")
    padded_blocks = [-(-f.numel() // block_size) for f in flats]
    if sum(padded_blocks) == 0:
        return [(b"", b"") for _ in flats]
    pieces = []
    for i, (flat, n_blocks) in enumerate(zip(flats, padded_blocks)):
        pieces.append(flat.to(device))
        if i < len(flats) - 1 and n_blocks * block_size > flat.numel():  # the last block may stay short
            pieces.append(flat.new_zeros(n_blocks * block_size - flat.numel(), device=device))
    buffer = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
    if device.type == "cpu":
        codes, absmax_t = quantize_blockwise_cpu(buffer, block_size)
    else:
        from bitsandbytes.functional import quantize_blockwise  # imported lazily: only for accelerators

        codes, state = quantize_blockwise(buffer, code=CODE_TABLE.to(device), blocksize=block_size)
        absmax_t = state.absmax
    codes_np, absmax_np = codes.cpu().numpy(), absmax_t.cpu().numpy().astype("<f4")
    out, block = [], 0
    for flat, n_blocks in zip(flats, padded_blocks):
        absmax = absmax_np[block : block + n_blocks]
        if not _all_finite(flat):  # bitsandbytes skips NaN in absmax: mark the tensor so receivers reject it
            absmax = np.full_like(absmax, np.nan)
        first = block * block_size
        out.append((absmax.tobytes(), codes_np[first : first + flat.numel()].tobytes()))
        block += n_blocks
    return out


def encode_tensors(
    tensors: Mapping[str, torch.Tensor], *, codec: str = "int8", block_size: int = 4096
) -> bytes:
    """One frame holding `tensors` in the given order; float tensors on any device (CUDA: same device)."""
    _check_codec(codec, block_size)
    block = block_size if codec == "int8" else 0
    heads = [_entry_head(name, tensor, block) for name, tensor in tensors.items()]
    chunks = [MAGIC, _FRAME_HEAD.pack(FORMAT_VERSION, CODEC_IDS[codec], len(tensors))]
    if codec == "int8":
        for head, (absmax, codes) in zip(heads, _quantize_int8(list(tensors.values()), block_size)):
            chunks += (head, absmax, codes)
    else:
        for head, tensor in zip(heads, tensors.values()):
            values = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
            chunks += (head, values.numpy().astype("<f4", copy=False).tobytes())
    return b"".join(chunks)


def frame_size(shapes: Mapping[str, tuple[int, ...]], *, codec: str = "int8", block_size: int = 4096) -> int:
    """Exact length of `encode_tensors` output for tensors of these names and shapes."""
    _check_codec(codec, block_size)
    size = len(MAGIC) + _FRAME_HEAD.size
    for name, shape in shapes.items():
        numel = math.prod(shape)
        size += _MIN_ENTRY_BYTES - 1 + len(name.encode("utf-8")) + 8 * len(shape)
        size += 4 * (-(-numel // block_size)) + numel if codec == "int8" else 4 * numel
    return size


def _read_entry(
    reader: ByteReader,
    codec: str,
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
    if codec == "int8":
        if block not in BLOCK_SIZES:
            raise DecodeError(BAD_HEADER, f"tensor {name!r} has block size {block}, not one of {BLOCK_SIZES}")
        absmax_at = reader.claim(4 * (-(-numel // block)), f"absmax of {name!r}")
        data_at = reader.claim(numel, f"codes of {name!r}")
    else:
        if block != 0:
            raise DecodeError(BAD_HEADER, f"fp32 tensor {name!r} has block size {block}, expected 0")
        absmax_at, data_at = -1, reader.claim(4 * numel, f"values of {name!r}")
    seen.add(name)
    return _Entry(name, shape, numel, block, absmax_at, data_at)


def _dequantize(view: memoryview, entry: _Entry) -> torch.Tensor:
    if entry.numel == 0:
        return torch.zeros(entry.shape, dtype=torch.float32)
    n_blocks = -(-entry.numel // entry.block_size)
    absmax = torch.from_numpy(np.frombuffer(view, "<f4", n_blocks, entry.absmax_at).astype(np.float32))
    if not bool(torch.isfinite(absmax).all()):
        raise DecodeError(NON_FINITE, f"tensor {entry.name!r} has a non-finite block absmax")
    if bool((absmax < 0).any()):
        raise DecodeError(BAD_HEADER, f"tensor {entry.name!r} has a negative block absmax")
    codes = torch.from_numpy(np.frombuffer(view, np.uint8, entry.numel, entry.data_at).astype(np.int32))
    values = torch.index_select(CODE_TABLE, 0, codes)
    full = entry.numel // entry.block_size
    cut = full * entry.block_size
    if full:
        values[:cut].view(full, entry.block_size).mul_(absmax[:full, None])
    if cut < entry.numel:
        values[cut:].mul_(absmax[full])
    return values.reshape(entry.shape)


def _read_fp32(view: memoryview, entry: _Entry) -> torch.Tensor:
    if entry.numel == 0:
        return torch.zeros(entry.shape, dtype=torch.float32)
    values = torch.from_numpy(np.frombuffer(view, "<f4", entry.numel, entry.data_at).astype(np.float32))
    if not _all_finite(values):
        raise DecodeError(NON_FINITE, f"tensor {entry.name!r} holds NaN or inf")
    return values.reshape(entry.shape)


def decode_tensors(
    data: bytes,
    *,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, torch.Tensor]:
    """CPU float32 tensors from a frame, in frame order; raises only `DecodeError`.

    With `expected_shapes`, the frame must hold exactly those names with exactly those shapes.
    """
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
    codec = _CODEC_NAMES[codec_id]
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
    read = _dequantize if codec == "int8" else _read_fp32
    return {entry.name: read(view, entry) for entry in entries}


class ErrorFeedback:
    """Sender-side quantization residuals, one set per fragment.

    `compress` quantizes delta + stored residual and keeps (delta + old residual - decoded) for the next
    delta of that fragment, so the sum of what receivers decode tracks the sum of the true deltas.
    """

    def __init__(self, codec: str = "int8", block_size: int = 4096, enabled: bool = True):
        _check_codec(codec, block_size)
        self.codec = codec
        self.block_size = block_size
        self.enabled = enabled
        self._residuals: dict[int, dict[str, torch.Tensor]] = {}

    def compress(
        self, fragment: int, delta: Mapping[str, torch.Tensor]
    ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """(frame, tensors exactly as a receiver decodes them). Non-finite deltas raise ValueError and
        leave the residual untouched, so one bad step cannot poison later deltas."""
        residual = self._residuals.get(fragment) if self.enabled else None
        if residual is not None and set(residual) != set(delta):
            raise ValueError(f"fragment {fragment}: tensor names changed since the last delta; call reset()")
        corrected: dict[str, torch.Tensor] = {}
        for name, tensor in delta.items():
            value = tensor.detach().to(torch.float32)
            if residual is not None:
                if residual[name].shape != value.shape:
                    raise ValueError(f"fragment {fragment}: {name!r} changed shape; call reset()")
                value = value + residual[name].to(value.device)
            if not _all_finite(value):
                raise ValueError(f"fragment {fragment}: delta {name!r} holds NaN or inf; not sent")
            corrected[name] = value
        frame = encode_tensors(corrected, codec=self.codec, block_size=self.block_size)
        decoded = decode_tensors(frame, max_bytes=len(frame))
        if self.enabled:
            self._residuals[fragment] = {
                name: value - decoded[name].to(value.device) for name, value in corrected.items()
            }
        return frame, decoded

    def reset(self, fragment: int) -> None:
        self._residuals.pop(fragment, None)

    def residual_norm(self, fragment: int) -> float:
        """L2 norm over all tensors of the fragment's stored residual (0.0 when none)."""
        residual = self._residuals.get(fragment, {})
        return math.sqrt(sum(float(r.double().square().sum()) for r in residual.values()))
