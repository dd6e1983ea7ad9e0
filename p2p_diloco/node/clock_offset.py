"""This machine's clock against the peers' clocks, from the run's heartbeats in the DHT (`doctor`'s check).

Leases and heartbeats carry expirations on their writer's clock (a heartbeat expires `heartbeat_ttl` after
it was written, `swarm.election.membership`), so a reader whose clock disagrees with the writers' sees leases
lapse early or late. A passive reader cannot ask a peer for its time, but it can time the heartbeats it sees
appear: a heartbeat read back with expiration ``e`` was written at ``e - heartbeat_ttl`` on its writer's
clock, and on this clock no later than the end of the read that returned it (a lower bound of the
writer's offset) and, when it replaced an older heartbeat of that writer, no earlier than the start of the
read before (less that read's duration for the DHT's propagation: an upper bound). Reading every fraction
of a heartbeat period for a few periods narrows each writer's offset to about the read interval plus the
DHT's round trip.

`read_heartbeats` takes the clock and the sleep as arguments (tests pass a fake clock); `estimate_offset`
is pure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from p2p_diloco.wire.interfaces import KeyValueStore


@dataclass(frozen=True)
class HeartbeatRead:
    """One read of the run's heartbeat key: when it started and ended on this clock, and each writer's
    heartbeat expiration (on the writer's clock)."""

    started: float
    finished: float
    expirations: Mapping[str, float]


@dataclass(frozen=True)
class ClockOffset:
    """This clock minus the peers' (the median over peers; > 0: this clock is ahead), give or take
    `uncertainty` seconds; `spread`: how far apart the peers' own clocks are (max - min of their offsets)."""

    offset: float
    uncertainty: float
    peers: int
    spread: float


def read_heartbeats(
    kv: KeyValueStore,
    key: str,
    *,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    window: float,
    interval: float,
) -> list[HeartbeatRead]:
    """Reads of `key` every `interval` seconds for `window` seconds (at least two reads)."""
    reads: list[HeartbeatRead] = []
    end = clock() + window
    while True:
        started = clock()
        found = kv.get(key, started)
        finished = clock()
        reads.append(HeartbeatRead(started, finished, {peer: v.expiration for peer, v in found.items()}))
        if finished >= end and len(reads) >= 2:
            return reads
        sleep(interval)


def writer_bounds(reads: list[HeartbeatRead], peer: str, ttl: float, period: float) -> tuple[float, float]:
    """Bounds (low, high) of `peer`'s clock minus this one, from when its heartbeats appeared."""
    low, high = -math.inf, math.inf
    previous: HeartbeatRead | None = None
    for read in reads:
        expiration = read.expirations.get(peer)
        if expiration is not None:
            written = expiration - ttl  # on the writer's clock
            low = max(low, written - read.finished)
            before = previous.expirations.get(peer) if previous is not None else None
            if previous is not None and before is not None and before < expiration:
                # a newer heartbeat than the last read's: written after that read began, less its duration
                propagation = previous.finished - previous.started
                high = min(high, written - (previous.started - propagation))
        previous = read
    longest = max(r.finished - r.started for r in reads)
    if high < low:  # a stale answer of the DHT; fall back to the heartbeat period
        high = math.inf
    return low, min(high, low + period + longest)


def estimate_offset(reads: list[HeartbeatRead], ttl: float, period: float) -> ClockOffset | None:
    """This clock against the writers of the heartbeats in `reads`; None when no heartbeat was read."""
    peers = sorted({peer for read in reads for peer in read.expirations})
    if not peers:
        return None
    bounds = [writer_bounds(reads, peer, ttl, period) for peer in peers]
    middles = [(low + high) / 2 for low, high in bounds]
    halves = [(high - low) / 2 for low, high in bounds]
    return ClockOffset(
        offset=-statistics.median(middles),
        uncertainty=statistics.median(halves),
        peers=len(peers),
        spread=max(middles) - min(middles),
    )
