"""`ThreadedDriver`: the real node's driver, one owner thread for the peer and one thread for DHT calls.

The owner thread (`peer-owner`) is the only one that touches the `Peer` (`process` checks it, see
`p2p_diloco.owner`): it takes events and functions from one queue (inbound frames and requests, send
replies, fetch and DHT results, deltas from the training thread, the node's posted jobs) and runs its
timers (swarm tick every heartbeat period, sync tick while synchronizer, the node's periodic jobs),
handles each in turn and performs the intents. The I/O thread (`dht-io`) runs blocking DHT calls and
disk writes; their results, and their errors, come back to the owner thread as events. The driver also
keeps, on the owner thread, the remote deltas this peer accepted as synchronizer (`DeltaAccepts`). The
threads of a whole `join` process are listed in `docs/architecture.md`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from p2p_diloco.owner import Owner
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.driver import MIN_SYNC_GAP, PeerDriver, deferred

log = logging.getLogger(__name__)


class DeltaAccepts:
    """Remote deltas this peer accepted as synchronizer: a count, and per shard and term the DHT time of the
    first (each shard's last `TERMS_KEPT` terms); progress events report them so that the demo can time a
    new synchronizer's first accepted delta. Terms are per synchronizer shard, so a shard's term never
    hides another's. Owned by the owner thread. Its own deltas never arrive as `DeltaArrived` and are not
    counted."""

    TERMS_KEPT = 8

    def __init__(self, owner: Owner | None = None) -> None:
        self.owner = owner or Owner("peer-owner")
        self.count = 0
        self.first_by_term: dict[tuple[int, int], float] = {}  # (shard, term) -> DHT time

    def note(self, term: int, now: float, shard: int = 0) -> None:
        self.owner.check("DeltaAccepts")
        self.count += 1
        if (shard, term) not in self.first_by_term:
            self.first_by_term[(shard, term)] = now
            for old in sorted(t for s, t in self.first_by_term if s == shard)[: -self.TERMS_KEPT]:
                del self.first_by_term[(shard, old)]

    def first_accepts(self) -> tuple[tuple[int, float, int], ...]:
        """((term, DHT time of the first accepted delta, shard), ...) by shard, then term."""
        return tuple((term, t, shard) for (shard, term), t in sorted(self.first_by_term.items()))


class _Job:
    def __init__(self, every: float, run: Callable[[], None], *, when: Callable[[], bool] | None = None):
        self.every = every
        self.run = run
        self.when = when or (lambda: True)
        self.due = time.monotonic() + every


class ThreadedDriver(PeerDriver):
    """`PeerDriver` on an owner thread and a DHT I/O thread (module docstring). `start`, then `stop`."""

    def __init__(
        self,
        *args: Any,
        on_error: Callable[[str, BaseException], None] | None = None,
        owner: Owner | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.owner = owner or Owner("peer-owner")  # the constructing thread until the owner thread starts
        self.accepts = DeltaAccepts(self.owner)
        self._events: queue.SimpleQueue[fx.Event | Callable[[], None] | None] = queue.SimpleQueue()
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dht-io")
        self._jobs: list[_Job] = []
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._on_error = on_error or (lambda what, exc: None)
        self.sync_seconds = 0.0
        self._sync_job = _Job(math.inf, self.sync_tick)  # due when the peer's last `SyncDue` says
        self._jobs.append(self._sync_job)
        self._published = 0  # updates this peer published (`Published` intents), for `sync_seconds`

    def every(
        self, seconds: float, run: Callable[[], None], *, when: Callable[[], bool] | None = None
    ) -> None:
        """Run `run` on the owner thread every `seconds` (while `when()`); before `start`."""
        self._jobs.append(_Job(seconds, run, when=when))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="peer-owner", daemon=True)
        self._thread.start()

    def post(self, event: fx.Event) -> None:
        self._events.put(event)

    def post_call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the owner thread soon (a job handed over by another thread); errors are reported."""
        self._events.put(fn)

    def process(self, event: fx.Event) -> None:
        self.owner.check("the peer")
        super().process(event)

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run `fn` on the owner thread and return its result (for shutdown and snapshots)."""
        if threading.current_thread() is self._thread:
            return fn()
        run, result = deferred(fn)
        self._events.put(run)
        return result.result(timeout=timeout)

    def run_io(self, call: Callable[[], Any], task: int | None) -> None:
        def job() -> None:
            try:
                value, error = call(), None
            except Exception as exc:
                value, error = None, exc
                if task is None:  # reported on the owner thread, which owns the error counts
                    self.post_call(lambda error=exc: self._on_error("dht", error))
            if task is not None:
                self.post(fx.TaskResult(task, value, error))

        try:
            self._io.submit(job)
        except RuntimeError:  # shut down
            pass

    def off_owner(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        return self.io(fn)

    def io(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the I/O thread (e.g. a replica save) and return its future."""
        return self._io.submit(fn)

    def _loop(self) -> None:
        self.owner.take()
        while not self._stopped.is_set():
            now = time.monotonic()
            due = [job for job in self._jobs if job.due <= now]
            for job in due:
                job.due = max(job.due + job.every, now)
                if job.when():
                    self._guarded(job.run.__name__, job.run)
            wait = min([now + 1.0, *(job.due for job in self._jobs)]) - time.monotonic()
            try:
                item = self._events.get(timeout=max(0.0, wait))
            except queue.Empty:
                continue
            if item is None:
                return
            if callable(item):  # `call`: a function to run here; every other item is an event
                self._guarded("call", item)
            else:
                self._guarded(type(item).__name__, lambda item=item: self.process(item))

    def _guarded(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # never let the owner die: the lease would lapse silently
            log.exception("peer owner: %s failed", what)
            self._on_error(what, exc)

    def stop(self, timeout: float) -> None:
        self._stopped.set()
        self._events.put(None)
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self._io.shutdown(wait=True, cancel_futures=False)

    # ---- ticks -------------------------------------------------------------------------------------

    def swarm_tick(self, heartbeat_fields: dict[str, Any]) -> None:
        self.process(fx.Tick(fx.TickKind.SWARM, self.clock.now(), heartbeat_fields))

    def sync_due(self, at: float | None) -> None:
        due = math.inf
        if at is not None:
            due = time.monotonic() + max(at - self.clock.now(), MIN_SYNC_GAP)
        self._sync_job.due = due

    def perform(self, intent: fx.Intent) -> None:
        if isinstance(intent, fx.Published):
            self._published += 1
        elif isinstance(intent, fx.DeltaAccepted):  # counted under its shard and term
            self.accepts.note(intent.term, self.clock.now(), intent.shard)
        super().perform(intent)

    def sync_tick(self) -> None:
        """Close the rounds that are due; `sync_seconds` is the time per update merged and pushed."""
        started, before = time.monotonic(), self._published
        self.process(fx.Tick(fx.TickKind.SYNC, self.clock.now(), sync_seconds=self.sync_seconds))
        if merged := self._published - before:
            self.sync_seconds = (time.monotonic() - started) / merged
