"""The outbound side of `P2PTransport`: one request over a libp2p stream, and what its answer means.

`call_remote` opens a stream to a peer, writes the request and reads the reply under the op's caps (on
the transport's loop thread, which counts the bytes it moved in the transport's `TrafficBook`);
`delivery_reply` turns a delta/update round trip into one typed `Reply` (never raises) and
`fetch_items` a fetch's answer into its items, or `RemoteRejected` / `ConnectionError`. The reasons of
local delivery failures (`REPLY_*`) are the transport's; inbound rejections are `net.serving`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hivemind.p2p import P2P, PeerID

from p2p_diloco.errors import DecodeError
from p2p_diloco.net import streams
from p2p_diloco.net.liveness import refused
from p2p_diloco.net.serving import (
    REJECT_BAD_REQUEST,
    REJECT_BUSY,
    REJECT_HANDLER_ERROR,
    REJECT_HEADER_TIMEOUT,
    REJECT_PEER_BUSY,
    REJECT_TOO_SLOW,
)
from p2p_diloco.net.traffic import TrafficBook
from p2p_diloco.wire import keys
from p2p_diloco.wire.replies import LinkTag, Reply, ReplyStatus, decode_reply

# reasons of local delivery failures (to on_reply); inbound rejections are `net.serving`'s
REPLY_TIMEOUT = "transport timeout"
REPLY_UNREACHABLE = "transport unreachable"
REPLY_CLOSED = "transport closed"
# inbound rejections a sender may retry later (the receiver was busy, or its limits cut this stream)
TRANSIENT_REJECTIONS = frozenset(
    (REJECT_BUSY, REJECT_PEER_BUSY, REJECT_HANDLER_ERROR, REJECT_HEADER_TIMEOUT, REJECT_TOO_SLOW)
)

OnReply = Callable[[Reply], None]


class RemoteRejected(ConnectionError):
    """The remote peer answered with a rejection; `reason` is its reason string."""

    def __init__(self, peer: str, op: str, reason: str):
        self.reason = reason
        super().__init__(f"{peer} rejected {op}: {reason}")


async def call_remote(
    p2p: P2P,
    protocol: str,
    op: str,
    to_peer: str,
    body: bytes,
    max_item: int,
    max_total: int,
    traffic: TrafficBook,
) -> tuple[int, list[bytes]]:
    """Write `body` on a new stream to `to_peer`, read the reply (status, items) under the caps."""
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(to_peer), protocol)
    except Exception as exc:
        raise ConnectionError(f"cannot open a {op} stream to {to_peer}: {exc}") from exc
    writing = asyncio.create_task(streams.write_request(writer, body))
    writing.add_done_callback(
        lambda w: None if w.cancelled() or w.exception() else traffic.moved(sent=len(body))
    )
    reading = asyncio.create_task(
        streams.read_reply(reader, max_item_bytes=max_item, max_total_bytes=max_total)
    )
    try:
        # the reply may come before we finish writing (an early rejection): stop writing then
        await asyncio.wait({writing, reading}, return_when=asyncio.FIRST_COMPLETED)
        try:
            status, items = await reading
        except asyncio.IncompleteReadError as exc:
            detail = (
                f" (while sending: {writing.exception()!r})" if writing.done() and writing.exception() else ""
            )
            raise ConnectionError(f"{to_peer} closed the {op} stream without an answer{detail}") from exc
        except streams.BadEnvelope as exc:
            raise ConnectionError(f"{to_peer} sent a malformed {op} reply: {exc}") from exc
        traffic.moved(received=sum(map(len, items)))
        return status, items
    finally:
        for task in (writing, reading):
            task.cancel()
        await asyncio.gather(writing, reading, return_exceptions=True)
        writer.close()


async def delivery_reply(call: Any, to_peer: str, timeout: float) -> Reply:
    """A delta/update round trip (`call`, a coroutine of (status, items)) turned into one `Reply`."""
    try:
        status, items = await asyncio.wait_for(call, timeout)
    except TimeoutError:
        return Reply.transient(REPLY_TIMEOUT, f"no answer from {to_peer} within {timeout:.1f} s")
    except (ConnectionError, OSError, ValueError) as exc:
        return Reply.transient(LinkTag.PEER_DOWN if refused(exc) else REPLY_UNREACHABLE, str(exc))
    if len(items) != 1:
        return Reply.refused(REJECT_BAD_REQUEST, f"malformed reply from {to_peer}")
    if status != streams.STATUS_OK:  # rejected by the transport before any handler saw it
        try:
            rejected = decode_reply(items[0])
        except DecodeError as exc:
            return Reply.refused(REJECT_BAD_REQUEST, f"malformed rejection from {to_peer}: {exc}")
        transient = rejected.tag in TRANSIENT_REJECTIONS
        return replace(rejected, status=ReplyStatus.TRANSIENT if transient else ReplyStatus.REFUSED)
    try:
        return decode_reply(items[0])
    except DecodeError as exc:
        return Reply.refused(REJECT_BAD_REQUEST, f"malformed reply from {to_peer}: {exc}")


async def fetch_items(call: Any, op: str, from_peer: str, timeout: float) -> Any:
    """A fetch (`call`, a coroutine of (status, items)): its items, or one frame for a snapshot or chunk."""
    try:
        status, items = await asyncio.wait_for(call, timeout)
    except TimeoutError as exc:
        raise TimeoutError(f"{op} from {from_peer}: no answer within {timeout:.1f} s") from exc
    except streams.FrameTooLarge as exc:
        raise ConnectionError(f"{op} from {from_peer}: {exc}") from exc
    if status != streams.STATUS_OK:
        raise RemoteRejected(from_peer, op, _rejection_reason(items))
    if op == keys.OP_FETCH_UPDATES:
        return items
    if len(items) != 1:
        raise ConnectionError(f"{from_peer} answered a {op} request with {len(items)} items, expected 1")
    return items[0]


def _rejection_reason(items: list[bytes]) -> str:
    """What a rejection envelope says (the encoded `Reply` of `net.serving`), for people."""
    try:
        return decode_reply(items[0]).reason if items else "no reason given"
    except DecodeError as exc:
        return f"malformed rejection: {exc}"
