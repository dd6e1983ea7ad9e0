"""The inbound side of `P2PTransport`: answering the requests other peers open streams for.

`InboundServer` owns what serving needs: the `InboundHandlers`, the allowlist, the stream slots and
deadlines of `net.limits.InboundLimits` and the per-op size caps of `net.limits.FrameCaps`; it counts the
bytes it reads and writes, requests answered (`served`) and rejected (`rejected`, by tag) in the
transport's `net.traffic.TrafficBook` (on the loop thread; `served` and `rejected` read its snapshot). Any
peer may be hostile and hold streams open, so every stream is bounded before its body is read: the sender must
be on the allowlist, hold fewer than `per_peer` streams (and all strangers together fewer than `total`), send
its header within `header_timeout`, claim no more than the op's cap, and then keep the body above
`min_body_rate`. A stream that breaks a deadline is closed at once (``header timeout``, ``too slow``); other
rejections are answered with their reason. A handler may answer with a `concurrent.futures.Future`, awaited up
to `answer_timeout`; a handler that raises is logged and answered with a ``handler error`` rejection.
After an early rejection the stream lingers (`LINGER_SECONDS`, at most `max_lingering` streams at once)
so the rejection is not overtaken by a reset. The transport composes one and registers
`stream_handler(op)` for each operation; calls to ourselves go through `answer_local` with the same
size checks and no network.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from p2p_diloco.errors import DecodeError
from p2p_diloco.net import streams
from p2p_diloco.net.limits import (
    REJECT_BUSY,
    REJECT_HEADER_TIMEOUT,
    REJECT_PEER_BUSY,
    REJECT_TOO_SLOW,
    FrameCaps,
    InboundLimits,
    StreamSlots,
)
from p2p_diloco.net.traffic import TrafficBook
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.wire import keys
from p2p_diloco.wire.interfaces import InboundHandlers
from p2p_diloco.wire.replies import Reply, decode_reply, encode_reply
from p2p_diloco.wire.snapshot_chunks import decode_chunk_request

log = logging.getLogger("p2p_diloco.net.transport")  # the transport's logger, as before the split

# reasons of inbound rejections (sent back to the caller)
REJECT_TOO_LARGE = "frame too large"
REJECT_BAD_REQUEST = "bad request"
REJECT_HANDLER_ERROR = "handler error"
REJECT_UNKNOWN_SNAPSHOT = "unknown snapshot"  # a chunk of a state this peer does not (or no longer) serve

LINGER_SECONDS = 5.0  # how long a rejecting receiver drains a sender that is still writing
DROP_WRITE_SECONDS = 1.0  # how long we try to tell a dropped stream why before closing it

__all__ = [
    "LINGER_SECONDS",
    "REJECT_BAD_REQUEST",
    "REJECT_BUSY",
    "REJECT_HANDLER_ERROR",
    "REJECT_HEADER_TIMEOUT",
    "REJECT_PEER_BUSY",
    "REJECT_TOO_LARGE",
    "REJECT_TOO_SLOW",
    "InboundServer",
    "reply_items",
]


class _Dropped(Exception):
    """A stream that broke a deadline: counted already; told why if it still listens, then closed."""

    def __init__(self, answer: bytes):
        self.answer = answer  # the encoded rejection `Reply`
        super().__init__(decode_reply(answer).reason)


class InboundServer:
    """Answers inbound requests with `handlers` (module docstring); runs on the transport's loop."""

    def __init__(
        self,
        handlers: InboundHandlers | None,
        *,
        caps: FrameCaps,
        limits: InboundLimits,
        allowed_peers: Collection[str] | None,
        answer_timeout: float,
        admit: Callable[[str, str], bool] | None = None,
        traffic: TrafficBook | None = None,
    ):
        self.handlers = handlers
        self.caps = caps
        self.limits = limits
        self.allowed_peers = frozenset(allowed_peers) if allowed_peers is not None else None
        self.admit = admit  # (op, peer) -> whether the run lets `peer` make this request at all
        self.answer_timeout = answer_timeout
        self.traffic = traffic if traffic is not None else TrafficBook()
        self.slots = StreamSlots(limits)
        self._lingering = 0

    @property
    def rejected(self) -> Mapping[str, int]:
        """Inbound rejections by tag (an immutable snapshot)."""
        return self.traffic.counts.rejected

    @property
    def served(self) -> Mapping[str, int]:
        """Inbound requests answered, by op (an immutable snapshot)."""
        return self.traffic.counts.served

    def stream_handler(self, op: str) -> Callable[..., Any]:
        async def handle(
            stream_info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            sender = stream_info.peer_id.to_base58()
            timeout = self.limits.request_timeout
            try:
                try:
                    status, items = await asyncio.wait_for(self._answer(op, sender, reader), timeout)
                except _Dropped as dropped:  # no lingering: the sender broke a deadline
                    reply = streams.write_reply(writer, streams.STATUS_REJECTED, [dropped.answer])
                    await asyncio.wait_for(reply, DROP_WRITE_SECONDS)
                    return
                await asyncio.wait_for(streams.write_reply(writer, status, items), timeout)
                self.traffic.moved(sent=sum(map(len, items)))
                if status != streams.STATUS_OK:
                    await self._linger(reader, writer)
            except Exception as exc:  # a broken or slow stream must never take the peer down
                log.info("%s from %s: stream dropped: %r", op, sender, exc)
            finally:
                writer.close()

        return handle

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """After an early rejection: end our side, then discard what the sender still sends until it closes.

        Closing with unread input makes the daemons reset the stream, and a reset can overtake the
        rejection we just wrote; the sender stops writing and closes as soon as it reads our reply.
        """
        if writer.can_write_eof():
            writer.write_eof()
        if self._lingering >= self.limits.max_lingering:  # many rejected at once: close, reset or not
            return
        self._lingering += 1
        try:
            deadline = asyncio.get_running_loop().time() + LINGER_SECONDS
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                if not await asyncio.wait_for(reader.read(streams.WRITE_CHUNK), left):
                    return
        finally:
            self._lingering -= 1

    def _reject(self, op: str, sender: str, tag: str, detail: str) -> tuple[int, list[bytes]]:
        self.traffic.rejected(tag)
        reply = Reply.refused(tag, detail)
        log.info("rejected %s from %s: %s", op, sender, reply)
        return streams.STATUS_REJECTED, [encode_reply(reply)]

    def _drop(self, op: str, sender: str, tag: str, detail: str) -> _Dropped:
        return _Dropped(self._reject(op, sender, tag, detail)[1][0])

    async def _answer(self, op: str, sender: str, reader: asyncio.StreamReader) -> tuple[int, list[bytes]]:
        if self.allowed_peers is not None and sender not in self.allowed_peers:
            return self._reject(
                op, sender, AdmissionTag.NOT_ALLOWED, f"{sender} is not on this run's allowlist"
            )
        if self.admit is not None and not self.admit(op, sender):
            return self._reject(
                op, sender, AdmissionTag.NOT_ALLOWED, f"{sender} may not send {op} requests in this run"
            )
        refused = self.slots.acquire(sender)
        if refused is not None:
            return self._reject(op, sender, *refused)
        limits = self.limits
        try:
            header = streams.read_request_header(reader, self.caps.request(op))
            try:
                length = await asyncio.wait_for(header, limits.header_timeout)
            except TimeoutError:
                detail = f"no request header within {limits.header_timeout:g} s"
                raise self._drop(op, sender, REJECT_HEADER_TIMEOUT, detail) from None
            except streams.FrameTooLarge as exc:
                return self._reject(op, sender, REJECT_TOO_LARGE, str(exc))
            except streams.BadEnvelope as exc:
                return self._reject(op, sender, REJECT_BAD_REQUEST, str(exc))
            try:
                body = await streams.read_body(
                    reader, length, min_rate=limits.min_body_rate, grace=limits.body_grace
                )
            except streams.TooSlow as exc:
                raise self._drop(op, sender, REJECT_TOO_SLOW, str(exc)) from None
            self.traffic.moved(received=len(body))
            return await self._dispatch(op, sender, body)
        finally:
            self.slots.release(sender)

    async def answer_local(self, op: str, sender: str, body: bytes) -> tuple[int, list[bytes]]:
        """A call to ourselves (the synchronizer is also a learner): same checks, no network."""
        if self.handlers is None:
            raise ConnectionError(f"{op} to self: this transport serves no handlers")
        if len(body) > self.caps.request(op):
            limit_error = streams.FrameTooLarge(len(body), self.caps.request(op), "frame")
            return self._reject(op, sender, REJECT_TOO_LARGE, str(limit_error))
        return await self._dispatch(op, sender, body)

    async def _dispatch(self, op: str, sender: str, body: bytes) -> tuple[int, list[bytes]]:
        handlers = self.handlers
        assert handlers is not None
        try:
            if op == keys.OP_FETCH_UPDATES:
                fragment, after = streams.decode_fetch(body)
                call: Callable[[], Any] = lambda: handlers.serve_updates(sender, fragment, after)  # noqa: E731
            elif op == keys.OP_FETCH_SNAPSHOT:
                fragment = streams.decode_fragment(body)
                call = lambda: handlers.serve_snapshot(sender, fragment)  # noqa: E731
            elif op == keys.OP_FETCH_CHUNK:
                try:
                    fragment, chunk, checksum = decode_chunk_request(body)
                except DecodeError as exc:
                    raise streams.BadEnvelope(str(exc)) from exc
                call = lambda: handlers.serve_chunk(sender, fragment, chunk, checksum)  # noqa: E731
            elif op == keys.OP_DELTA:
                call = lambda: handlers.handle_delta(sender, body)  # noqa: E731
            elif op == keys.OP_RELAY:
                call = lambda: handlers.handle_relay(sender, body)  # noqa: E731
            else:
                call = lambda: handlers.handle_update(sender, body)  # noqa: E731
        except streams.BadEnvelope as exc:
            return self._reject(op, sender, REJECT_BAD_REQUEST, str(exc))
        try:
            result = call()
            if isinstance(result, concurrent.futures.Future):
                try:
                    result = await asyncio.wait_for(asyncio.wrap_future(result), self.answer_timeout)
                except TimeoutError:
                    detail = f"no answer from the peer within {self.answer_timeout:.0f} s"
                    return self._reject(op, sender, REJECT_BUSY, detail)
            items = reply_items(op, result)
        except LookupError as exc:  # a chunk of a state not served here: the requester asks another peer
            return self._reject(op, sender, REJECT_UNKNOWN_SNAPSHOT, str(exc)[:200])
        except Exception as exc:
            log.warning("%s handler failed on a request from %s", op, sender, exc_info=True)
            return self._reject(op, sender, REJECT_HANDLER_ERROR, f"{type(exc).__name__}: {str(exc)[:200]}")
        self.traffic.served(op)
        return streams.STATUS_OK, items


def reply_items(op: str, result: Any) -> list[bytes]:
    """A handler's answer as the items of the reply envelope; TypeError if it is not what `op` answers."""
    if op in (keys.OP_DELTA, keys.OP_UPDATE, keys.OP_RELAY):
        if not isinstance(result, Reply):
            raise TypeError(f"{op} handler returned {type(result).__name__}, expected a Reply")
        return [encode_reply(result)]
    if op in (keys.OP_FETCH_SNAPSHOT, keys.OP_FETCH_CHUNK):
        if not isinstance(result, bytes | bytearray):
            raise TypeError(f"serve_snapshot/serve_chunk returned {type(result).__name__}, expected bytes")
        return [bytes(result)]
    if not isinstance(result, list) or not all(isinstance(item, bytes | bytearray) for item in result):
        raise TypeError("serve_updates must return a list of bytes")
    return [bytes(item) for item in result]
