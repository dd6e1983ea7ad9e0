"""`SimDriver`: one node's owner thread, timers and I/O thread, on virtual time.

The same `PeerDriver` the real node's `node.threads.ThreadedDriver` extends: events and posted calls
queue for the owner, which handles them one at a time, in order; periodic jobs run on the owner when due
(after a freeze, once, as `ThreadedDriver` does); DHT calls and disk writes queue for the one I/O
"thread" and take their latency (a DHT call can be slowed or dropped, ending in a timeout). A starved
node's owner wakes late by up to its lag; a frozen node does nothing until it is thawed. Every exception
the owner meets is recorded: the peer must never raise.
"""

from __future__ import annotations

import concurrent.futures
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.sim.bottle.world import World
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.driver import MIN_SYNC_GAP, PeerDriver, deferred

DISK_SECONDS = 0.005  # one replica or state write


@dataclass
class DhtWeather:
    """How one node's DHT calls fare now: extra latency, the chance a call is lost (times out), and
    whether its reads return only its own records (a starved process whose lookups to others time out)."""

    latency: float = 0.02
    extra: float = 0.0
    drop: float = 0.0
    starved_reads: bool = False


@dataclass
class _Job:
    every: float
    run: Callable[[], None]
    when: Callable[[], bool]
    due: float
    name: str = ""


@dataclass
class Freezer:
    """Whether a node's process is stopped (SIGSTOP), and what waits for its SIGCONT."""

    frozen: bool = False
    waiting: list[Callable[[], None]] = field(default_factory=list)

    def run_or_hold(self, fn: Callable[[], None]) -> None:
        if self.frozen:
            self.waiting.append(fn)
        else:
            fn()

    def thaw(self) -> None:
        self.frozen = False
        waiting, self.waiting = self.waiting, []
        for fn in waiting:
            fn()


class SimDriver(PeerDriver):
    """`PeerDriver` on virtual time (module docstring)."""

    def __init__(
        self,
        *args: Any,
        world: World,
        freezer: Freezer,
        dht: DhtWeather,
        dht_timeout: float,
        rng: random.Random,
        on_error: Callable[[str, BaseException], None],
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.world = world
        self.freezer = freezer
        self.dht = dht
        self.dht_timeout = dht_timeout
        self.rng = rng
        self.on_error = on_error
        self.alive = True
        self.cpu_lag = 0.0  # a starved owner wakes up to this many seconds late
        self._queue: deque[fx.Event | Callable[[], None]] = deque()
        self._jobs: list[_Job] = []
        self._sync_job: _Job | None = None
        self._wake_at: float | None = None
        self._wake_token = 0
        self._io: deque[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None], bool]] = deque()
        self._io_busy = False

    # ---- the owner ---------------------------------------------------------------------------------

    def post(self, event: fx.Event) -> None:
        if self.alive:
            self._queue.append(event)
            self._wake(self.world.now())

    def post_call(self, fn: Callable[[], None]) -> None:
        if self.alive:
            self._queue.append(fn)
            self._wake(self.world.now())

    def every(
        self, seconds: float, run: Callable[[], None], *, when: Callable[[], bool] | None = None
    ) -> None:
        name = getattr(run, "__name__", "job")
        self._jobs.append(_Job(seconds, run, when or (lambda: True), self.world.now() + seconds, name))

    def on_sync_due(self, run: Callable[[], None]) -> None:
        """`run` is the sync tick: due when the peer's last `SyncDue` says (as `ThreadedDriver`)."""
        self._sync_job = _Job(math.inf, run, lambda: True, math.inf, "sync_tick")
        self._jobs.append(self._sync_job)

    def sync_due(self, at: float | None) -> None:
        if self._sync_job is None:
            return
        if at is None:
            self._sync_job.due = math.inf
            return
        self._sync_job.due = self.world.now() + max(at - self.clock.now(), MIN_SYNC_GAP)
        self._wake(self._sync_job.due)

    def start(self) -> None:
        self._wake(min(job.due for job in self._jobs) if self._jobs else self.world.now())

    def kill(self) -> None:
        """The process is gone: nothing queued runs, nothing in flight lands."""
        self.alive = False
        self._queue.clear()
        self._io.clear()
        self.transport.close()

    def idle_io(self) -> bool:
        return not self._io_busy and not self._io

    def _wake(self, at: float) -> None:
        if self.cpu_lag > 0:
            at += self.rng.uniform(0.0, self.cpu_lag)
        if self._wake_at is not None and self._wake_at <= at:
            return
        self._wake_at = at
        self._wake_token += 1
        token = self._wake_token
        self.world.loop.call_at(at, lambda: self.freezer.run_or_hold(lambda: self._run(token)))

    def _run(self, token: int) -> None:
        if token != self._wake_token or not self.alive:
            return
        self._wake_at = None
        now = self.world.now()
        for job in self._jobs:
            if job.due <= now and self.alive:
                job.due = max(job.due + job.every, now)
                if job.when():
                    self._guarded(job.name, job.run)
        while self._queue and self.alive and not self.freezer.frozen:
            item = self._queue.popleft()
            if callable(item):  # a posted call; every other item is an event
                self._guarded("call", item)
            else:
                self._guarded(type(item).__name__, lambda item=item: self.process(item))
        if self.alive and self._jobs:
            self._wake(min(job.due for job in self._jobs))

    def _guarded(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # the real owner logs and goes on; the simulator reports it
            self.on_error(what, exc)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the owner soon; its result in the future."""
        run, result = deferred(fn)
        self.post_call(run)
        return result

    # ---- the I/O thread ----------------------------------------------------------------------------

    def run_io(self, call: Callable[[], Any], task: int | None) -> None:
        def done(value: Any, error: BaseException | None) -> None:
            if task is not None:
                self.post(fx.TaskResult(task, value, error))
            elif error is not None:
                self.post_call(lambda: self.on_error("dht", error))

        self._io_submit(call, done, dht=True)

    def io(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """A disk write (a replica save) on the I/O thread; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def done(value: Any, error: BaseException | None) -> None:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        self._io_submit(fn, done, dht=False)
        return future

    def off_owner(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        return self.io(fn)

    def _io_submit(
        self, call: Callable[[], Any], done: Callable[[Any, BaseException | None], None], *, dht: bool
    ) -> None:
        if self.alive:
            self._io.append((call, done, dht))
            self._io_next()

    def _io_next(self) -> None:
        if self._io_busy or not self._io or not self.alive:
            return
        self._io_busy = True
        call, done, dht = self._io.popleft()
        lost = dht and self.dht.drop > 0 and self.rng.random() < self.dht.drop
        if lost:
            delay = self.dht_timeout
        elif dht:
            delay = self.dht.latency + self.dht.extra
        else:
            delay = DISK_SECONDS
        self.world.later(delay, lambda: self.freezer.run_or_hold(lambda: self._io_finish(call, done, lost)))

    def _io_finish(
        self, call: Callable[[], Any], done: Callable[[Any, BaseException | None], None], lost: bool
    ) -> None:
        if not self.alive:
            return
        self._io_busy = False
        if lost:
            done(None, TimeoutError(f"DHT call lost (no answer within {self.dht_timeout:.1f} s)"))
        else:
            try:
                value, error = call(), None
            except Exception as exc:
                value, error = None, exc
            done(value, error)
        self._io_next()
