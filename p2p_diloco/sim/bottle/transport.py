"""`SimTransport`: the project's `Transport` interface for one simulated node, over the world's links.

Frames and requests take their link's latency and bandwidth both ways and can be lost (a partition, the
link's loss rate). The receiver is the node's driver, whose handlers answer with futures that settle
when its owner gets to them: a frozen node answers after its thaw, or never within the sender's
timeout. A node whose process is gone refuses the connection (`LinkTag.PEER_DOWN`); a lost frame or a
silent receiver ends in the sender's timeout, as the real transport's (`net.outbound`). Replies to an
incarnation that has since died go nowhere.

Every frame and answer that a link carries is counted in the world's `Traffic` (`traffic(world)`): bytes
sent and received per node, by kind (`delta`, `update`, `relay`, `updates`, `snapshot`, `chunk`, each
answer as `KIND.reply`), for measurements (`sim.bottle.scale`); nothing in a run reads them.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.sim.bottle.world import World
from p2p_diloco.wire.interfaces import InboundHandlers, Liveness
from p2p_diloco.wire.replies import LinkTag, Reply

REPLY_TIMEOUT = "transport timeout"  # the tag `net.outbound` gives an unanswered frame
REQUEST_BYTES = 128  # a request or a reply without payload, on the wire
PROBE_SECONDS = 1.0  # a probe that reaches nobody says UNKNOWN after this long


@dataclass
class Traffic:
    """Bytes the links carried, per node and per (node, kind): counted when a frame leaves its sender
    (`sent`) and when it reaches its receiver (`received`); a frame the link loses (a cut, the loss
    rate) counts in neither."""

    sent: Counter = field(default_factory=Counter)  # peer -> bytes
    received: Counter = field(default_factory=Counter)
    sent_kind: Counter = field(default_factory=Counter)  # (peer, kind) -> bytes
    received_kind: Counter = field(default_factory=Counter)
    frames: Counter = field(default_factory=Counter)  # kind -> frames delivered

    def add_sent(self, peer: str, kind: str, size: int) -> None:
        self.sent[peer] += size
        self.sent_kind[(peer, kind)] += size

    def add_received(self, peer: str, kind: str, size: int) -> None:
        self.received[peer] += size
        self.received_kind[(peer, kind)] += size
        self.frames[kind] += 1

    def snapshot(self) -> Traffic:
        return Traffic(
            Counter(self.sent),
            Counter(self.received),
            Counter(self.sent_kind),
            Counter(self.received_kind),
            Counter(self.frames),
        )


_TRAFFIC: weakref.WeakKeyDictionary[World, Traffic] = weakref.WeakKeyDictionary()


def traffic(world: World) -> Traffic:
    """The byte counters of `world`'s links (module docstring)."""
    counted = _TRAFFIC.get(world)
    if counted is None:
        counted = _TRAFFIC[world] = Traffic()
    return counted


def _settle(future: Future, value: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _size(value: Any) -> int:
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, list):
        return sum(_size(v) for v in value)
    return REQUEST_BYTES


