"""Streamed snapshots on a peer: serving a fragment state in chunks, and downloading one from several peers.

`SnapshotServer` (serving side). The owner offers each fragment's current state every heartbeat period
and after loading one (references only). A snapshot request is answered off the owner thread (the
driver's I/O thread hashes the chunks; the owner may be busy merging for seconds): it pins the offered
state, which costs nothing while the replica holds the same tensors (they
are never changed in place) and at most one fragment's Θ and m once the replica moves on, and answers
the index (`wire.snapshot_chunks`). Chunk requests are then answered from the pinned state directly on
the transport's thread (the store is locked and its tensors immutable), so a download of hundreds of
chunks never queues behind the peer's owner. Pins are bounded (`[limits] snapshot_pins`, least recently
used dropped first) and dropped after `snapshot_pin_seconds` without a request; a chunk of an unpinned
state is refused (`UnknownSnapshot`) and the requester asks another peer.

`ChunkedDownload` (requesting side): a pure state machine over the chunks of one fragment and the
sources that announced the same index. `requests()` hands out up to `in_flight` chunks per source,
different chunks to different sources; `accept` checks a chunk (exact size, digest) and copies it into
the target tensors; `fail` drops a source that sent a bad chunk and gives its chunks to the others,
`strike` gives a failed request's chunk back and drops the source after `MAX_STRIKES` failures (a source
that dies midway costs only its chunks in flight). Memory: the fragment's target tensors plus the chunks in
flight.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from p2p_diloco.wire.snapshot_chunks import (
    THETA,
    Chunk,
    SnapshotIndex,
    chunk_digest,
    chunk_layout,
    encode_index,
)

# reasons a chunk is refused (tags of the requester's journal)
BAD_CHUNK_SIZE = "bad chunk size"
BAD_CHUNK_DIGEST = "bad chunk digest"
MAX_STRIKES = 3  # failed chunk requests before a source is dropped


class UnknownSnapshot(LookupError):
    """A chunk of a fragment state this peer does not (or no longer) serve."""


def _chunk_bytes(tensors: tuple[Mapping[str, Tensor], Mapping[str, Tensor]], chunk: Chunk) -> bytes:
    flat = tensors[chunk.part][chunk.name].reshape(-1)[chunk.start : chunk.start + chunk.count]
    return flat.contiguous().numpy().tobytes()


@dataclass
class _Pin:
    index: SnapshotIndex
    layout: list[Chunk]
    tensors: tuple[Mapping[str, Tensor], Mapping[str, Tensor]]
    last_used: float | None  # None: pinned by an index request (which carries no time), fresh until seen


class SnapshotServer:
    """Pinned fragment states served in chunks (module docstring). Thread-safe."""

    def __init__(
        self, run_id: str, manifest_hash: str, *, chunk_bytes: int, max_pins: int, pin_seconds: float
    ):
        self.run_id, self.manifest_hash = run_id, manifest_hash
        self.chunk_bytes, self.max_pins, self.pin_seconds = chunk_bytes, max_pins, pin_seconds
        self._pins: OrderedDict[tuple[int, str], _Pin] = OrderedDict()
        self._offers: dict[int, tuple[int, str, dict, dict]] = {}
        self._lock = threading.Lock()
        self.chunks_served = 0

    def index(
        self,
        fragment: int,
        version: int,
        checksum: str,
        params: Mapping[str, Tensor],
        momentum: Mapping[str, Tensor],
        now: float | None = None,
    ) -> bytes:
        """Pin this fragment state (if not yet) and return its index frame. `params`/`momentum` must be the
        replica's own (never changed in place) tensors, in plan order."""
        key = (fragment, checksum)
        with self._lock:
            if now is not None:
                self._expire(now)
            pin = self._pins.get(key)
            if pin is not None:
                pin.last_used = now
                self._pins.move_to_end(key)
                return encode_index(pin.index)
        shapes = {name: tuple(t.shape) for name, t in params.items()}
        layout = chunk_layout(shapes, self.chunk_bytes)
        tensors = (dict(params), dict(momentum))
        digests = tuple(chunk_digest(_chunk_bytes(tensors, c)) for c in layout)
        index = SnapshotIndex(
            self.run_id, self.manifest_hash, fragment, version, checksum, self.chunk_bytes, digests
        )
        with self._lock:
            self._pins[key] = _Pin(index, layout, tensors, now)
            self._pins.move_to_end(key)
            while len(self._pins) > self.max_pins:
                self._pins.popitem(last=False)
        return encode_index(index)

    def chunk(self, fragment: int, number: int, checksum: str, now: float) -> bytes:
        """The raw bytes of chunk `number` of a pinned state; `UnknownSnapshot` if not pinned."""
        with self._lock:
            self._expire(now)
            pin = self._pins.get((fragment, checksum))
            if pin is None:
                raise UnknownSnapshot(
                    f"fragment {fragment} state {checksum[:16]} is not served here (ask for its index first)"
                )
            if not 0 <= number < len(pin.layout):
                raise UnknownSnapshot(f"fragment {fragment} has {len(pin.layout)} chunks, not {number + 1}")
            pin.last_used = now
            self._pins.move_to_end((fragment, checksum))
            chunk, tensors = pin.layout[number], pin.tensors
        self.chunks_served += 1
        return _chunk_bytes(tensors, chunk)

    def expire(self, now: float) -> None:
        """Drop the pins idle longer than `pin_seconds` (the peer calls this every heartbeat period)."""
        with self._lock:
            self._expire(now)

    def offer(
        self,
        fragment: int,
        version: int,
        checksum: str,
        params: Mapping[str, Tensor],
        momentum: Mapping[str, Tensor],
    ) -> None:
        """The owner's note of a fragment's current state (references: free), which index requests served
        off the owner thread (`index_offered`) announce; refreshed every heartbeat period and on loads."""
        with self._lock:
            self._offers[fragment] = (version, checksum, dict(params), dict(momentum))

    def offered(self, fragment: int) -> bool:
        with self._lock:
            return fragment in self._offers

    def index_offered(self, fragment: int) -> bytes:
        """`index` of the offered state of `fragment` (any thread; hashes it if not pinned yet)."""
        with self._lock:
            offer = self._offers.get(fragment)
        if offer is None:
            raise UnknownSnapshot(f"fragment {fragment} is not offered here")
        return self.index(fragment, *offer)

    def _expire(self, now: float) -> None:
        for pin in self._pins.values():
            if pin.last_used is None:
                pin.last_used = now
        for key in [k for k, pin in self._pins.items() if now - pin.last_used > self.pin_seconds]:
            del self._pins[key]

    def pinned(self) -> int:
        with self._lock:
            return len(self._pins)


