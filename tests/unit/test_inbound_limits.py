"""Bounded abuse on the inbound side, without daemons: stream slots, header deadline, body rate, caps.

`InboundServer`'s stream handler runs here on in-memory streams (an `asyncio.StreamReader` the test feeds
and a writer that records), with deadlines of a fraction of a second on virtual time
(`tests.support.virtual_time`: the loop's clock jumps to the next deadline, so no window depends on the
machine's load); the real libp2p path has its own test (tests/integration/test_net_abuse.py).
"""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest

from p2p_diloco.net import streams
from p2p_diloco.net.limits import (
    REJECT_BUSY,
    REJECT_HEADER_TIMEOUT,
    REJECT_PEER_BUSY,
    REJECT_TOO_SLOW,
    FrameCaps,
    InboundLimits,
    OutboundSlots,
    StreamSlots,
)
from p2p_diloco.net.serving import REJECT_TOO_LARGE, InboundServer
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.wire.keys import OP_DELTA
from p2p_diloco.wire.replies import Reply, ReplyStatus, decode_reply
from tests.support.virtual_time import run_virtual

KiB = 1024
LIMITS = InboundLimits(
    per_peer=2,
    total=3,
    header_timeout=0.4,
    min_body_rate=20 * KiB,
    body_grace=0.2,
    priority_peers=frozenset({"synchronizer"}),
    max_lingering=0,
)


class Handlers:
    def __init__(self) -> None:
        self.deltas: list[tuple[str, int]] = []

    def handle_delta(self, sender: str, frame: bytes) -> Reply:
        self.deltas.append((sender, len(frame)))
        return Reply(ReplyStatus.ACCEPTED, "accepted")


class Writer:
    """The replying side of a stream: records what is written and whether it was closed."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def reason(self) -> str:
        """The reply: "ok" or the rejection's reason."""
        status, count = self.data[0], struct.unpack(">I", self.data[1:5])[0]
        assert count == 1
        return "ok" if status == streams.STATUS_OK else decode_reply(bytes(self.data[13:])).reason


class Streams:
    """Opens in-memory streams to `server` as any peer; each runs the server's handler as a task."""

    def __init__(self, server: InboundServer):
        self.server = server
        self.tasks: list[asyncio.Task] = []

    def open(self, peer: str, data: bytes = b"") -> tuple[asyncio.StreamReader, Writer]:
        reader, writer = asyncio.StreamReader(), Writer()
        if data:
            reader.feed_data(data)
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer))
        self.tasks.append(asyncio.create_task(self.server.stream_handler(OP_DELTA)(info, reader, writer)))
        return reader, writer


def request(body: bytes) -> bytes:
    return streams.MAGIC + struct.pack(">Q", len(body)) + body


