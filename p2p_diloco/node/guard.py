"""Thread safety between the training thread and the transport's threads, and the DHT clock.

The real peer has one `Peer` (sans-IO, not thread-safe) used from three places: the training thread
(steps and ticks), the transport's handler workers (inbound deltas, updates, fetches) and its reply
thread (`on_reply` callbacks of background sends). Every call into the `Peer` goes through one
re-entrant `PeerLock`:

* `GuardedHandlers` is the `InboundHandlers` the transport serves. It takes the lock (with a timeout,
  so two peers fetching from each other while both hold their locks cannot wait forever), never lets
  an exception out of `handle_delta`/`handle_update` (logged, counted, answered with a reason) and
  answers before the `Peer` is attached or after it is detached (shutdown) with a rejection.
* `LockedTransport` is the `Transport` the `Peer` sees: it wraps `on_reply` callbacks so they run
  under the lock, and implements `bind` (P2PTransport takes its handlers at construction).

Network I/O never happens under the lock: `UnlockedKeyValueStore` and `LockedTransport`'s fetches
release it for the duration of the call (`PeerLock.released`). The `Peer` code around those calls
re-reads what it depends on afterwards (versions are checked again before applying, an older snapshot
is refused), so letting another thread in meanwhile is safe; and two peers fetching from each other
can never deadlock, and heartbeats and lease renewals never wait for a slow DHT lookup of another
thread.

Python's locks are not fair, but no thread holds this one for long: the training thread takes it only
between inner steps (to send a delta), not for the step itself (`node.runtime`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.wire.interfaces import InboundHandlers, KeyValueStore, StoredValue

log = logging.getLogger(__name__)

# reasons the guard itself answers with (tags, followed by details)
REJECT_NOT_READY = "not ready"  # the peer is still starting or already shutting down
REJECT_BUSY = "busy"  # the peer's lock was not free within the handler's timeout
REJECT_HANDLER_ERROR = "handler error"  # the handler raised: a bug, logged with its traceback

HANDLE_LOCK_TIMEOUT = 10.0  # deltas and updates: worth waiting for one training step
SERVE_LOCK_TIMEOUT = 2.0  # fetches: the requester has other sources, and may itself hold its lock


class PeerLock:
    """The re-entrant lock around every call into the `Peer` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, timeout: float = -1) -> bool:
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> PeerLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Fully release the lock if this thread holds it (at any depth) for the block, then restore it."""
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            yield
            return
        saved = self._lock._release_save()  # type: ignore[attr-defined]  # what threading.Condition uses
        try:
            yield
        finally:
            self._lock._acquire_restore(saved)  # type: ignore[attr-defined]


class DhtClock:
    """`Clock` over hivemind's DHT time (absolute seconds: DHT expirations are absolute times)."""

    def now(self) -> float:
        return get_dht_time()


class ServeRefused(RuntimeError):
    """A snapshot request could not be served; the transport answers the requester with this reason."""


