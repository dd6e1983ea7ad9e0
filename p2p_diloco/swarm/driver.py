"""`PeerDriver`: feeds one `Peer` its events and performs the intents it returns.

One class for every way a peer runs. `InlineDriver` processes each event the moment it is posted, on
the caller's thread (the in-process swarm and unit tests: fake clock, in-memory store and network,
fetches answered at once). `node.threads.ThreadedDriver` runs the same `process` on the peer's one
owner thread and performs DHT calls on an I/O thread. Either way a `Peer` sees one event at a time.

Intents are performed here, never in the peer: DHT writes and reads through the `KeyValueStore`,
sends and fetches through the `Transport` (replies and fetch results come back as events), answers
to inbound requests, messages to the learner's inbox, and telemetry for the `observer`.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.wire.interfaces import Clock, KeyValueStore, Transport, get_many
from p2p_diloco.wire.replies import Reply

Observer = Callable[[fx.Intent], None]

MIN_SYNC_GAP = 0.02  # at least this long between two sync ticks (a deadline already passed: soon, not now)


def deferred(fn: Callable[[], Any]) -> tuple[Callable[[], None], concurrent.futures.Future]:
    """`fn` wrapped to run later (on an owner) and the future that gets its result or its exception."""
    result: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.set_exception(exc)

    return run, result


def _done(value: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


class PeerDriver:
    """Performs a peer's intents; subclasses decide how events are queued (`post`) and DHT calls run."""

    def __init__(
        self,
        peer: Peer,
        *,
        kv: KeyValueStore,
        transport: Transport,
        clock: Clock,
        learner=None,  # noqa: ANN001 - swarm.learner.Learner, whose inbox gets `ToLearner` messages
        observer: Observer | None = None,
        bind: bool = True,
    ):
        self.peer = peer
        self.kv = kv
        self.transport = transport
        self.clock = clock
        self.learner = learner
        self.observer = observer or (lambda intent: None)
        self._stores: dict[tuple[str, str], fx.StoreRecord] = {}  # DHT writes not yet started
        self._stores_lock = threading.Lock()
        if bind:  # else the caller routes inbound requests here (the real node's `HandlerSlot`)
            transport.bind(self)

    # ---- events ------------------------------------------------------------------------------------

    def post(self, event: fx.Event) -> None:
        raise NotImplementedError

    def process(self, event: fx.Event) -> None:
        """Handle one event and perform its intents (on the owner thread)."""
        for intent in self.peer.handle(event):
            self.perform(intent)

    # ---- intents -----------------------------------------------------------------------------------

    def perform(self, intent: fx.Intent) -> None:
        match intent:
            case fx.StoreRecord():
                self._store_latest(intent)
            case fx.Perform(request=fx.ReadSwarm() as read):
                self.run_io(lambda: self.read_swarm(read), intent.task)
            case fx.Perform(request=fx.Probe() as probe):
                self._when_done([self.transport.probe(probe.peer, probe.addresses)], intent.task, single=True)
            case fx.Perform(request=fx.OfferUpdate() as offer):
                futures = [self.transport.relay(to, offer.offer) for to in offer.targets]
                self._when_done(futures, intent.task, single=False)
            case fx.Perform(request=fx.FetchUpdates() as fetch):
                future = self.transport.request_updates(fetch.source, fetch.fragment, fetch.after_version)
                self._when_done([future], intent.task, single=True)
            case fx.Perform(request=fx.FetchUpdateLogs() as fetch):
                futures = [self.transport.request_updates(*wanted) for wanted in fetch.wanted]
                self._when_done(futures, intent.task, single=False)
            case fx.Perform(request=fx.FetchSnapshots() as fetch):
                futures = [self.transport.request_snapshot(source, p) for p, source in fetch.wanted]
                self._when_done(futures, intent.task, single=False)
            case fx.Perform(request=fx.FetchChunks() as fetch):
                futures = [self.transport.request_chunk(*wanted) for wanted in fetch.wanted]
                self._when_done(futures, intent.task, single=False)
            case fx.SendDelta():
                send = intent

                def on_reply(reply: Reply) -> None:
                    self.post(
                        fx.DeltaReplied(send.to, send.term, send.fragment, send.seq, reply, self.clock.now())
                    )

                self.transport.send_delta(send.to, send.frame, on_reply)
            case fx.PushUpdate():
                self.transport.push_update(intent.to, intent.frame)
            case fx.RelayUpdate():
                self.transport.relay(intent.to, intent.frame)
            case fx.Respond():
                try:
                    intent.answer.set_result(intent.value)
                except concurrent.futures.InvalidStateError:  # the asker gave up waiting (transport timeout)
                    pass
            case fx.ToLearner():
                if self.learner is not None:
                    self.learner.inbox.put(intent.message)
            case fx.SyncDue():
                self.sync_due(intent.at)
            case _:
                self.observer(intent)

    def sync_due(self, at: float | None) -> None:
        """Move the one sync-tick timer to `at` (peer clock; None: none due). The inline driver has no
        timers: its caller (the in-process swarm, a test) sends `Tick(SYNC)` on its own schedule."""

    def read_swarm(self, read: fx.ReadSwarm) -> fx.SwarmRecords:
        """Every record a swarm tick reads, all lookups in one round trip where the store can (`get_many`)."""
        optional = [*read.sampled, *([read.underway] if read.underway is not None else [])]
        found = get_many(self.kv, [read.heartbeats, *read.leases, *optional], self.clock.now())
        extra = iter(found[1 + len(read.leases) :])
        sampled = {key: next(extra) for key in read.sampled}
        underway = next(extra) if read.underway is not None else {}
        shard_leases = tuple(found[2 : 1 + len(read.leases)])
        return fx.SwarmRecords(
            found[0], found[1], self.clock.now(), underway, shard_leases, sampled
        )  # as of the read end

    def _store_latest(self, record: fx.StoreRecord) -> None:
        """Store `record`; while an earlier write to the same key and subkey still waits for the DHT, only
        the newest is kept (a frozen DHT node makes every call wait out hivemind's RPC timeout: heartbeats
        and lease renewals must not queue up behind each other)."""
        slot = (record.key, record.subkey)
        with self._stores_lock:
            queued = slot in self._stores
            self._stores[slot] = record
        if not queued:
            self.run_io(lambda: self._store_now(slot), None)

    def _store_now(self, slot: tuple[str, str]) -> bool:
        with self._stores_lock:
            record = self._stores.pop(slot)
        return self.kv.store(record.key, record.subkey, record.value, record.expiration)

    def run_io(self, call: Callable[[], Any], task: int | None) -> None:
        """Run a blocking DHT call; its result (or error) goes to `task` if one waits for it."""
        try:
            value, error = call(), None
        except Exception as exc:
            value, error = None, exc
        if task is not None:
            self.post(fx.TaskResult(task, value, error))

    def _when_done(self, futures: list[concurrent.futures.Future], task: int, *, single: bool) -> None:
        left = [len(futures)]

        def finished(_: concurrent.futures.Future) -> None:
            left[0] -= 1
            if left[0]:
                return
            if single:
                error = futures[0].exception()
                self.post(fx.TaskResult(task, None if error else futures[0].result(), error))
            else:
                results = [f.exception() or f.result() for f in futures]
                self.post(fx.TaskResult(task, results))

        for future in futures:
            future.add_done_callback(finished)

    # ---- inbound requests (the transport's `InboundHandlers`) ----------------------------------------

    def _ask(self, make: Callable[[concurrent.futures.Future], fx.Event]) -> concurrent.futures.Future:
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self.post(make(answer))
        return answer

    def handle_delta(self, sender: str, frame: bytes):  # noqa: ANN201
        return self._answer(self._ask(lambda a: fx.DeltaArrived(sender, frame, a, self.clock.now())))

    def handle_update(self, sender: str, frame: bytes):  # noqa: ANN201
        return self._answer(self._ask(lambda a: fx.UpdateArrived(sender, frame, a, self.clock.now())))

    def handle_relay(self, sender: str, frame: bytes):  # noqa: ANN201
        return self._answer(self._ask(lambda a: fx.RelayArrived(sender, frame, a, self.clock.now())))

    def serve_updates(self, requester: str, fragment: int, after_version: int):  # noqa: ANN201
        return self._answer(self._ask(lambda a: fx.UpdatesRequested(requester, fragment, after_version, a)))

    def serve_snapshot(self, requester: str, fragment: int):  # noqa: ANN201
        """The index of the fragment's offered state, made off the owner thread (`swarm.snapshots`);
        a refused request goes to the owner, which counts it."""
        snapshots = self.peer.serving.snapshots
        if self.peer.membership.allowed(requester) and snapshots.offered(fragment):
            return self.off_owner(lambda: snapshots.index_offered(fragment))
        return self._answer(self._ask(lambda a: fx.SnapshotRequested(requester, fragment, a)))

    def off_owner(self, fn: Callable[[], Any]):  # noqa: ANN201
        """Run `fn` away from the owner thread: here at once; `ThreadedDriver` on its I/O thread."""
        return fn()

    def serve_chunk(self, requester: str, fragment: int, chunk: int, checksum: str) -> bytes:
        """Answered here, on the transport's thread, from the peer's pinned snapshots (thread-safe,
        immutable tensors: `swarm.snapshots`), so a download never queues behind the owner."""
        if not self.peer.membership.allowed(requester):
            raise PermissionError(f"{requester} is not on this run's allowlist")
        return self.peer.serving.snapshots.chunk(fragment, chunk, checksum, self.clock.now())

    def _answer(self, answer: concurrent.futures.Future):  # noqa: ANN202
        """What a handler returns: the future itself (a threaded driver; the transport awaits it)."""
        return answer


