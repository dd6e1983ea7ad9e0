"""The world the simulated nodes live in: virtual time, the event loop, the links, the DHT and the trace.

Everything random in a run draws from generators seeded here, in an order fixed by the event loop, so a
seed replays the same run bit for bit. The DHT is `swarm.memory.PartitionedKeyValueStore` (hivemind's
record rule: per key and subkey the later expiration wins, first writer on a tie; records expire), its
groups set by who can find whom (`routing`) and by the network's cuts (a partition). The trace is the run's
event log: one line per fault, phase change and protocol decision, in virtual-time order; two runs of one seed
give byte-identical traces.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2p_diloco.swarm.memory import EventLoop, FakeClock, PartitionedKeyValueStore, PeerKeyValueView, Timer
from p2p_diloco.wire.interfaces import InboundHandlers


@dataclass(frozen=True)
class LinkSpec:
    """Every link's latency (one way, plus up to `jitter`), bandwidth and loss rate (of frames)."""

    latency: float = 0.03
    jitter: float = 0.02
    bytes_per_second: float = 12.5e6  # 100 Mbit/s
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.latency < 0 or self.jitter < 0 or self.bytes_per_second <= 0:
            raise ValueError(f"link latency and jitter must be >= 0 and bandwidth > 0, got {self}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"link loss must be in [0, 1), got {self.loss}")


class Trace:
    """The run's event log: `t who what {fields}` lines, fields as sorted JSON."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, t: float, who: str, what: str, **fields: Any) -> None:
        body = json.dumps(fields, sort_keys=True, default=str) if fields else ""
        self.lines.append(f"{t:.6f} {who} {what} {body}".rstrip())

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def digest(self) -> str:
        return hashlib.blake2b(self.text().encode(), digest_size=16).hexdigest()


class World:
    """Clock, event loop, links, DHT and trace of one simulated run (module docstring)."""

    def __init__(self, seed: int, link: LinkSpec | None = None):
        self.seed = seed
        self.clock = FakeClock()
        self.loop = EventLoop(self.clock)
        self.link = link or LinkSpec()
        self.rng = random.Random(f"world:{seed}")  # jitter and loss, drawn in event order
        self.dht = PartitionedKeyValueStore()  # grouped by `routing.Routing`: DHT islands
        self.cut: list[frozenset[str]] | None = None  # a network partition's sides
        self.network_listeners: list[Callable[[], None]] = []
        self.trace = Trace()
        self.handlers: dict[str, InboundHandlers] = {}  # nodes whose process is up, by peer ID
        self.frozen: set[str] = set()  # SIGSTOPped nodes: connections open, nothing answers
        self.bytes_sent: dict[str, int] = {}
        self.frames_lost = 0

    def now(self) -> float:
        return self.clock.now()

    def note(self, who: str, what: str, **fields: Any) -> None:
        self.trace.add(self.now(), who, what, **fields)

    def node_rng(self, peer_id: str, purpose: str) -> random.Random:
        """A generator of one node's own, independent of how often others draw."""
        return random.Random(f"{self.seed}:{peer_id}:{purpose}")

    # ---- the DHT and the network's cuts --------------------------------------------------------------

    def dht_view(self, peer_id: str) -> PeerKeyValueView:
        return self.dht.view(peer_id)

    def split(self, groups: list[frozenset[str]]) -> None:
        """Cut the network: members of different `groups` cannot talk (members in none form one more)."""
        self.cut = [frozenset(g) for g in groups]
        self._network_changed()

    def heal(self) -> None:
        if self.cut is not None:
            self.cut = None
            self._network_changed()

    def _network_changed(self) -> None:
        for listener in self.network_listeners:
            listener()

    def reachable(self, a: str, b: str) -> bool:
        if self.cut is None:
            return True
        return self._side(a) == self._side(b)

    def _side(self, peer: str) -> int:
        assert self.cut is not None
        return next((i for i, g in enumerate(self.cut) if peer in g), -1)

    # ---- the links ----------------------------------------------------------------------------------

    def register(self, peer_id: str, handlers: InboundHandlers) -> None:
        self.handlers[peer_id] = handlers

    def unregister(self, peer_id: str, handlers: InboundHandlers) -> None:
        if self.handlers.get(peer_id) is handlers:
            del self.handlers[peer_id]

    def link_delay(self, src: str, dst: str, size: int) -> float | None:
        """Seconds a frame of `size` bytes takes from `src` to `dst`, or None if it is lost (a partition
        cuts the link; otherwise each frame is lost with the link's loss rate)."""
        if not self.reachable(src, dst):
            self.frames_lost += 1
            return None
        self.bytes_sent[src] = self.bytes_sent.get(src, 0) + size
        if self.link.loss and self.rng.random() < self.link.loss:
            self.frames_lost += 1
            return None
        return self.link.latency + self.rng.uniform(0.0, self.link.jitter) + size / self.link.bytes_per_second

    def later(self, delay: float, callback: Callable[[], None]) -> None:
        self.loop.call_later(delay, callback)

    def timer(self, delay: float, callback: Callable[[], None]) -> Timer:
        """`later`, cancellable: a timeout its answer makes moot."""
        return self.loop.timer(delay, callback)
