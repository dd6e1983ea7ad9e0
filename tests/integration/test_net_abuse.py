"""Bounded abuse over real libp2p streams: a rogue that holds streams open blocks only itself.

Three DHT peers on 127.0.0.1: an honest server (`P2PTransport` with handlers), an honest client and a
rogue. The rogue opens raw streams to the server's handlers through its own transport's daemon (the
`RogueStreams` helper) and writes what it likes: nothing, a header claiming 200 MiB and no body, or a
trickle. The measured attack this answers: 8 idle streams per honest peer, each header claiming 200 MiB,
kept a follower from applying updates for 30 s (``busy: 8 requests already in progress``).
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import pytest

from p2p_diloco.net import streams
from p2p_diloco.net.limits import FrameCaps, InboundLimits
from p2p_diloco.net.transport import (
    REJECT_HEADER_TIMEOUT,
    REJECT_PEER_BUSY,
    REJECT_TOO_LARGE,
    REJECT_TOO_SLOW,
    P2PTransport,
)
from p2p_diloco.wire.keys import OP_DELTA, OP_FETCH_SNAPSHOT, OP_UPDATE
from p2p_diloco.wire.replies import Reply, ReplyStatus, decode_reply

pytestmark = [pytest.mark.integration, pytest.mark.soak]

MANIFEST = "0123456789abcdef"
MiB = 1 << 20
CLAIM = 200 * MiB


class Handlers:
    def __init__(self) -> None:
        self.deltas: list[tuple[str, int]] = []

    def handle_delta(self, sender: str, frame: bytes) -> Reply:
        self.deltas.append((sender, len(frame)))
        return Reply(ReplyStatus.ACCEPTED, "accepted")

    def handle_update(self, sender: str, frame: bytes) -> Reply:
        return Reply(ReplyStatus.APPLIED, "applied")

    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
        return [b"update"]

    def serve_snapshot(self, requester: str, fragment: int) -> bytes:
        return bytes(3 * MiB)


class RogueStreams:
    """Raw streams from `transport`'s peer to `target`, on the transport's loop (test-only access)."""

    def __init__(self, transport: P2PTransport, target: str):
        from hivemind.p2p import PeerID

        self.transport = transport
        self.target = PeerID.from_base58(target)
        self.streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        return self.transport._submit(coro).result(timeout=timeout)

    def open(self, op: str, data: bytes = b"", count: int = 1) -> list[int]:
        """Open `count` streams for `op`, write `data` on each and leave them open; their indices."""

        async def one() -> int:
            proto = self.transport._protocols[op]
            _, reader, writer = await self.transport._p2p.call_binary_stream_handler(self.target, proto)
            self.streams.append((reader, writer))
            if data:
                try:
                    writer.write(data)
                    await writer.drain()
                except ConnectionError:  # refused and closed already: `answer` tells what is left
                    pass
            return len(self.streams) - 1

        return [self._run(one()) for _ in range(count)]

    def send(self, index: int, data: bytes) -> None:
        async def write() -> None:
            self.streams[index][1].write(data)
            await self.streams[index][1].drain()

        self._run(write())

    def answer(self, index: int, timeout: float) -> str:
        """The server's answer on stream `index` within `timeout`: its reason, "ok", "closed" or "open"."""

        async def read() -> str:
            reader = self.streams[index][0]
            try:
                status, items = await asyncio.wait_for(
                    streams.read_reply(reader, max_item_bytes=4096, max_total_bytes=4096), timeout
                )
            except TimeoutError:
                return "open"
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                return "closed"
            return "ok" if status == streams.STATUS_OK else decode_reply(items[0]).reason

        return self._run(read(), timeout + 10)

    def close_all(self) -> None:
        async def close() -> None:
            for _, writer in self.streams:
                writer.close()

        self._run(close())


def header(length: int) -> bytes:
    return streams.MAGIC + struct.pack(">Q", length)


@pytest.fixture(scope="module")
def three_peers(module_dht_peers):
    server = module_dht_peers()
    client = module_dht_peers(initial_peers=server.visible_addresses())
    rogue = module_dht_peers(initial_peers=server.visible_addresses())
    return server, client, rogue


def transports(three_peers, run: str, **server_options):  # noqa: ANN001, ANN003
    server_peer, client_peer, rogue_peer = three_peers
    common: dict[str, Any] = dict(run_id=run, manifest_hash=MANIFEST, send_timeout=30, fetch_timeout=30)
    server = P2PTransport(server_peer.dht, handlers=Handlers(), **common, **server_options)
    return server, P2PTransport(client_peer.dht, **common), P2PTransport(rogue_peer.dht, **common)


