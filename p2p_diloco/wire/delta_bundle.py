"""The payload of a sparse round's update: the learner-signed delta frames it merged, bundled, with a strict
decoder.

Under union aggregation (issue #30) the synchronizer publishes no merged gradient: its update lists the
deltas it merged (`wire.delta_listing`, under the leader's signature) and carries those deltas themselves,
each the learner's own `wire.frames` delta frame with the learner's signature in its header, so every
replica checks each one and merges them itself (`swarm.sparse_rounds`). Layout, integers little-endian::

    magic b"PDdb" | version u8 | count u32 | count x (frame length u64 | delta frame)

The frames come in the listing's order ((learner, seq) ascending). The decoder raises only `DecodeError`:
exact sizes, a count in [1, MAX_BUNDLED], no empty frame, nothing after the last frame. It does not decode
the frames; the replica decodes each one with `wire.frames.decode_delta`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from p2p_diloco.errors import DecodeError
from p2p_diloco.wire.codecs.blockwise import (
    BAD_HEADER,
    TRAILING_BYTES,
    UNSUPPORTED_VERSION,
    ByteReader,
    byte_view,
)

MAGIC = b"PDdb"
VERSION = 1
# The most deltas one sparse update bundles (the synchronizer merges at most this many in one round), so a
# receiver can cap an update frame before reading it (`net.limits`).
MAX_BUNDLED = 256
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
OVERHEAD = len(MAGIC) + 1 + _COUNT.size  # before the frames; each frame adds _LENGTH.size


def bundle_bound(frame_bound: int, count: int = MAX_BUNDLED) -> int:
    """The largest bundle of `count` frames of at most `frame_bound` bytes each."""
    return OVERHEAD + count * (_LENGTH.size + frame_bound)


def encode_bundle(frames: Sequence[bytes]) -> bytes:
    """The bundle of `frames` (1..MAX_BUNDLED non-empty delta frames, in the listing's order)."""
    if not 1 <= len(frames) <= MAX_BUNDLED or any(not f for f in frames):
        raise ValueError(f"a bundle holds 1-{MAX_BUNDLED} non-empty frames, got {len(frames)}")
    parts = [MAGIC, bytes([VERSION]), _COUNT.pack(len(frames))]
    for frame in frames:
        parts += [_LENGTH.pack(len(frame)), bytes(frame)]
    return b"".join(parts)


def decode_bundle(data: bytes, *, max_bytes: int) -> list[bytes]:
    """The delta frames of a bundle, in order; raises only `DecodeError`."""
    view = byte_view(data)
    reader = ByteReader(view, max_bytes)
    reader.expect_magic(MAGIC, "delta bundle")
    (version,) = reader.take(1, "delta bundle version")
    if version != VERSION:
        raise DecodeError(UNSUPPORTED_VERSION, f"delta bundle version {version}, this peer reads {VERSION}")
    (count,) = reader.unpack(_COUNT, "delta bundle count")
    if not 1 <= count <= MAX_BUNDLED:
        raise DecodeError(BAD_HEADER, f"delta bundle of {count} frames, allowed 1-{MAX_BUNDLED}")
    frames = []
    for i in range(count):
        (size,) = reader.unpack(_LENGTH, f"length of bundled delta {i}")
        if size == 0:
            raise DecodeError(BAD_HEADER, f"bundled delta {i} is empty")
        frames.append(bytes(reader.take(size, f"bundled delta {i}")))
    if reader.pos != len(view):
        raise DecodeError(TRAILING_BYTES, f"{len(view) - reader.pos} bytes after the delta bundle")
    return frames