class InlineDriver(PeerDriver):
    """Processes every event at once on the caller's thread; handlers answer synchronously."""

    def post(self, event: fx.Event) -> None:
        self.process(event)

    def _answer(self, answer: concurrent.futures.Future):  # noqa: ANN202
        return answer.result(timeout=0)

    # conveniences for the in-process swarm and tests: one call, one event

    def tick(self, now: float, **heartbeat_fields: Any) -> None:
        self.post(fx.Tick(fx.TickKind.SWARM, now, heartbeat_fields))

    def sync_tick(self, now: float, sync_seconds: float = 0.0) -> None:
        self.post(fx.Tick(fx.TickKind.SYNC, now, sync_seconds=sync_seconds))

    def catch_up(self, now: float, *, replay: bool) -> dict[str, int]:
        return self._ask(lambda a: fx.CatchUpRequested(now, replay, a)).result(timeout=0)

    def run_task(self, task) -> Any:  # noqa: ANN001
        """Run a peer task (e.g. `peer.repair.fetch_fragment(...)`) to its end; its result."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        self.peer.spawn(task, result.set_result)
        for intent in self.peer.flush():
            self.perform(intent)
        return result.result(timeout=0)

    def train_step(self, compute_seconds: float | None = None) -> None:
        """One inner step of the learner, then its due delta (if any) to the peer."""
        self.learner.train_step(compute_seconds=compute_seconds)
        ready = self.learner.take_due(self.clock.now(), self.peer.outbox.gate)
        if ready is not None:
            self.post(ready)