def test_a_rogue_holding_eight_streams_claiming_200_mib_blocks_only_itself(three_peers, wait_for):
    # no deadline fires during this test: what keeps honest traffic flowing is the per-peer limit
    limits = InboundLimits(header_timeout=120, body_grace=120, request_timeout=300)
    server, client, rogue_transport = transports(three_peers, "abuse-slots", limits=limits)
    rogue = RogueStreams(rogue_transport, server.peer_id)
    try:
        opened = rogue.open(OP_DELTA, header(CLAIM), count=8)  # under the size cap, body never sent
        answers = [rogue.answer(i, timeout=3.0) for i in opened]
        assert answers.count("open") == 2, answers  # two streams held by the rogue, six refused at once:
        # told why, or (when the refusal overtook the rogue's own write: p2pd resets) just closed
        assert all(a.startswith(REJECT_PEER_BUSY) or a == "closed" for a in answers if a != "open"), answers
        assert server.rejected[REJECT_PEER_BUSY] == 6
        started = time.monotonic()
        assert str(client.send_and_wait(OP_DELTA, server.peer_id, b"honest delta", timeout=20)) == "accepted"
        assert str(client.send_and_wait(OP_UPDATE, server.peer_id, b"update", timeout=20)) == "applied"
        assert client.fetch_updates(server.peer_id, 0, 0) == [b"update"]
        assert time.monotonic() - started < 20
        assert server.slots.by_peer.get(rogue_transport.peer_id) == 2  # still holding while we were served
        rogue.close_all()
        wait_for(lambda: not server.slots.by_peer, 30, "the rogue's slots to be freed when it closes")
    finally:
        for transport in (rogue_transport, client, server):
            transport.close()


def test_idle_and_trickling_streams_are_closed_at_their_deadlines(three_peers, wait_for):
    limits = InboundLimits(header_timeout=2.0, min_body_rate=64 * 1024, body_grace=2.0)
    server, client, rogue_transport = transports(three_peers, "abuse-deadlines", limits=limits)
    rogue = RogueStreams(rogue_transport, server.peer_id)
    try:
        idle = rogue.open(OP_UPDATE)[0]
        assert rogue.answer(idle, timeout=20).startswith(REJECT_HEADER_TIMEOUT)
        slow = rogue.open(OP_DELTA, header(CLAIM) + bytes(10_000))[0]
        rogue.send(slow, bytes(10_000))
        answer = rogue.answer(slow, timeout=30)
        assert answer.startswith(REJECT_TOO_SLOW), answer
        wait_for(lambda: server.rejected[REJECT_TOO_SLOW] == 1, 10, "the slow stream to be counted")
        assert server.rejected[REJECT_HEADER_TIMEOUT] == 1 and not server.slots.by_peer
        assert str(client.send_and_wait(OP_DELTA, server.peer_id, bytes(MiB), timeout=20)) == "accepted"
    finally:
        for transport in (rogue_transport, client, server):
            transport.close()


def test_claims_over_the_ops_cap_are_refused_before_any_body_and_replies_are_capped(three_peers):
    caps = FrameCaps(requests={OP_DELTA: MiB}, replies={OP_FETCH_SNAPSHOT: (MiB, MiB)})
    server, client, rogue_transport = transports(three_peers, "abuse-caps", caps=caps)
    rogue = RogueStreams(rogue_transport, server.peer_id)
    try:
        claims = rogue.open(OP_DELTA, header(CLAIM), count=2)
        for index in claims:
            answer = rogue.answer(index, timeout=20)
            assert answer.startswith(REJECT_TOO_LARGE) and str(CLAIM) in answer, answer
        assert server.rejected[REJECT_TOO_LARGE] == 2
        assert str(client.send_and_wait(OP_DELTA, server.peer_id, bytes(MiB), timeout=20)) == "accepted"
        capped = P2PTransport(
            three_peers[1].dht, run_id="abuse-caps", manifest_hash=MANIFEST, fetch_timeout=30, caps=caps
        )
        try:  # the server's snapshot (3 MiB) is over this reader's snapshot cap (1 MiB): not read
            with pytest.raises(ConnectionError, match="exceeds the limit"):
                capped.fetch_snapshot(server.peer_id, 0)
        finally:
            capped.close()
        assert len(client.fetch_snapshot(server.peer_id, 0)) == 3 * MiB  # the default caps take it
    finally:
        for transport in (rogue_transport, client, server):
            transport.close()
