"""The two small interfaces the project owns in front of hivemind: a key-value store and a transport.

The real peer implements them over hivemind's DHT and libp2p (`p2p_diloco.net`); tests and the
in-process swarm use `p2p_diloco.swarm.memory`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from enum import StrEnum
from typing import NamedTuple, Protocol, runtime_checkable

from p2p_diloco.wire.replies import Reply


class StoredValue(NamedTuple):
    """One subkey's value as read back from the store, with its absolute expiration time. A tuple of
    atoms, which the garbage collector stops tracking: a simulated swarm holds hundreds of thousands (a
    frozen dataclass and its __dict__ were a fifth of the heap every full collection scanned at 256
    peers, issue #40)."""

    value: bytes
    expiration: float


class KeyValueStore(Protocol):
    """Expiring records under key/subkey; for one key/subkey the later expiration wins (hivemind's rule)."""

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool: ...

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        """All live subkeys of `key` (expired ones dropped)."""
        ...


@runtime_checkable
class ReadsMany(Protocol):
    """A store that reads several keys in one round (the DHT: every lookup in flight at once)."""

    def get_many(self, keys: Sequence[str], now: float) -> list[dict[str, StoredValue]]: ...


def get_many(kv: KeyValueStore, keys: Sequence[str], now: float) -> list[dict[str, StoredValue]]:
    """`kv.get` of every key, in one round where the store can (`ReadsMany`): the lease keys of the
    synchronizer shards cost one round trip per swarm tick, not one per shard."""
    if isinstance(kv, ReadsMany):
        return kv.get_many(keys, now)
    return [kv.get(key, now) for key in keys]


class Clock(Protocol):
    def now(self) -> float: ...


class Liveness(StrEnum):
    """What a probe of a peer showed. DOWN only when its address refused the connection: the process is
    gone. A frozen or unreachable peer is UNKNOWN (silence proves nothing; leases handle it)."""

    ALIVE = "alive"
    DOWN = "down"
    UNKNOWN = "unknown"


class Transport(Protocol):
    """Point-to-point messages between peers: deltas to the synchronizer, updates and snapshots back.

    Payloads are bytes produced by `p2p_diloco.wire.frames`; the receiver learns the sender's peer ID
    from the connection, not from the payload.
    """

    def bind(self, handlers: InboundHandlers) -> None:
        """Start answering incoming frames and requests with `handlers`."""
        ...

    def send_delta(self, to_peer: str, frame: bytes, on_reply: Callable[[Reply], None] | None = None) -> None:
        """Send in the background (never blocks); `on_reply` gets the receiver's `Reply` (or a local
        `TRANSIENT` one when the frame could not be delivered)."""
        ...

    def push_update(
        self, to_peer: str, frame: bytes, on_reply: Callable[[Reply], None] | None = None
    ) -> None: ...

    def relay(self, to_peer: str, frame: bytes) -> Future[Reply]:
        """Send a relay frame (`wire.relay_frames`: an offer, or an update asked for) in the background;
        the future gets the receiver's `Reply` (a local `TRANSIENT` one if undelivered), never fails."""
        ...

    def probe(self, peer: str, addresses: Sequence[str] = ()) -> Future[Liveness]:
        """Whether `peer`'s process is there (reached at `addresses`, its heartbeat's), within about a
        second; the future never fails."""
        ...

    def request_updates(self, from_peer: str, fragment: int, after_version: int) -> Future[list[bytes]]:
        """Fetch update frames in the background; the future fails with ConnectionError/TimeoutError."""
        ...

    def request_snapshot(self, from_peer: str, fragment: int) -> Future[bytes]:
        """The index frame of the source's current state of `fragment` (`wire.snapshot_chunks`)."""
        ...

    def request_chunk(
        self, from_peer: str, fragment: int, chunk: int, checksum: str, nbytes: int
    ) -> Future[bytes]:
        """One snapshot chunk; the future fails (ConnectionError) if the answer exceeds `nbytes`."""
        ...


class InboundHandlers(Protocol):
    """What a peer answers on the transport. `sender` comes from the connection (authenticated peer ID).

    Handlers validate everything before use and never raise on bad input: they answer a `Reply` that goes
    back to the sender. A handler may instead return a `Future` of its answer (a peer whose owner thread
    answers later); the transport then awaits it.
    """

    def handle_delta(self, sender: str, frame: bytes) -> Reply | Future[Reply]: ...

    def handle_update(self, sender: str, frame: bytes) -> Reply | Future[Reply]: ...

    def handle_relay(self, sender: str, frame: bytes) -> Reply | Future[Reply]: ...

    def serve_updates(
        self, requester: str, fragment: int, after_version: int
    ) -> list[bytes] | Future[list[bytes]]: ...

    def serve_snapshot(self, requester: str, fragment: int) -> bytes | Future[bytes]: ...

    def serve_chunk(self, requester: str, fragment: int, chunk: int, checksum: str) -> bytes:
        """A chunk of a pinned snapshot, answered at once off the owner thread; raises LookupError if
        that state is not served here."""
        ...
