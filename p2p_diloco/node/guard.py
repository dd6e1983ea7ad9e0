"""What the transport serves before, during and after a peer's life, and the DHT clock.

`HandlerSlot` is the `InboundHandlers` the real node gives its `P2PTransport`. The transport exists
before the peer's driver does (the driver needs it) and outlives it at shutdown, so until a driver is
attached (and after it is detached) every request is answered `not ready`. Once attached, requests
go to the driver, which posts them to the peer's owner thread and hands the transport a future; the
transport awaits it (`P2PTransport.answer_timeout`, then `busy`). A driver call that raises is
answered `handler error`: the node keeps serving. It also notes the replies to remote deltas that were
accepted (`DeltaAccepts`: how many, and per synchronizer term when the first one was), which progress
events report so that the demo can time a new synchronizer's first accepted delta.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

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


class DeltaAccepts:
    """Remote deltas this peer accepted as synchronizer: a count, and per term the DHT time of the first
    (the last `TERMS_KEPT` terms). Its own deltas never pass through the transport and are not counted."""

    TERMS_KEPT = 8

    def __init__(self) -> None:
        self.count = 0
        self.first_by_term: dict[int, float] = {}

    def note(self, term: int, now: float) -> None:
        self.count += 1
        if term not in self.first_by_term:
            self.first_by_term[term] = now
            for old in sorted(self.first_by_term)[: -self.TERMS_KEPT]:
                del self.first_by_term[old]

    def first_accepts(self) -> tuple[tuple[int, float], ...]:
        """((term, DHT time of the first accepted delta), ...) by term."""
        return tuple(sorted(self.first_by_term.items()))


class ServeRefused(RuntimeError):
    """A request could not be served; the transport answers the requester with this reason."""


class HandlerSlot:
    """`InboundHandlers` in front of the node's driver (module docstring)."""

    def __init__(self) -> None:
        self.rejections: Counter[str] = Counter()  # the slot's own rejections, by tag
        self.accepts = DeltaAccepts()
        self._driver: InboundHandlers | None = None

    def attach(self, driver: InboundHandlers) -> None:
        self._driver = driver

    def detach(self) -> None:
        """From now on every request is answered `not ready` (shutdown)."""
        self._driver = None

    def _refuse(self, op: str, sender: str, tag: str, detail: str) -> Reply:
        self.rejections[tag] += 1
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
        answer = self._call("delta", sender, lambda d: d.handle_delta(sender, frame), lambda r: r)
        if isinstance(answer, concurrent.futures.Future):
            driver = self._driver
            answer.add_done_callback(lambda done: self._note_reply(done, driver))
        return answer

    def _note_reply(self, done: concurrent.futures.Future, driver: Any) -> None:
        """Count an accepted delta under the term this peer synchronizes (called when the reply is set)."""
        if done.cancelled() or done.exception() is not None:
            return
        reply = done.result()
        if not isinstance(reply, Reply) or not reply.ok:
            return
        peer = getattr(driver, "peer", None)
        sync = getattr(peer, "sync", None)
        term = getattr(sync, "term", None) if sync is not None else getattr(peer, "term_seen", None)
        self.accepts.note(int(term) if isinstance(term, int) else -1, get_dht_time())

    def handle_update(self, sender: str, frame: bytes):  # noqa: ANN201
        return self._call("update", sender, lambda d: d.handle_update(sender, frame), lambda r: r)

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