class SimTransport:
    """One incarnation's transport (module docstring). `alive()` says whether that incarnation runs."""

    def __init__(
        self,
        world: World,
        peer_id: str,
        alive: Callable[[], bool],
        *,
        send_timeout: float,
        fetch_timeout: float,
    ):
        self.world = world
        self.peer_id = peer_id
        self.alive = alive
        self.send_timeout = send_timeout
        self.fetch_timeout = fetch_timeout
        self._handlers: InboundHandlers | None = None

    def bind(self, handlers: InboundHandlers) -> None:
        self._handlers = handlers
        self.world.register(self.peer_id, handlers)

    def close(self) -> None:
        if self._handlers is not None:
            self.world.unregister(self.peer_id, self._handlers)

    # ---- one-way frames with a reply -----------------------------------------------------------------

    def send_delta(self, to_peer: str, frame: bytes, on_reply: Callable[[Reply], None] | None = None) -> None:
        self._send(to_peer, frame, "delta", on_reply)

    def push_update(
        self, to_peer: str, frame: bytes, on_reply: Callable[[Reply], None] | None = None
    ) -> None:
        self._send(to_peer, frame, "update", on_reply)

    def relay(self, to_peer: str, frame: bytes) -> Future[Reply]:
        future: Future[Reply] = Future()
        self._send(to_peer, frame, "relay", lambda reply: _settle(future, reply))
        return future

    def _send(self, to: str, frame: bytes, kind: str, on_reply: Callable[[Reply], None] | None) -> None:
        answered = [False]

        def reply(value: Reply) -> None:
            if answered[0]:
                return
            answered[0] = True
            timer.cancel()
            if on_reply is not None and self.alive():
                on_reply(value)

        timeout = Reply.transient(REPLY_TIMEOUT, f"no answer from {to} within {self.send_timeout:.1f} s")
        timer = self.world.timer(self.send_timeout, lambda: reply(timeout))
        self._deliver(
            to,
            len(frame),
            lambda handlers: getattr(handlers, f"handle_{kind}")(self.peer_id, frame),
            on_value=reply,
            on_error=lambda exc: reply(self._refusal(to, exc)),
            kind=kind,
        )

    @staticmethod
    def _refusal(to: str, exc: BaseException) -> Reply:
        return Reply.transient(LinkTag.PEER_DOWN, f"{to} refused the connection: {exc}")

    # ---- requests ------------------------------------------------------------------------------------

    def _request(self, peer: str, ask: Callable[[InboundHandlers], Any], kind: str = "request") -> Future:
        future: Future = Future()
        timeout = TimeoutError(f"no answer from {peer} within {self.fetch_timeout:.1f} s")
        timer = self.world.timer(self.fetch_timeout, lambda: _settle(future, error=timeout))
        future.add_done_callback(lambda _: timer.cancel())
        self._deliver(
            peer,
            REQUEST_BYTES,
            ask,
            on_value=lambda value: _settle(future, value),
            on_error=lambda exc: _settle(future, error=ConnectionError(f"{peer}: {exc}")),
            kind=kind,
        )
        return future

    def request_updates(self, from_peer: str, fragment: int, after_version: int) -> Future[list[bytes]]:
        return self._request(
            from_peer, lambda h: h.serve_updates(self.peer_id, fragment, after_version), "updates"
        )

    def request_snapshot(self, from_peer: str, fragment: int) -> Future[bytes]:
        return self._request(from_peer, lambda h: h.serve_snapshot(self.peer_id, fragment), "snapshot")

    def request_chunk(
        self, from_peer: str, fragment: int, chunk: int, checksum: str, nbytes: int
    ) -> Future[bytes]:
        def ask(handlers: InboundHandlers) -> bytes:
            data = handlers.serve_chunk(self.peer_id, fragment, chunk, checksum)
            if len(data) > nbytes:
                raise ConnectionError(f"answered chunk {chunk} with {len(data)} bytes, limit {nbytes}")
            return data

        return self._request(from_peer, ask, "chunk")

    def probe(self, peer: str, addresses: Sequence[str] = ()) -> Future[Liveness]:
        """DOWN where the process is gone; UNKNOWN behind a cut link or from a frozen process."""
        future: Future[Liveness] = Future()
        if not self.world.reachable(self.peer_id, peer) or peer in self.world.frozen:
            self.world.later(PROBE_SECONDS, lambda: _settle(future, Liveness.UNKNOWN))
        else:
            up = peer in self.world.handlers
            rtt = 2 * (self.world.link.latency + self.world.link.jitter)
            self.world.later(rtt, lambda: _settle(future, Liveness.ALIVE if up else Liveness.DOWN))
        return future

    # ---- delivery ------------------------------------------------------------------------------------

    def _deliver(
        self,
        to: str,
        size: int,
        ask: Callable[[InboundHandlers], Any],
        *,
        on_value: Callable[[Any], None],
        on_error: Callable[[BaseException], None],
        kind: str = "request",
    ) -> None:
        """Carry a frame of `size` bytes to `to`, have its handlers answer it (`ask`), and carry the
        answer back; a lost frame or answer is never answered (the caller's timeout ends it). Both count
        in the world's `Traffic` as `kind` and `kind.reply`."""
        counted = traffic(self.world)
        delay = self.world.link_delay(self.peer_id, to, size)
        if delay is None:
            return
        counted.add_sent(self.peer_id, kind, size)
        reply_kind = f"{kind}.reply"

        def back(value: Any = None, error: BaseException | None = None) -> None:
            returned = _size(value)
            returning = self.world.link_delay(to, self.peer_id, returned)
            if returning is None:
                return
            counted.add_sent(to, reply_kind, returned)

            def land() -> None:
                counted.add_received(self.peer_id, reply_kind, returned)
                if error is not None:
                    on_error(error)
                else:
                    on_value(value)

            self.world.later(returning, land)

        def arrive() -> None:
            counted.add_received(to, kind, size)
            handlers = self.world.handlers.get(to)
            if handlers is None:
                back(error=ConnectionRefusedError(f"{to} is not running"))
                return
            try:
                answer = ask(handlers)
            except Exception as exc:  # a handler's refusal (e.g. an unknown snapshot chunk)
                back(error=exc)
                return
            if isinstance(answer, Future):
                answer.add_done_callback(
                    lambda done: back(error=done.exception()) if done.exception() else back(done.result())
                )
            else:
                back(answer)

        self.world.later(delay, arrive)
