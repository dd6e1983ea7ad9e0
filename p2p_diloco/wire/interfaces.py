"""The two small interfaces the project owns in front of hivemind: a key-value store and a transport.

The real peer implements them over hivemind's DHT and libp2p (`p2p_diloco.net`); tests and the
in-process swarm use `p2p_diloco.swarm.memory`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StoredValue:
    """One subkey's value as read back from the store, with its absolute expiration time."""

    value: bytes
    expiration: float


class KeyValueStore(Protocol):
    """Expiring records under key/subkey; for one key/subkey the later expiration wins (hivemind's rule)."""

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool: ...

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        """All live subkeys of `key` (expired ones dropped)."""
        ...


class Clock(Protocol):
    def now(self) -> float: ...


class Transport(Protocol):
    """Point-to-point messages between peers: deltas to the synchronizer, updates and snapshots back.

    Payloads are bytes produced by `p2p_diloco.wire.frames`; the receiver learns the sender's peer ID
    from the connection, not from the payload.
    """

    def bind(self, handlers: InboundHandlers) -> None:
        """Start answering incoming frames and requests with `handlers`."""
        ...

    def send_delta(self, to_peer: str, frame: bytes, on_reply: Callable[[str], None] | None = None) -> None:
        """Send in the background (never blocks training); `on_reply` gets the receiver's reason string."""
        ...

    def push_update(
        self, to_peer: str, frame: bytes, on_reply: Callable[[str], None] | None = None
    ) -> None: ...

    def fetch_updates(self, from_peer: str, fragment: int, after_version: int) -> list[bytes]: ...

    def fetch_snapshot(self, from_peer: str, fragment: int) -> bytes: ...


class InboundHandlers(Protocol):
    """What a peer answers on the transport. `sender` comes from the connection (authenticated peer ID).

    Handlers validate everything before use and never raise on bad input: they return a reason string
    (``"accepted"`` or a rejection reason) that goes back to the sender and into the rejection counters.
    """

    def handle_delta(self, sender: str, frame: bytes) -> str: ...

    def handle_update(self, sender: str, frame: bytes) -> str: ...

    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]: ...

    def serve_snapshot(self, requester: str, fragment: int) -> bytes: ...
