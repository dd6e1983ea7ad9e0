"""What a `P2PTransport` moved, counted where it moves: on the transport's event loop thread.

Every stream of the transport is read and written by coroutines on its one loop thread, so the live
numbers (`TrafficBook`) change only there: payload bytes sent and received over streams to other peers
(request bodies and reply items, both ways: deltas and updates sent and received, fetches and what this
peer serves; framing, libp2p, DHT traffic and calls to ourselves excluded), inbound requests answered by
op and inbound rejections by tag. After each change the book publishes a new `TransportCounts`, an
immutable snapshot replaced whole; other threads read only that (`P2PTransport.counts`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from p2p_diloco.owner import Owner


def _frozen(counter: Counter[str]) -> Mapping[str, int]:
    return MappingProxyType(Counter(counter))  # a copy; reads of a missing key give 0


@dataclass(frozen=True)
class TransportCounts:
    """One moment of a transport's counters (module docstring); never changed."""

    bytes_sent: int = 0
    bytes_received: int = 0
    served: Mapping[str, int] = field(default_factory=lambda: _frozen(Counter()))
    rejected: Mapping[str, int] = field(default_factory=lambda: _frozen(Counter()))


class TrafficBook:
    """The live counters, changed on the loop thread only (`owner`, handed to it when the loop starts)."""

    def __init__(self, owner: Owner | None = None):
        self.owner = owner or Owner("p2p-transport")
        self._sent = 0
        self._received = 0
        self._served: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self.counts = TransportCounts()

    def moved(self, *, sent: int = 0, received: int = 0) -> None:
        self.owner.check("the transport's byte counts")
        self._sent += sent
        self._received += received
        self.counts = TransportCounts(self._sent, self._received, self.counts.served, self.counts.rejected)

    def served(self, op: str) -> None:
        self.owner.check("the transport's served counts")
        self._served[op] += 1
        self.counts = TransportCounts(self._sent, self._received, _frozen(self._served), self.counts.rejected)

    def rejected(self, tag: str) -> None:
        self.owner.check("the transport's rejection counts")
        self._rejected[tag] += 1
        self.counts = TransportCounts(self._sent, self._received, self.counts.served, _frozen(self._rejected))
