"""Streamed snapshots on the wire: a fragment's index frame, its chunk layout and chunk requests.

A fragment snapshot (Θ_p and m_p at one version) travels in chunks, never as one frame:

* the **layout** (`chunk_layout`) cuts every tensor of the fragment, Θ tensors in plan order then m
  tensors in plan order, into pieces of at most `chunk_bytes` (a chunk never spans two tensors). It
  follows from the fragment's shapes and `chunk_bytes` alone, so a requester knows each chunk's exact
  size before asking;
* the **index** frame (magic ``PDsi``, framed like `wire.frames`) names run, manifest, fragment,
  version, the fragment checksum (`protocol.replica.fragment_checksum`), `chunk_bytes` and the chunk
  count; its payload is one 16-byte blake2b digest (`chunk_digest`) per chunk;
* a **chunk request** (`encode_chunk_request`) is ``fragment u32 | chunk u32 | checksum (32 bytes)``,
  big-endian; the answer is the chunk's raw float32 bytes, nothing else.

A requester checks every chunk (exact size, digest from the index) and, once all are in, the whole
fragment against the checksum (`GlobalReplica.load_fragment`), so a lying index costs one download, never
the replica. Peers on the same fragment state produce identical indexes, so chunks of one fragment can
come from several peers at once.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from p2p_diloco.errors import DecodeError
from p2p_diloco.wire.bounds import identifier, integer
from p2p_diloco.wire.codecs.codec import BAD_HEADER
from p2p_diloco.wire.frames import (  # the frame format and schema checks are shared with wire.frames
    _COUNTER,
    _IDS,
    SNAPSHOT_INDEX_MAGIC,
    Check,
    _decode,
    _encode,
)

INDEX_MAGIC = SNAPSHOT_INDEX_MAGIC
DIGEST_BYTES = 16
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 64 * 1024 * 1024
MAX_CHUNKS = 1 << 20
CHECKSUM_BYTES = 32
_DOMAIN = b"p2p_diloco.chunk.v1"
_REQUEST = struct.Struct(">II32s")
CHUNK_REQUEST_BYTES = _REQUEST.size
THETA, MOMENTUM = 0, 1

INDEX_SCHEMA: dict[str, Check] = {
    **_IDS,
    "version": _COUNTER,
    "checksum": identifier,
    "chunk_bytes": integer(MIN_CHUNK_BYTES, MAX_CHUNK_BYTES),
    "count": integer(1, MAX_CHUNKS),
}


@dataclass(frozen=True)
class Chunk:
    """One piece of a fragment: elements [start, start + count) of tensor `name` of Θ (`part` THETA) or m."""

    part: int
    name: str
    start: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * 4


@dataclass(frozen=True)
class SnapshotIndex:
    """What a peer serving a fragment state announces (module docstring)."""

    run_id: str
    manifest_hash: str
    fragment: int
    version: int
    checksum: str
    chunk_bytes: int
    digests: tuple[bytes, ...]

    @property
    def count(self) -> int:
        return len(self.digests)


def chunk_layout(shapes: Mapping[str, Sequence[int]], chunk_bytes: int) -> list[Chunk]:
    """The chunks of a fragment whose tensors (plan order) have `shapes` (module docstring)."""
    if chunk_bytes % 4 or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be a multiple of 4 in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}")
    per_chunk = chunk_bytes // 4
    chunks = []
    for part in (THETA, MOMENTUM):
        for name, shape in shapes.items():
            numel = 1
            for dim in shape:
                numel *= int(dim)
            for start in range(0, numel, per_chunk):
                chunks.append(Chunk(part, name, start, min(per_chunk, numel - start)))
    return chunks


def chunk_digest(data: bytes | memoryview) -> bytes:
    """The 16-byte keyed blake2b of one chunk's bytes, as listed in the index."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES, key=_DOMAIN).digest()


def encode_index(index: SnapshotIndex) -> bytes:
    fields = {
        "run_id": index.run_id,
        "manifest_hash": index.manifest_hash,
        "fragment": index.fragment,
        "version": index.version,
        "checksum": index.checksum,
        "chunk_bytes": index.chunk_bytes,
        "count": index.count,
    }
    return _encode(INDEX_MAGIC, fields, INDEX_SCHEMA, b"".join(index.digests))


def decode_index(frame: bytes, *, max_bytes: int = 64 * 1024 * 1024) -> SnapshotIndex:
    """A strictly checked index frame; `DecodeError` on anything else."""
    header, payload = _decode(frame, INDEX_MAGIC, INDEX_SCHEMA, max_bytes)
    count = header.pop("count")
    if len(payload) != count * DIGEST_BYTES:
        raise DecodeError(
            BAD_HEADER, f"snapshot index claims {count} chunks but carries {len(payload)} digest bytes"
        )
    if header["chunk_bytes"] % 4:
        raise DecodeError(
            BAD_HEADER, f"snapshot index chunk_bytes {header['chunk_bytes']} is not a multiple of 4"
        )
    digests = tuple(payload[i : i + DIGEST_BYTES] for i in range(0, len(payload), DIGEST_BYTES))
    return SnapshotIndex(**header, digests=digests)


def encode_chunk_request(fragment: int, chunk: int, checksum: str) -> bytes:
    raw = bytes.fromhex(checksum)
    if len(raw) != CHECKSUM_BYTES or not 0 <= fragment < 2**32 or not 0 <= chunk < MAX_CHUNKS:
        raise ValueError(f"bad chunk request: fragment {fragment}, chunk {chunk}, checksum {checksum[:16]}")
    return _REQUEST.pack(fragment, chunk, raw)


def decode_chunk_request(body: bytes) -> tuple[int, int, str]:
    """(fragment, chunk, checksum hex); `DecodeError` for a body of the wrong size or range."""
    if len(body) != _REQUEST.size:
        raise DecodeError(BAD_HEADER, f"chunk request must be {_REQUEST.size} bytes, got {len(body)}")
    fragment, chunk, raw = _REQUEST.unpack(body)
    if chunk >= MAX_CHUNKS:
        raise DecodeError(BAD_HEADER, f"chunk {chunk} out of range")
    return fragment, chunk, raw.hex()
