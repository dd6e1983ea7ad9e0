"""What the transport serves before, during and after a peer's life, and the DHT clock.

`HandlerSlot` is the `InboundHandlers` the real node gives its `P2PTransport`. The transport exists
before the peer's driver does (the driver needs it) and outlives it at shutdown, so until a driver is
attached (and after it is detached) every request is answered `not ready`. Once attached, requests
go to the driver, which posts them to the peer's owner thread and hands the transport a future; the
transport awaits it (`P2PTransport.answer_timeout`, then `busy`). A driver call that raises is
answered `handler error`: the node keeps serving. The slot runs on the transport's thread (`owner`, which
the node hands to its transport), the only one that changes its refusal counts; it publishes them as an
immutable mapping (`rejections`, replaced whole) that other threads read.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.owner import Owner
from p2p_diloco.wire.interfaces import InboundHandlers
from p2p_diloco.wire.replies import Reply

log = logging.getLogger(__name__)

# reasons the slot itself answers with (tags, followed by details)
REJECT_NOT_READY = "not ready"  # the peer is still starting or already shutting down
REJECT_BUSY = "busy"  # the peer did not answer within the slot's timeout
REJECT_HANDLER_ERROR = "handler error"  # the handler raised: a bug, logged with its traceback


class DhtClock:
    """`Clock` over hivemind's DHT time (absolute seconds: DHT expirations are absolute times)."""

    def now(self) -> float:
        return get_dht_time()


class ServeRefused(RuntimeError):
    """A request could not be served; the transport answers the requester with this reason."""


class HandlerSlot:
    """`InboundHandlers` in front of the node's driver (module docstring)."""

    def __init__(self, owner: Owner | None = None) -> None:
        self.owner = owner or Owner("p2p-transport")
        self.rejections: Mapping[str, int] = MappingProxyType({})  # the slot's own rejections, by tag
        self._driver: InboundHandlers | None = None

    def attach(self, driver: InboundHandlers) -> None:
        self._driver = driver

    def detach(self) -> None:
        """From now on every request is answered `not ready` (shutdown)."""
        self._driver = None

    def _refuse(self, op: str, sender: str, tag: str, detail: str) -> Reply:
        self.owner.check("the handler slot's rejections")
        counts = Counter(self.rejections)  # changed on the transport's thread only, published whole
        counts[tag] += 1
        self.rejections = MappingProxyType(counts)
        level = logging.INFO if tag == REJECT_NOT_READY else logging.WARNING
        log.log(level, "%s from %s refused: %s: %s", op, sender, tag, detail)
        return Reply.transient(tag, detail)

    def _call(
        self, op: str, sender: str, call: Callable[[InboundHandlers], Any], refused: Callable[[Reply], Any]
    ):  # noqa: ANN202
        driver = self._driver
        if driver is None:
            return refused(self._refuse(op, sender, REJECT_NOT_READY, "peer is starting or shutting down"))
        try:
            answer = call(driver)
        except Exception as exc:
            log.exception("%s handler failed on a request from %s", op, sender)
            return refused(
                self._refuse(op, sender, REJECT_HANDLER_ERROR, f"{type(exc).__name__}: {str(exc)[:200]}")
            )
        return answer  # a Future: the transport awaits it (and answers `busy` after its answer timeout)

    def handle_delta(self, sender: str, frame: bytes):  # noqa: ANN201
        return self._call("delta", sender, lambda d: d.handle_delta(sender, frame), lambda r: r)

    def handle_update(self, sender: str, frame: bytes):  # noqa: ANN201
        return self._call("update", sender, lambda d: d.handle_update(sender, frame), lambda r: r)

    def handle_relay(self, sender: str, frame: bytes):  # noqa: ANN201
        return self._call("relay", sender, lambda d: d.handle_relay(sender, frame), lambda r: r)

    def serve_updates(self, requester: str, fragment: int, after_version: int):  # noqa: ANN201
        """The requester's replay source; an empty list when not serving (it falls back to other peers)."""
        return self._call(
            "fetch-updates",
            requester,
            lambda d: d.serve_updates(requester, fragment, after_version),
            lambda r: [],
        )

    def serve_snapshot(self, requester: str, fragment: int):  # noqa: ANN201
        def refuse(reply: Reply) -> bytes:
            raise ServeRefused(reply.reason)

        return self._call(
            "fetch-snapshot", requester, lambda d: d.serve_snapshot(requester, fragment), refuse
        )

    def serve_chunk(self, requester: str, fragment: int, chunk: int, checksum: str) -> bytes:
        """Answered at once by the driver from its pinned snapshots (no owner round trip)."""
        driver = self._driver
        if driver is None:
            raise ServeRefused(
                self._refuse("fetch-chunk", requester, REJECT_NOT_READY, "peer is starting").reason
            )
        return driver.serve_chunk(requester, fragment, chunk, checksum)