async def closed(writer: Writer, within: float) -> float:
    """Seconds until the server closed `writer`; fails after `within`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not writer.closed:
        assert loop.time() - start < within, f"stream still open after {within} s"
        await asyncio.sleep(0.01)
    return loop.time() - start


def make_server(handlers: Handlers, limits: InboundLimits = LIMITS) -> InboundServer:
    caps = FrameCaps.uniform(64 * KiB, 64 * KiB)
    return InboundServer(handlers, caps=caps, limits=limits, allowed_peers=None, answer_timeout=1.0)


def test_a_rogue_holding_streams_open_blocks_only_itself_and_idle_streams_are_closed():
    async def scenario() -> None:
        handlers = Handlers()
        server = make_server(handlers)
        net = Streams(server)
        opened = asyncio.get_running_loop().time()
        held = [net.open("rogue")[1] for _ in range(8)]  # 8 idle streams: no header
        await asyncio.sleep(0.05)
        refused = [w for w in held if w.closed]
        assert len(refused) == 6 and all(w.reason().startswith(REJECT_PEER_BUSY) for w in refused)
        _, honest = net.open("honest", request(b"delta"))  # while the rogue holds two streams
        assert await closed(honest, 0.2) < 0.2 and honest.reason() == "ok"
        assert handlers.deltas == [("honest", 5)]
        waiting = [w for w in held if not w.closed]
        assert len(waiting) == 2
        for writer in waiting:  # closed at the header deadline, told why
            await closed(writer, 1.0)
            assert 0.35 < asyncio.get_running_loop().time() - opened < 1.0
            assert writer.reason().startswith(REJECT_HEADER_TIMEOUT)
        await asyncio.gather(*net.tasks)
        assert server.rejected == {REJECT_PEER_BUSY: 6, REJECT_HEADER_TIMEOUT: 2}
        assert not server.slots.by_peer and server.slots.counted == 0  # no state left behind

    run_virtual(scenario())


def test_the_total_cap_holds_strangers_but_not_priority_peers():
    async def scenario() -> None:
        server = make_server(Handlers())
        net = Streams(server)
        for peer in ("rogue-1", "rogue-1", "rogue-2"):  # three strangers' idle streams: the total
            net.open(peer)
        await asyncio.sleep(0.05)
        _, stranger = net.open("honest", request(b"delta"))
        _, trusted = net.open("synchronizer", request(b"update"))
        await closed(stranger, 0.2)
        await closed(trusted, 0.2)
        assert stranger.reason().startswith(REJECT_BUSY) and trusted.reason() == "ok"
        await asyncio.gather(*net.tasks)
        assert server.slots.counted == 0

    run_virtual(scenario())


def test_a_trickling_body_is_closed_as_too_slow_and_an_oversized_claim_before_any_body():
    async def scenario() -> None:
        handlers = Handlers()
        server = make_server(handlers)
        net = Streams(server)
        header = streams.MAGIC + struct.pack(">Q", 60 * KiB)
        reader, slow = net.open("slow", header + bytes(2 * KiB))
        for _ in range(5):  # 1 KiB every 0.1 s: 10 KiB/s, half the minimum rate
            await asyncio.sleep(0.1)
            if not slow.closed:
                reader.feed_data(bytes(KiB))
        # behind once 0.2 s grace + received / 20 KiB/s have passed: about 0.35 s in
        await closed(slow, 1.0)
        assert slow.reason().startswith(REJECT_TOO_SLOW), slow.reason()
        _, large = net.open("large", streams.MAGIC + struct.pack(">Q", 200 * 1024 * KiB))
        await closed(large, 0.2)
        assert large.reason().startswith(REJECT_TOO_LARGE) and str(200 * 1024 * KiB) in large.reason()
        _, fast = net.open("fast", request(bytes(60 * KiB)))  # at full speed: served
        await closed(fast, 0.5)
        assert fast.reason() == "ok" and handlers.deltas == [("fast", 60 * KiB)]
        await asyncio.gather(*net.tasks)
        assert server.rejected == {REJECT_TOO_SLOW: 1, REJECT_TOO_LARGE: 1}
        counts = server.traffic.counts  # bytes count where they move: only the body read in full
        assert counts.bytes_received == 60 * KiB and counts.served == {OP_DELTA: 1} and counts.bytes_sent > 0

    run_virtual(scenario())


def test_body_pace_allows_bursts_and_pauses_on_average():
    pace = streams.BodyPace(started=100.0, min_rate=1000.0, grace=2.0)
    assert pace.due(0) == 102.0 and pace.due(3000) == 105.0
    assert not pace.behind(0, 101.9) and pace.behind(0, 102.1)
    assert not pace.behind(3000, 104.9)  # 3000 bytes in one burst buy 3 s
    assert pace.behind(3000, 105.1)


def test_read_body_reads_a_body_that_keeps_up_and_stops_at_the_end_of_the_stream():
    async def scenario() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(b"abc")
        asyncio.get_running_loop().call_later(0.05, reader.feed_data, b"defg")
        assert await streams.read_body(reader, 7, min_rate=100.0, grace=0.5) == b"abcdefg"
        reader = asyncio.StreamReader()
        reader.feed_data(b"ab")
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await streams.read_body(reader, 7, min_rate=100.0, grace=0.5)
        with pytest.raises(streams.TooSlow, match="2 of 7 bytes"):
            reader = asyncio.StreamReader()
            reader.feed_data(b"ab")
            await streams.read_body(reader, 7, min_rate=100.0, grace=0.1)

    run_virtual(scenario())


def test_stream_slots_count_per_peer_and_in_all_and_forget_peers_with_nothing_in_progress():
    slots = StreamSlots(InboundLimits(per_peer=2, total=3, priority_peers=frozenset({"vip"})))
    assert slots.acquire("a") is None and slots.acquire("a") is None
    assert slots.acquire("a")[0] == REJECT_PEER_BUSY
    assert slots.acquire("b") is None
    assert slots.acquire("c")[0] == REJECT_BUSY
    assert slots.acquire("vip") is None and slots.acquire("vip") is None  # not counted in the total
    assert slots.acquire("vip")[0] == REJECT_PEER_BUSY  # but limited per peer like anyone
    for peer in ("a", "a", "b", "vip", "vip"):
        slots.release(peer)
    assert slots.by_peer == {} and slots.counted == 0 and len(slots) == 0


def test_limits_are_checked():
    with pytest.raises(ValueError, match="per_peer"):
        InboundLimits(per_peer=0)
    with pytest.raises(ValueError, match="min_body_rate"):
        InboundLimits(min_body_rate=0)
    assert InboundLimits(priority_peers=["x"]).priority_peers == frozenset({"x"})  # type: ignore[arg-type]


def test_outbound_slots_let_two_streams_to_a_peer_run_and_the_rest_wait_their_turn():
    async def scenario() -> None:
        slots = OutboundSlots(per_peer=2)
        running: list[str] = []
        most = {"a": 0, "b": 0}

        async def call(peer: str) -> None:
            async with slots.slot(peer):
                running.append(peer)
                most[peer] = max(most[peer], running.count(peer))
                await asyncio.sleep(0.02)
                running.remove(peer)

        await asyncio.gather(*(call(p) for p in "aaaaab"))
        assert most == {"a": 2, "b": 1} and len(slots) == 0  # nothing kept for peers with nothing open

    run_virtual(scenario())


def test_requests_the_run_does_not_let_a_peer_make_are_refused_before_their_body():
    async def scenario() -> None:
        handlers = Handlers()
        server = InboundServer(
            handlers,
            caps=FrameCaps.uniform(64 * KiB, 64 * KiB),
            limits=LIMITS,
            allowed_peers=None,
            answer_timeout=1.0,
            admit=lambda op, peer: peer != "stranger",
        )
        net = Streams(server)
        _, stranger = net.open("stranger", request(b"delta"))
        _, learner = net.open("learner", request(b"delta"))
        await asyncio.gather(*net.tasks)
        assert stranger.reason().startswith(AdmissionTag.NOT_ALLOWED) and learner.reason() == "ok"
        assert handlers.deltas == [("learner", 5)]

    run_virtual(scenario())


def test_a_body_found_behind_after_our_own_stall_is_judged_on_what_has_arrived_meanwhile():
    class Clock:  # the body starts at 0; our loop then stalls: the next look at the clock is at 1.0
        def __init__(self) -> None:
            self.times = iter([0.0])

        def __call__(self) -> float:
            return next(self.times, 1.0)

    async def read(buffered: int, length: int) -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(buffered))
        return await streams.read_body(reader, length, min_rate=100.0, grace=0.5, clock=Clock())

    async def scenario() -> None:
        assert len(await read(100, 100)) == 100  # due by 1.5 s: in time once counted
        with pytest.raises(streams.TooSlow, match="10 of 100 bytes"):
            await read(10, 100)  # due by 0.6 s: too slow even counting what had arrived

    run_virtual(scenario())
