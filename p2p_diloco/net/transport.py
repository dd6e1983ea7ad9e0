"""`P2PTransport`: the project's `Transport` over hivemind's libp2p streams, on its own event loop thread.

One libp2p protocol per operation (`keys.protocol_id`, so other runs and manifests cannot reach these
handlers). Every payload goes over a stream (no 4 MiB unary cap) in the `streams` envelope. The
inbound side answers with an `InboundHandlers` through a composed `net.serving.InboundServer` (whose
rejection reasons are re-exported here); the sender's ID is the authenticated connection's
peer ID (`stream_info.peer_id`), never anything in the payload. Inbound requests are checked against
the allowlist, per-peer and total stream limits, a header deadline and the op's size cap before their
bodies are read, and bodies must keep a minimum rate (`net.limits`: any peer may be hostile and hold
streams open; one that does only blocks itself); a handler that raises is logged and answered with a
``handler error`` rejection, and the peer keeps serving. Replies are read under the op's cap too
(`FrameCaps`: a snapshot reply is capped at the largest fragment's snapshot).

Handlers may answer with a `concurrent.futures.Future` (the node's driver posts each request to its
peer's owner thread); the transport awaits it, up to `answer_timeout`, on its own event loop, so it
runs no handler threads. Deltas and updates are answered with a typed `wire.replies.Reply`.

Outbound: `send_delta`/`push_update`/`relay` return at once and deliver in the background (optional
`on_reply(Reply)` callback, called on the transport's loop thread: keep it short);
`request_updates`/`request_snapshot` return futures; `fetch_updates`/`fetch_snapshot` block up to a
timeout. Failures are `TimeoutError`, `ConnectionError` or `RemoteRejected` (a `ConnectionError`). One
request's stream and the meaning of its answer are `net.outbound`'s.

This module owns the transport's lifecycle (its loop thread, the daemon connection, closing) and the
public API. Everything that moves bytes runs on the loop thread, which alone changes the counters
(`net.traffic`: bytes, served, rejected); other threads read `counts`, an immutable snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import hivemind
import uvloop
from hivemind.p2p import P2P

from p2p_diloco.net import streams
from p2p_diloco.net.addresses import parse_peer_id, tcp_endpoints
from p2p_diloco.net.limits import (
    DEFAULT_FRAME_BYTES,
    DEFAULT_REPLY_BYTES,
    FrameCaps,
    InboundLimits,
    OutboundSlots,
)
from p2p_diloco.net.liveness import probe_endpoints
from p2p_diloco.net.outbound import (
    REPLY_CLOSED,
    REPLY_TIMEOUT,
    REPLY_UNREACHABLE,
    OnReply,
    RemoteRejected,
    call_remote,
    delivery_reply,
    fetch_items,
)
from p2p_diloco.net.serving import (
    LINGER_SECONDS,
    REJECT_BAD_REQUEST,
    REJECT_BUSY,
    REJECT_HANDLER_ERROR,
    REJECT_HEADER_TIMEOUT,
    REJECT_PEER_BUSY,
    REJECT_TOO_LARGE,
    REJECT_TOO_SLOW,
    InboundServer,
)
from p2p_diloco.net.traffic import TrafficBook, TransportCounts
from p2p_diloco.owner import Owner
from p2p_diloco.wire import keys
from p2p_diloco.wire.interfaces import InboundHandlers, Liveness
from p2p_diloco.wire.replies import Reply, ReplyStatus
from p2p_diloco.wire.snapshot_chunks import encode_chunk_request

log = logging.getLogger(__name__)

__all__ = [
    "LINGER_SECONDS",
    "REJECT_BAD_REQUEST",
    "REJECT_BUSY",
    "REJECT_HANDLER_ERROR",
    "REJECT_HEADER_TIMEOUT",
    "REJECT_PEER_BUSY",
    "REJECT_TOO_LARGE",
    "REJECT_TOO_SLOW",
    "REPLY_CLOSED",
    "REPLY_TIMEOUT",
    "REPLY_UNREACHABLE",
    "OnReply",
    "P2PTransport",
    "RemoteRejected",
]


async def _daemon_listen_maddr(_dht: hivemind.DHT, node: Any) -> Any:
    return node.p2p.daemon_listen_maddr


class P2PTransport:
    """Transport for one run over the p2pd of `dht` (module docstring). Close it before the DHT.

    `handlers` are called on the transport's loop thread and must return at once: an answer, or a
    future of one (module docstring). `caps` bound request and reply sizes per op (by default every
    frame up to `max_frame_bytes`, a fetch's reply up to `max_reply_bytes`; `net.limits.run_frame_caps`
    gives a run's exact ones); `limits` bound inbound streams; `admit(op, peer)` refuses requests the
    run does not let a peer make (`net.admission.stream_admission`). `owner` is taken by the loop thread
    before it serves anything: handlers that keep state may check it (`p2p_diloco.owner`). Create DHTs before
    transports where possible: hivemind forks the DHT process, and forking while this class's threads run is
    best avoided.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        run_id: str,
        manifest_hash: str,
        handlers: InboundHandlers | None = None,
        max_frame_bytes: int = DEFAULT_FRAME_BYTES,
        max_reply_bytes: int = DEFAULT_REPLY_BYTES,
        caps: FrameCaps | None = None,
        limits: InboundLimits | None = None,
        send_timeout: float = 120.0,
        fetch_timeout: float = 120.0,
        allowed_peers: Collection[str] | None = None,
        answer_timeout: float = 10.0,
        admit: Callable[[str, str], bool] | None = None,
        owner: Owner | None = None,
    ):
        self.caps = caps if caps is not None else FrameCaps.uniform(max_frame_bytes, max_reply_bytes)
        self.limits = limits if limits is not None else InboundLimits()
        self.send_timeout = send_timeout
        self.fetch_timeout = fetch_timeout
        self.answer_timeout = answer_timeout
        # changed on the loop thread only, which takes `owner` first (the node's guard shares it)
        self._traffic = TrafficBook(owner or Owner("p2p-transport"))
        self._inbound = InboundServer(
            handlers,
            caps=self.caps,
            limits=self.limits,
            allowed_peers=allowed_peers,
            answer_timeout=answer_timeout,
            admit=admit,
            traffic=self._traffic,
        )
        self.allowed_peers = self._inbound.allowed_peers
        self.slots = self._inbound.slots  # inbound streams in progress, per peer
        self._outbound = OutboundSlots(self.limits.per_peer)  # as many to one peer as we would admit
        self._handlers = handlers
        self._protocols = {op: keys.protocol_id(run_id, manifest_hash, op) for op in keys.TRANSPORT_OPS}
        self._pending: set[concurrent.futures.Future[str]] = set()
        self._pending_lock = threading.Lock()
        self._closed = False
        daemon_maddr = dht.run_coroutine(_daemon_listen_maddr)
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="p2p-transport", daemon=True)
        self._loop.call_soon_threadsafe(self._traffic.owner.take)  # before any stream is served
        self._thread.start()
        try:
            self._p2p: P2P = self._submit(self._start(daemon_maddr)).result(timeout=30)
        except BaseException:
            self._stop_loop()
            raise
        self.peer_id: str = self._p2p.peer_id.to_base58()

    @property
    def counts(self) -> TransportCounts:
        """Bytes moved, requests served and rejected so far: an immutable snapshot (`net.traffic`)."""
        return self._traffic.counts

    @property
    def rejected(self) -> Mapping[str, int]:
        """Inbound rejections by tag (an immutable snapshot)."""
        return self._traffic.counts.rejected

    @property
    def served(self) -> Mapping[str, int]:
        """Inbound requests answered, by op (an immutable snapshot)."""
        return self._traffic.counts.served

    # ---- lifecycle -------------------------------------------------------------------------

    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("P2PTransport's blocking methods cannot be called from its own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self, daemon_maddr: Any) -> P2P:
        p2p = await P2P.replicate(daemon_maddr)
        if self._handlers is not None:
            for op, proto in self._protocols.items():
                await p2p.add_binary_stream_handler(proto, self._inbound.stream_handler(op))
        return p2p

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving, drop undelivered background sends, stop the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(self._async_close()).result(timeout=timeout)
        except Exception as exc:  # a dead daemon must not keep us from stopping the thread
            log.debug("transport close: %r", exc)
        self._stop_loop()

    async def _async_close(self) -> None:
        if self._handlers is not None:
            for proto in self._protocols.values():
                try:
                    await asyncio.wait_for(self._p2p.remove_binary_stream_handler(proto), 2.0)
                except Exception as exc:
                    log.debug("removing handler %s: %r", proto, exc)
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._p2p.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> P2PTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- outbound --------------------------------------------------------------------------

    def send_delta(self, to_peer: str, frame: bytes, on_reply: OnReply | None = None) -> None:
        """Deliver a delta frame in the background; `on_reply` gets the receiver's reason or a local one."""
        self._send_background(keys.OP_DELTA, to_peer, frame, on_reply)

    def push_update(self, to_peer: str, frame: bytes, on_reply: OnReply | None = None) -> None:
        self._send_background(keys.OP_UPDATE, to_peer, frame, on_reply)

    def relay(self, to_peer: str, frame: bytes) -> concurrent.futures.Future[Reply]:
        """Send a relay frame (an offer, or an update asked for) in the background; the future gets the
        receiver's `Reply`, or a local transient one when it could not be delivered (never fails)."""
        answer: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        self._send_background(keys.OP_RELAY, to_peer, frame, answer.set_result, quiet=True)
        return answer

    def send_and_wait(self, op: str, to_peer: str, frame: bytes, timeout: float | None = None) -> Reply:
        """Blocking delivery of a delta/update frame; returns the `Reply` `on_reply` would receive."""
        if op not in (keys.OP_DELTA, keys.OP_UPDATE, keys.OP_RELAY):
            raise ValueError(
                f"op must be {keys.OP_DELTA!r}, {keys.OP_UPDATE!r} or {keys.OP_RELAY!r}, got {op!r}"
            )
        parse_peer_id(to_peer, what="to_peer")
        return self._submit(self._deliver(op, to_peer, frame, timeout or self.send_timeout)).result()

    def _send_background(
        self, op: str, to_peer: str, frame: bytes, on_reply: OnReply | None, *, quiet: bool = False
    ) -> None:
        """`quiet`: a refusal is an answer, not worth a log line (a relay offer declined)."""
        parse_peer_id(to_peer, what="to_peer")
        if self._closed:
            self._notify(on_reply, Reply.transient(REPLY_CLOSED, "transport is closed"))
            return
        future = self._submit(self._deliver(op, to_peer, frame, self.send_timeout))
        with self._pending_lock:
            self._pending.add(future)

        def done(fut: concurrent.futures.Future[Reply]) -> None:
            with self._pending_lock:
                self._pending.discard(fut)
            if fut.cancelled():
                reply = Reply.transient(REPLY_CLOSED, f"{op} to {to_peer} dropped at shutdown")
            elif fut.exception() is not None:
                reply = Reply.transient(REPLY_UNREACHABLE, repr(fut.exception()))
            else:
                reply = fut.result()
            if not reply.ok and not (quiet and reply.status == ReplyStatus.REFUSED):
                log.info("%s to %s: %s", op, to_peer, reply)
            self._notify(on_reply, reply)

        future.add_done_callback(done)

    def _notify(self, on_reply: OnReply | None, reply: Reply) -> None:
        if on_reply is None:
            return
        try:
            on_reply(reply)
        except Exception:
            log.exception("on_reply callback failed")

    def flush(self, timeout: float) -> bool:
        """Wait until every background send has finished; False if some are still pending."""
        with self._pending_lock:
            pending = list(self._pending)
        _, not_done = concurrent.futures.wait(pending, timeout=timeout)
        return not not_done

    async def _deliver(self, op: str, to_peer: str, frame: bytes, timeout: float) -> Reply:
        """A delta/update round trip turned into one `Reply` (never raises)."""
        return await delivery_reply(self._call(op, to_peer, frame, *self.caps.reply(op)), to_peer, timeout)

    def probe(self, peer: str, addresses: Sequence[str] = ()) -> concurrent.futures.Future[Liveness]:
        """`Liveness` of `peer` from plain TCP connects to its `addresses` (its heartbeat's), not through
        libp2p, whose dial backoff after any failure hides why a dial failed: DOWN only if every address
        refused the connection (nobody listens: the process is gone). A frozen process's kernel still
        accepts connections, so it is never DOWN; a peer without a plain TCP address is UNKNOWN."""
        future: concurrent.futures.Future[Liveness] = concurrent.futures.Future()
        endpoints = tcp_endpoints(addresses)
        if self._closed or not endpoints:
            future.set_result(Liveness.UNKNOWN)
            return future
        return self._submit(probe_endpoints(endpoints))

    def fetch_updates(self, from_peer: str, fragment: int, after_version: int) -> list[bytes]:
        return self.request_updates(from_peer, fragment, after_version).result(timeout=self.fetch_timeout + 5)

    def fetch_snapshot(self, from_peer: str, fragment: int) -> bytes:
        return self.request_snapshot(from_peer, fragment).result(timeout=self.fetch_timeout + 5)

    def request_updates(
        self, from_peer: str, fragment: int, after_version: int
    ) -> concurrent.futures.Future[list[bytes]]:
        body = streams.encode_fetch(fragment, after_version)
        return self._request(keys.OP_FETCH_UPDATES, from_peer, body)

    def request_snapshot(self, from_peer: str, fragment: int) -> concurrent.futures.Future[bytes]:
        return self._request(keys.OP_FETCH_SNAPSHOT, from_peer, streams.encode_fragment(fragment))

    def request_chunk(
        self, from_peer: str, fragment: int, chunk: int, checksum: str, nbytes: int
    ) -> concurrent.futures.Future[bytes]:
        """One snapshot chunk; an answer longer than `nbytes` is refused before it is read."""
        body = encode_chunk_request(fragment, chunk, checksum)
        return self._request(keys.OP_FETCH_CHUNK, from_peer, body, max_item=nbytes)

    def _request(
        self, op: str, from_peer: str, body: bytes, max_item: int | None = None
    ) -> concurrent.futures.Future[Any]:
        """A fetch in the background: a future of its items (one frame for a snapshot index or chunk)."""
        parse_peer_id(from_peer, what="from_peer")
        if self._closed:
            failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
            failed.set_exception(ConnectionError(f"{REPLY_CLOSED}: transport is closed"))
            return failed
        return self._submit(self._fetch(op, from_peer, body, max_item))

    async def _fetch(self, op: str, from_peer: str, body: bytes, max_item: int | None = None) -> Any:
        item_cap, total_cap = self.caps.reply(op)
        if max_item is not None:  # a chunk: no more than the index says it holds
            item_cap, total_cap = min(item_cap, max_item), min(total_cap, max_item)
        call = self._call(op, from_peer, body, item_cap, total_cap)
        return await fetch_items(call, op, from_peer, self.fetch_timeout)

    async def _call(
        self, op: str, to_peer: str, body: bytes, max_item: int, max_total: int
    ) -> tuple[int, list[bytes]]:
        if to_peer == self.peer_id:
            return await self._inbound.answer_local(op, self.peer_id, body)
        async with self._outbound.slot(to_peer):
            protocol = self._protocols[op]
            return await call_remote(
                self._p2p, protocol, op, to_peer, body, max_item, max_total, self._traffic
            )
