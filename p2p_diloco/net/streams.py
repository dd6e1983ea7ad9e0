"""The transport's envelope on a libp2p stream: length-prefixed requests and replies with size caps.

A request is ``MAGIC | u64 length | body``; a reply is ``u8 status | u32 count | (u64 length | item)*``.
Readers check every declared length against their cap *before* reading the bytes, so an oversized
frame costs the receiver nothing; `read_body` also holds the sender to a minimum average rate
(`BodyPace`), so a sender that trickles cannot keep a stream for long; writers send in chunks and wait
for the stream to drain between chunks (backpressure instead of buffering a whole frame twice). All
integers are big-endian.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from dataclasses import dataclass

MAGIC = b"PDT1"
STATUS_OK = 0
STATUS_REJECTED = 1
WRITE_CHUNK = 1 << 20
LAST_CHANCE_SECONDS = 0.05  # a body found behind its pace gets one more read this long before it is cut
MAX_REPLY_ITEMS = 100_000

_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_FETCH = struct.Struct(">Iq")  # fragment, after_version


class FrameTooLarge(ValueError):
    """A peer declared more bytes than the reader accepts; nothing of the body was read."""

    def __init__(self, declared: int, limit: int, what: str):
        self.declared = declared
        self.limit = limit
        super().__init__(f"{what} of {declared} bytes exceeds the limit of {limit} bytes")


class BadEnvelope(ValueError):
    """The bytes on the stream do not follow the envelope format."""


class TooSlow(Exception):
    """A body fell behind its minimum rate; `received` of `length` bytes had arrived."""

    def __init__(self, received: int, length: int, pace: BodyPace):
        self.received = received
        self.length = length
        super().__init__(
            f"{received} of {length} bytes after {pace.grace + received / pace.min_rate:.1f} s, below the "
            f"minimum of {pace.min_rate / 1024:.0f} KiB/s (after a grace of {pace.grace:.0f} s)"
        )


@dataclass(frozen=True)
class BodyPace:
    """The minimum average rate of a body that began at `started`: by time t at least
    ``min_rate * (t - started - grace)`` bytes must have arrived (bursts and pauses average out)."""

    started: float
    min_rate: float
    grace: float

    def due(self, received: int) -> float:
        """The time after which `received` bytes are too few (the sender is then too slow)."""
        return self.started + self.grace + received / self.min_rate

    def behind(self, received: int, now: float) -> bool:
        return now > self.due(received)


async def _write_chunked(writer: asyncio.StreamWriter, data: bytes) -> None:
    view = memoryview(data)
    for offset in range(0, len(view), WRITE_CHUNK):
        writer.write(view[offset : offset + WRITE_CHUNK])
        await writer.drain()


async def write_request(writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(MAGIC + _U64.pack(len(body)))
    await _write_chunked(writer, body)
    await writer.drain()


async def read_request_header(reader: asyncio.StreamReader, limit: int) -> int:
    """Read magic and length; `FrameTooLarge` if the body would exceed `limit` (body left unread)."""
    header = await reader.readexactly(len(MAGIC) + _U64.size)
    if header[: len(MAGIC)] != MAGIC:
        raise BadEnvelope(f"bad magic {header[: len(MAGIC)]!r}, expected {MAGIC!r}")
    (length,) = _U64.unpack(header[len(MAGIC) :])
    if length > limit:
        raise FrameTooLarge(length, limit, "frame")
    return length


async def read_body(
    reader: asyncio.StreamReader,
    length: int,
    *,
    min_rate: float,
    grace: float,
    clock: Callable[[], float] | None = None,
) -> bytes:
    """Read `length` bytes at an average of at least `min_rate` bytes/s after `grace` seconds (`BodyPace`);
    `TooSlow` as soon as the sender falls behind, `asyncio.IncompleteReadError` if the stream ends first.
    Memory grows with what arrived, not with what the header claimed."""
    now = clock or asyncio.get_running_loop().time
    pace = BodyPace(now(), min_rate, grace)
    chunks: list[bytes] = []
    received = 0
    while received < length:
        left = pace.due(received) - now()
        try:  # behind already (our loop was busy?): what has arrived meanwhile still counts
            chunk = await asyncio.wait_for(
                reader.read(min(length - received, WRITE_CHUNK)), max(left, LAST_CHANCE_SECONDS)
            )
        except TimeoutError:
            raise TooSlow(received, length, pace) from None
        if not chunk:
            raise asyncio.IncompleteReadError(b"".join(chunks), length)
        chunks.append(chunk)
        received += len(chunk)
        if left <= 0 and pace.behind(received, now()):
            raise TooSlow(received, length, pace)
    return b"".join(chunks)


async def write_reply(writer: asyncio.StreamWriter, status: int, items: list[bytes]) -> None:
    writer.write(bytes([status]) + _U32.pack(len(items)))
    for item in items:
        writer.write(_U64.pack(len(item)))
        await _write_chunked(writer, item)
    await writer.drain()


async def read_reply(
    reader: asyncio.StreamReader, *, max_item_bytes: int, max_total_bytes: int
) -> tuple[int, list[bytes]]:
    """Read a reply; `FrameTooLarge` before reading any item that would break a cap."""
    head = await reader.readexactly(1 + _U32.size)
    status = head[0]
    if status not in (STATUS_OK, STATUS_REJECTED):
        raise BadEnvelope(f"unknown reply status {status}")
    (count,) = _U32.unpack(head[1:])
    if count > MAX_REPLY_ITEMS:
        raise BadEnvelope(f"reply claims {count} items (limit {MAX_REPLY_ITEMS})")
    items = []
    total = 0
    for _ in range(count):
        (length,) = _U64.unpack(await reader.readexactly(_U64.size))
        if length > max_item_bytes:
            raise FrameTooLarge(length, max_item_bytes, "reply item")
        total += length
        if total > max_total_bytes:
            raise FrameTooLarge(total, max_total_bytes, "reply")
        items.append(await reader.readexactly(length))
    return status, items


def encode_fetch(fragment: int, after_version: int) -> bytes:
    if not 0 <= fragment < 2**32 or not -(2**63) <= after_version < 2**63:
        raise ValueError(f"fragment {fragment} or after_version {after_version} out of range")
    return _FETCH.pack(fragment, after_version)


def decode_fetch(body: bytes) -> tuple[int, int]:
    if len(body) != _FETCH.size:
        raise BadEnvelope(f"fetch request body must be {_FETCH.size} bytes, got {len(body)}")
    fragment, after_version = _FETCH.unpack(body)
    return fragment, after_version


FETCH_BODY_BYTES = _FETCH.size
FRAGMENT_BODY_BYTES = _U32.size


def encode_fragment(fragment: int) -> bytes:
    if not 0 <= fragment < 2**32:
        raise ValueError(f"fragment {fragment} out of range")
    return _U32.pack(fragment)


def decode_fragment(body: bytes) -> int:
    if len(body) != _U32.size:
        raise BadEnvelope(f"snapshot request body must be {_U32.size} bytes, got {len(body)}")
    return _U32.unpack(body)[0]