class ChunkedDownload:
    """One fragment's chunks from several sources that announced the same `index` (module docstring)."""

    def __init__(
        self,
        index: SnapshotIndex,
        shapes: Mapping[str, tuple[int, ...]],
        sources: list[str],
        *,
        in_flight: int,
    ):
        self.index = index
        self.layout = chunk_layout(shapes, index.chunk_bytes)
        if len(self.layout) != index.count:
            raise ValueError(
                f"index lists {index.count} chunks, the fragment's layout has {len(self.layout)}"
            )
        self.params = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
        self.momentum = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
        self.sources = list(dict.fromkeys(sources))
        self.in_flight = in_flight
        self.missing = list(range(len(self.layout)))  # not yet requested, or given back
        self.pending: dict[int, str] = {}  # chunk -> source it was asked from
        self.bytes_from: dict[str, int] = {s: 0 for s in self.sources}
        self.failed: dict[str, str] = {}  # source -> why it was dropped
        self.strikes: dict[str, int] = {}  # source -> failed requests so far

    @property
    def done(self) -> bool:
        return not self.missing and not self.pending

    def requests(self) -> list[tuple[str, int]]:
        """(source, chunk) pairs to ask now: up to `in_flight` open per live source, round robin."""
        out = []
        open_per = {s: 0 for s in self.sources}
        for source in self.pending.values():
            open_per[source] = open_per.get(source, 0) + 1
        progress = True
        while self.missing and progress:
            progress = False
            for source in self.sources:
                if self.missing and open_per[source] < self.in_flight:
                    number = self.missing.pop(0)
                    self.pending[number] = source
                    open_per[source] += 1
                    out.append((source, number))
                    progress = True
        return out

    def expected_bytes(self, number: int) -> int:
        return self.layout[number].nbytes

    def accept(self, source: str, number: int, data: bytes) -> tuple[str, str] | None:
        """Check and place one chunk; (tag, detail) if it is refused (the caller then `fail`s the source)."""
        chunk = self.layout[number]
        if len(data) != chunk.nbytes:
            return (BAD_CHUNK_SIZE, f"chunk {number} is {len(data)} bytes, expected {chunk.nbytes}")
        if chunk_digest(data) != self.index.digests[number]:
            return (BAD_CHUNK_DIGEST, f"chunk {number} does not match its digest in the index")
        target = (self.params if chunk.part == THETA else self.momentum)[chunk.name].view(-1)
        target[chunk.start : chunk.start + chunk.count] = torch.frombuffer(
            bytearray(data), dtype=torch.float32
        )
        self.pending.pop(number, None)
        self.bytes_from[source] = self.bytes_from.get(source, 0) + len(data)
        return None

    def strike(self, source: str, number: int, reason: str) -> None:
        """A chunk request to `source` failed (busy, timed out, connection lost): the chunk goes back, and
        the source is dropped after `MAX_STRIKES` failures (a dead one fails fast)."""
        self.release(source, number)
        self.strikes[source] = self.strikes.get(source, 0) + 1
        if self.strikes[source] >= MAX_STRIKES:
            self.fail(source, reason)

    def fail(self, source: str, reason: str) -> None:
        """Drop `source` (dead, or it sent a bad chunk); its open chunks go back to the others."""
        if source in self.sources:
            self.sources.remove(source)
            self.failed[source] = reason
        back = sorted(n for n, s in self.pending.items() if s == source)
        for number in back:
            del self.pending[number]
        self.missing = sorted(set(self.missing) | set(back))

    def release(self, source: str, number: int) -> None:
        """A chunk request of `source` came back without a usable answer: ask someone for it again."""
        if self.pending.get(number) == source:
            del self.pending[number]
            self.missing = sorted(set(self.missing) | {number})
