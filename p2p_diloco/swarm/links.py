"""A bandwidth and latency model of each peer's access link, for the in-memory network (time passed in).

Each peer has an uplink and a downlink of given bytes per second and a one-way access latency
(`LinkSpec`); the wide-area core between them is assumed never to be the bottleneck. A frame from `src`
to `dst` of `size` bytes, handed over at time `now`:

* waits for the frames `src` sent before it, then leaves over the uplink: ``departs = max(now,
  uplink free) + size / up[src]`` (a peer's uploads are serialized, so a peer that pushes one update to
  M peers takes M times as long as one push: the cost that issue #29 is about);
* crosses the core in ``latency[src] + latency[dst]``;
* comes in over the downlink while it is sent (cut-through), after the frames arriving there before it:
  ``arrives = max(departs + latency, max(now + latency, downlink free) + size / down[dst])``.

First-in first-out, no loss: a coarse model, but one whose
busiest links are the ones that are busiest on a real swarm of home peers. `LinkModel` also counts the
bytes each peer sent and received. `swarm.memory.SimNetwork` uses it when given one (`links=`); without
one the network keeps its fixed per-frame delay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from p2p_diloco.errors import ConfigError

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class LinkSpec:
    """One peer's access link: bytes per second each way and one-way latency in seconds."""

    up: float = 20 * MBIT
    down: float = 100 * MBIT
    latency: float = 0.02

    def __post_init__(self) -> None:
        if not (self.up > 0 and self.down > 0):
            raise ConfigError(f"link rates must be > 0 bytes/s, got up {self.up} down {self.down}")
        if self.latency < 0:
            raise ConfigError(f"link latency must be >= 0 s, got {self.latency}")


@dataclass
class LinkModel:
    """The access links of a swarm (module docstring); `per_peer` overrides `default` for some peers."""

    default: LinkSpec = field(default_factory=LinkSpec)
    per_peer: Mapping[str, LinkSpec] = field(default_factory=dict)
    uplink_free: dict[str, float] = field(default_factory=dict)
    downlink_free: dict[str, float] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    def spec(self, peer: str) -> LinkSpec:
        return self.per_peer.get(peer, self.default)

    def arrival(self, src: str, dst: str, size: int, now: float) -> float:
        """When a frame of `size` bytes handed to `src`'s uplink at `now` has fully arrived at `dst`."""
        if size < 0:
            raise ValueError(f"a frame has >= 0 bytes, got {size}")
        a, b = self.spec(src), self.spec(dst)
        departs = max(now, self.uplink_free.get(src, 0.0)) + size / a.up
        self.uplink_free[src] = departs
        latency = a.latency + b.latency
        starts_in = max(now + latency, self.downlink_free.get(dst, 0.0))
        arrives = max(departs + latency, starts_in + size / b.down)
        self.downlink_free[dst] = arrives
        self.sent[src] = self.sent.get(src, 0) + size
        self.received[dst] = self.received.get(dst, 0) + size
        return arrives

    def busy_until(self, peer: str) -> float:
        """When `peer`'s uplink has sent everything handed to it so far."""
        return self.uplink_free.get(peer, 0.0)
