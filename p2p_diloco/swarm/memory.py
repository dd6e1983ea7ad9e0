"""In-memory versions of the project's interfaces, for tests and the in-process swarm.

`FakeClock` and `EventLoop` give a deterministic discrete-event world; `InMemoryKeyValueStore` keeps
hivemind's rule (per key/subkey the later expiration wins, first writer on a tie);
`PartitionedKeyValueStore` is a store that can be split like a DHT cut in two (one replica per peer,
merged by the same rule on heal, or regrouped as DHT islands meet); `StarvedReads` lets a peer read only
its own records for a while;
`SimNetwork` routes frames between `InMemoryTransport`s with per-link
delays (fixed, or each peer's bandwidth and latency from a `swarm.links.LinkModel`) and fault rules,
delivering them as events (fetches across a dropped link fail).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.swarm.links import LinkModel
from p2p_diloco.wire.interfaces import InboundHandlers, KeyValueStore, Liveness, StoredValue
from p2p_diloco.wire.replies import LinkTag, Reply


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 0.0):
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"fake clock cannot go back from {self._now} to {t}")
        self._now = t


def _cancelled() -> None:
    """What a cancelled `Timer` runs."""


class Timer:
    """A callback `EventLoop.timer` scheduled. `cancel` keeps its event (it fires at its time, in its order,
    as a no-op, so no other event moves) but drops the callback at once, and with it whatever its closure
    holds: a reply timeout answered long before it is due, of which a simulated swarm of 256 peers holds
    tens of thousands (issue #40), as a real transport cancels its timer on the reply."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]):
        self.callback = callback

    def __call__(self) -> None:
        self.callback()

    def cancel(self) -> None:
        self.callback = _cancelled


class EventLoop:
    """A heap of (time, sequence, callback); `run_until` fires them in order on the fake clock."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.clock.now()), next(self._seq), callback))

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.call_at(self.clock.now() + delay, callback)

    def timer(self, delay: float, callback: Callable[[], None]) -> Timer:
        """`call_later`, cancellable (`Timer`)."""
        timer = Timer(callback)
        self.call_later(delay, timer)
        return timer

    def run_until(self, t_end: float, stop: Callable[[], bool] | None = None) -> None:
        while self._heap and self._heap[0][0] <= t_end:
            when, _, callback = heapq.heappop(self._heap)
            self.clock.advance_to(when)
            callback()
            if stop is not None and stop():
                return
        self.clock.advance_to(max(self.clock.now(), t_end))


class InMemoryKeyValueStore:
    """`KeyValueStore` in a dict, with hivemind's conflict rule."""

    def __init__(self) -> None:
        self._data: dict[str, dict[str, StoredValue]] = {}

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        return self.put(key, subkey, StoredValue(value=value, expiration=expiration))

    def put(self, key: str, subkey: str, stored: StoredValue) -> bool:
        """`store` of a record already built: one immutable record for every replica a write reaches."""
        records = self._data.setdefault(key, {})
        current = records.get(subkey)
        if current is not None and current.expiration >= stored.expiration:
            return False
        records[subkey] = stored
        return True

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        return {sk: v for sk, v in self._data.get(key, {}).items() if v.expiration > now}


class PartitionedKeyValueStore:
    """A `KeyValueStore` per peer (`view(peer_id)`) over one replica of the data per peer, like a split DHT.

    Unsplit, every write reaches every replica, so all views read the same. After `split(groups)` a write
    reaches only the replicas of the writer's group (peers in no group form one more group together);
    `heal()` merges all replicas by hivemind's rule (per key/subkey the later expiration wins; on a tie
    the replica of the first peer in sorted order) and makes them identical again. A peer first seen
    while split starts from a merge of its own group's replicas.
    """

    def __init__(self) -> None:
        self._replicas: dict[str, InMemoryKeyValueStore] = {}
        self._groups: list[frozenset[str]] | None = None
        self._group_index: dict[str, int] = {}

    @property
    def split_groups(self) -> list[frozenset[str]] | None:
        return self._groups

    def view(self, peer_id: str) -> PeerKeyValueView:
        if peer_id not in self._replicas:
            replica = InMemoryKeyValueStore()
            _merge_into(replica, [self._replicas[p] for p in sorted(self._reachable(peer_id))])
            self._replicas[peer_id] = replica
        return PeerKeyValueView(self, peer_id)

    def split(self, groups: list[set[str]] | list[frozenset[str]]) -> None:
        groups = [frozenset(g) for g in groups]
        if any(a & b for i, a in enumerate(groups) for b in groups[i + 1 :]):
            raise ValueError(f"partition groups overlap: {groups}")
        self._set_groups(groups)

    def heal(self) -> None:
        merged = InMemoryKeyValueStore()
        _merge_into(merged, [self._replicas[p] for p in sorted(self._replicas)])
        for p in self._replicas:
            replica = InMemoryKeyValueStore()
            _merge_into(replica, [merged])
            self._replicas[p] = replica
        self._set_groups(None)

    def regroup(self, groups: list[set[str]] | list[frozenset[str]]) -> None:
        """Set the groups (as `split`); members of one new group that were apart merge their replicas by
        hivemind's rule, as two DHT islands do once their nodes meet."""
        groups = [frozenset(g) for g in groups]
        if any(a & b for i, a in enumerate(groups) for b in groups[i + 1 :]):
            raise ValueError(f"groups overlap: {groups}")
        for group in groups:
            members = [p for p in sorted(group) if p in self._replicas]
            if len({self._group_of(p) for p in members} if self._groups is not None else {0}) > 1:
                merged = InMemoryKeyValueStore()
                _merge_into(merged, [self._replicas[p] for p in members])
                for p in members:
                    self._replicas[p] = InMemoryKeyValueStore()
                    _merge_into(self._replicas[p], [merged])
        self._set_groups(groups)

    def _set_groups(self, groups: list[frozenset[str]] | None) -> None:
        self._groups = groups
        # peer -> its group's index: every store asks it of each replica (M per store)
        self._group_index = {p: i for i, g in enumerate(groups or ()) for p in g}

    def forget(self, peer_id: str) -> None:
        """Drop `peer_id`'s replica: its DHT process is gone, and a new one starts empty."""
        self._replicas.pop(peer_id, None)

    def reachable(self, a: str, b: str) -> bool:
        if self._groups is None:
            return True
        return self._group_of(a) == self._group_of(b)

    def _group_of(self, peer: str) -> int:
        assert self._groups is not None
        return self._group_index.get(peer, -1)

    def _reachable(self, writer: str) -> list[str]:
        if self._groups is None:
            return list(self._replicas)
        return [p for p in self._replicas if self.reachable(writer, p)]

    def store_from(self, writer: str, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        record, stored = StoredValue(value=value, expiration=expiration), False
        for p in self._reachable(writer):  # one record object for all M replicas, not one each
            stored |= self._replicas[p].put(key, subkey, record) and p == writer
        return stored

    def get_for(self, reader: str, key: str, now: float) -> dict[str, StoredValue]:
        return self._replicas[reader].get(key, now)


class PeerKeyValueView:
    """One peer's `KeyValueStore` on a `PartitionedKeyValueStore`."""

    def __init__(self, store: PartitionedKeyValueStore, peer_id: str):
        self._store = store
        self.peer_id = peer_id

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        return self._store.store_from(self.peer_id, key, subkey, value, expiration)

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        return self._store.get_for(self.peer_id, key, now)


class StarvedReads:
    """A `KeyValueStore` whose reads return only `peer_id`'s own records (subkey) while `starved(now)`."""

    def __init__(self, store: KeyValueStore, peer_id: str, starved: Callable[[float], bool]):
        self._store, self.peer_id, self._starved = store, peer_id, starved

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        return self._store.store(key, subkey, value, expiration)

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        found = self._store.get(key, now)
        return {sk: v for sk, v in found.items() if sk == self.peer_id} if self._starved(now) else found


def _merge_into(target: InMemoryKeyValueStore, sources: list[InMemoryKeyValueStore]) -> None:
    for source in sources:
        for key, records in source._data.items():
            for subkey, stored in records.items():
                target.store(key, subkey, stored.value, stored.expiration)


@dataclass
class LinkRule:
    """Fault injection on frames from `src` to `dst` ("*" matches any): drop or add delay."""

    src: str = "*"
    dst: str = "*"
    drop: bool = False
    extra_delay: float = 0.0
    until: float = float("inf")

    def matches(self, src: str, dst: str, now: float) -> bool:
        return now < self.until and self.src in ("*", src) and self.dst in ("*", dst)


@dataclass
class SimNetwork:
    """Routes frames between peers registered with their handlers; down peers receive nothing."""

    loop: EventLoop
    base_delay: float = 0.05
    bytes_per_second: float = 12.5e6  # 100 Mbit/s per link
    rules: list[LinkRule] = field(default_factory=list)
    links: LinkModel | None = None  # per-peer bandwidth and latency (swarm.links) instead of the two above
    handlers: dict[str, InboundHandlers] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    dropped: int = 0

    def register(self, peer_id: str, handlers: InboundHandlers) -> None:
        self.handlers[peer_id] = handlers

    def unregister(self, peer_id: str) -> None:
        self.handlers.pop(peer_id, None)

    def is_up(self, peer_id: str) -> bool:
        return peer_id in self.handlers

    def blocked(self, src: str, dst: str) -> bool:
        """Whether a drop rule cuts the link between `src` and `dst` in either direction (a request
        needs both)."""
        now = self.loop.clock.now()
        return any(
            rule.drop and (rule.matches(src, dst, now) or rule.matches(dst, src, now)) for rule in self.rules
        )

    def _delay(self, src: str, dst: str, size: int) -> float | None:
        now = self.loop.clock.now()
        if self.links is not None:
            delay = self.links.arrival(src, dst, size, now) - now
        else:
            delay = self.base_delay + size / self.bytes_per_second
        for rule in self.rules:
            if rule.matches(src, dst, now):
                if rule.drop:
                    return None
                delay += rule.extra_delay
        return delay

    def deliver(
        self,
        src: str,
        dst: str,
        frame: bytes,
        kind: str,
        on_reply: Callable[[Reply], None] | None,
        *,
        answer_drops: bool = False,
    ) -> None:
        """Deliver `frame` after its link's delay; `on_reply` gets the answer. A dropped frame gets none,
        unless `answer_drops` (a relay frame's sender waits on a future): then a transient one."""
        delay = self._delay(src, dst, len(frame))
        self.bytes_sent[src] = self.bytes_sent.get(src, 0) + len(frame)
        if delay is None:
            self.dropped += 1
            if answer_drops and on_reply is not None:
                lost = Reply.transient(LinkTag.PEER_DOWN, f"{kind} to {dst} dropped")
                self.loop.call_later(self.base_delay, lambda: on_reply(lost))
            return

        def arrive() -> None:
            handlers = self.handlers.get(dst)
            if handlers is None:  # a crashed peer's address refuses the connection
                self.dropped += 1
                if on_reply is not None:
                    down = Reply.transient(LinkTag.PEER_DOWN, f"{dst} refused the connection")
                    self.loop.call_later(self.base_delay, lambda: on_reply(down) if self.is_up(src) else None)
                return
            self.bytes_received[dst] = self.bytes_received.get(dst, 0) + len(frame)
            handle = getattr(handlers, f"handle_{kind}")  # handle_delta, handle_update or handle_relay
            reply = handle(src, frame)
            if on_reply is not None:
                self.loop.call_later(self.base_delay, lambda: on_reply(reply) if self.is_up(src) else None)

        self.loop.call_later(delay, arrive)


class InMemoryTransport:
    """`Transport` for one peer on a `SimNetwork`. Fetches answer at once (fake time does not move)."""

    def __init__(self, network: SimNetwork, peer_id: str):
        self.network = network
        self.peer_id = peer_id

    def bind(self, handlers: InboundHandlers) -> None:
        self.network.register(self.peer_id, handlers)

    def close(self) -> None:
        self.network.unregister(self.peer_id)

    def send_delta(self, to_peer: str, frame: bytes, on_reply: Callable[[Reply], None] | None = None) -> None:
        self.network.deliver(self.peer_id, to_peer, frame, "delta", on_reply)

    def push_update(
        self, to_peer: str, frame: bytes, on_reply: Callable[[Reply], None] | None = None
    ) -> None:
        self.network.deliver(self.peer_id, to_peer, frame, "update", on_reply)

    def relay(self, to_peer: str, frame: bytes) -> Future[Reply]:
        future: Future[Reply] = Future()
        self.network.deliver(self.peer_id, to_peer, frame, "relay", future.set_result, answer_drops=True)
        return future

    def _remote(self, peer: str) -> InboundHandlers:
        handlers = self.network.handlers.get(peer)
        if handlers is None or self.network.blocked(self.peer_id, peer):
            raise ConnectionError(f"peer {peer} is not reachable")
        return handlers

    def fetch_updates(self, from_peer: str, fragment: int, after_version: int) -> list[bytes]:
        frames = self._remote(from_peer).serve_updates(self.peer_id, fragment, after_version)
        self.network.bytes_received[self.peer_id] = self.network.bytes_received.get(self.peer_id, 0) + sum(
            map(len, frames)
        )
        return frames

    def fetch_snapshot(self, from_peer: str, fragment: int) -> bytes:
        frame = self._remote(from_peer).serve_snapshot(self.peer_id, fragment)
        self.network.bytes_received[self.peer_id] = self.network.bytes_received.get(self.peer_id, 0) + len(
            frame
        )
        return frame

    def probe(self, peer: str, addresses: Sequence[str] = ()) -> Future[Liveness]:
        """DOWN for a peer that is not running (crashed), UNKNOWN behind a dropped link."""
        if self.network.blocked(self.peer_id, peer):
            liveness = Liveness.UNKNOWN
        else:
            liveness = Liveness.ALIVE if self.network.is_up(peer) else Liveness.DOWN
        return _settled(lambda: liveness)

    def request_updates(self, from_peer: str, fragment: int, after_version: int) -> Future[list[bytes]]:
        return _settled(lambda: self.fetch_updates(from_peer, fragment, after_version))

    def request_snapshot(self, from_peer: str, fragment: int) -> Future[bytes]:
        return _settled(lambda: self.fetch_snapshot(from_peer, fragment))

    def fetch_chunk(self, from_peer: str, fragment: int, chunk: int, checksum: str, nbytes: int) -> bytes:
        try:
            data = self._remote(from_peer).serve_chunk(self.peer_id, fragment, chunk, checksum)
        except LookupError as exc:
            raise ConnectionError(f"{from_peer}: {exc}") from exc
        if len(data) > nbytes:
            raise ConnectionError(
                f"{from_peer} answered chunk {chunk} with {len(data)} bytes, limit {nbytes}"
            )
        self.network.bytes_received[self.peer_id] = self.network.bytes_received.get(self.peer_id, 0) + len(
            data
        )
        return data

    def request_chunk(
        self, from_peer: str, fragment: int, chunk: int, checksum: str, nbytes: int
    ) -> Future[bytes]:
        return _settled(lambda: self.fetch_chunk(from_peer, fragment, chunk, checksum, nbytes))


def _settled(call: Callable[[], Any]) -> Future:
    """A future already holding `call`'s result or exception (fake time does not move for a fetch)."""
    future: Future = Future()
    try:
        future.set_result(call())
    except Exception as exc:
        future.set_exception(exc)
    return future