class GuardedHandlers:
    """`InboundHandlers` that serialize every call into the attached `Peer` with `lock` (module docstring)."""

    def __init__(
        self,
        lock: PeerLock,
        *,
        on_applied: Callable[[str, bytes, str], None] | None = None,
        handle_timeout: float = HANDLE_LOCK_TIMEOUT,
        serve_timeout: float = SERVE_LOCK_TIMEOUT,
    ):
        self.lock = lock
        self.handle_timeout = handle_timeout
        self.serve_timeout = serve_timeout
        self.rejections: Counter[str] = Counter()  # the guard's own rejections, by tag
        self._peer: InboundHandlers | None = None
        self._on_applied = on_applied  # (sender, frame, reply) after an update frame was applied

    def attach(self, peer: InboundHandlers) -> None:
        self._peer = peer

    def detach(self) -> None:
        """From now on every request is answered `not ready` (called at shutdown, under the lock)."""
        self._peer = None

    def _refuse(self, op: str, sender: str, tag: str, detail: str) -> str:
        self.rejections[tag] += 1
        level = logging.INFO if tag == REJECT_NOT_READY else logging.WARNING
        log.log(level, "%s from %s refused: %s: %s", op, sender, tag, detail)
        return f"{tag}: {detail}"

    def _handle(self, op: str, sender: str, call: Callable[[InboundHandlers], str]) -> str:
        if not self.lock.acquire(timeout=self.handle_timeout):
            return self._refuse(op, sender, REJECT_BUSY, f"peer busy for {self.handle_timeout:.0f} s")
        try:
            peer = self._peer
            if peer is None:
                return self._refuse(op, sender, REJECT_NOT_READY, "peer is starting or shutting down")
            reply = call(peer)
            if not isinstance(reply, str):
                raise TypeError(f"{op} handler returned {type(reply).__name__}, expected str")
            return reply
        except Exception as exc:
            log.exception("%s handler failed on a frame from %s", op, sender)
            return self._refuse(op, sender, REJECT_HANDLER_ERROR, f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            self.lock.release()

    def handle_delta(self, sender: str, frame: bytes) -> str:
        return self._handle("delta", sender, lambda peer: peer.handle_delta(sender, frame))

    def handle_update(self, sender: str, frame: bytes) -> str:
        reply = self._handle("update", sender, lambda peer: peer.handle_update(sender, frame))
        if self._on_applied is not None and reply.startswith("applied"):
            self._on_applied(sender, frame, reply)
        return reply

    def _serve(self, op: str, requester: str, call: Callable[[InboundHandlers], object]) -> object:
        if not self.lock.acquire(timeout=self.serve_timeout):
            raise ServeRefused(self._refuse(op, requester, REJECT_BUSY, "peer busy; ask another peer"))
        try:
            peer = self._peer
            if peer is None:
                raise ServeRefused(self._refuse(op, requester, REJECT_NOT_READY, "peer not serving"))
            return call(peer)
        except ServeRefused:
            raise
        except Exception as exc:
            log.exception("%s failed for %s", op, requester)
            detail = f"{type(exc).__name__}: {str(exc)[:200]}"
            raise ServeRefused(self._refuse(op, requester, REJECT_HANDLER_ERROR, detail)) from exc
        finally:
            self.lock.release()

    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
        """The requester's replay source; an empty list when busy (it falls back to other peers)."""
        try:
            frames = self._serve(
                "fetch-updates",
                requester,
                lambda peer: peer.serve_updates(requester, fragment, after_version),
            )
        except ServeRefused:
            return []
        assert isinstance(frames, list)
        return frames

    def serve_snapshot(self, requester: str, fragment: int) -> bytes:
        """Raises `ServeRefused` (the transport's rejection path) when it cannot serve."""
        snapshot = self._serve(
            "fetch-snapshot", requester, lambda peer: peer.serve_snapshot(requester, fragment)
        )
        assert isinstance(snapshot, bytes)
        return snapshot


class LockedTransport:
    """The `Transport` a `Peer` uses in the real node: `inner` with callbacks run under `lock`."""

    def __init__(self, inner, lock: PeerLock, guard: GuardedHandlers):
        self.inner = inner
        self.lock = lock
        self.guard = guard

    def bind(self, handlers: InboundHandlers) -> None:
        self.guard.attach(handlers)

    def _locked(self, on_reply: Callable[[str], None] | None) -> Callable[[str], None] | None:
        if on_reply is None:
            return None

        def call(reason: str) -> None:
            with self.lock:
                on_reply(reason)

        return call

    def send_delta(self, to_peer: str, frame: bytes, on_reply: Callable[[str], None] | None = None) -> None:
        self.inner.send_delta(to_peer, frame, self._locked(on_reply))

    def push_update(self, to_peer: str, frame: bytes, on_reply: Callable[[str], None] | None = None) -> None:
        self.inner.push_update(to_peer, frame, self._locked(on_reply))

    def fetch_updates(self, from_peer: str, fragment: int, after_version: int) -> list[bytes]:
        with self.lock.released():
            return self.inner.fetch_updates(from_peer, fragment, after_version)

    def fetch_snapshot(self, from_peer: str, fragment: int) -> bytes:
        with self.lock.released():
            return self.inner.fetch_snapshot(from_peer, fragment)


class UnlockedKeyValueStore:
    """`inner` with `lock` released during every DHT call (see the module docstring)."""

    def __init__(self, inner: KeyValueStore, lock: PeerLock):
        self.inner = inner
        self.lock = lock

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        with self.lock.released():
            return self.inner.store(key, subkey, value, expiration)

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        with self.lock.released():
            return self.inner.get(key, now)
