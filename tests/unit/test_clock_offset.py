"""`doctor`'s clock check: this clock's offset against the peers', timed from when their heartbeats appear
in the DHT (`node.clock_offset`), and the ok / warn / fail verdict against `timing.lease_margin`. Peers
that write heartbeats on clocks of known offsets run on a fake clock: nothing sleeps."""

from __future__ import annotations

import pytest

from p2p_diloco.doctor.checks import Status
from p2p_diloco.doctor.clock import check_clock
from p2p_diloco.node.clock_offset import ClockOffset, HeartbeatRead, estimate_offset, read_heartbeats
from p2p_diloco.protocol.timing import SwarmTiming
from p2p_diloco.wire.interfaces import StoredValue

TIMING = SwarmTiming()  # heartbeat every 1 s, ttl 4 s, lease_margin 0.5 s


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class HeartbeatSwarm:
    """Peers writing a heartbeat every `period` on their own clocks (`offsets`: theirs minus this one);
    a write shows in reads `propagation` s later, and a read takes `latency` s of the fake clock."""

    def __init__(self, clock, offsets, *, propagation=0.02, latency=0.03, period=1.0, ttl=4.0):  # noqa: ANN001
        self.clock, self.offsets = clock, offsets
        self.propagation, self.latency, self.period, self.ttl = propagation, latency, period, ttl

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        self.clock.sleep(self.latency / 2)
        seen = self.clock.now
        self.clock.sleep(self.latency / 2)
        found = {}
        for i, (peer, offset) in enumerate(self.offsets.items()):
            phase = 0.37 * i  # peers write at different moments of a period
            written = ((seen - self.propagation - phase) // self.period) * self.period + phase  # this clock
            expiration = written + offset + self.ttl  # the writer's clock
            if expiration > now:
                found[peer] = StoredValue(b"{}", expiration)
        return found


def measure(offsets: dict[str, float], **swarm) -> ClockOffset | None:  # noqa: ANN003
    clock = FakeClock()
    kv = HeartbeatSwarm(clock, offsets, **swarm)
    reads = read_heartbeats(kv, "hb", clock=clock, sleep=clock.sleep, window=3.0, interval=0.25)
    assert clock.now >= 1003.0 and len(reads) >= 5  # read every 0.25 s (plus the read) for the whole window
    return estimate_offset(reads, TIMING.heartbeat_ttl, TIMING.heartbeat_period)


@pytest.mark.parametrize("peer_offset", [-0.8, 0.0, 0.3, 2.5])
def test_the_offset_is_found_within_its_stated_uncertainty(peer_offset):
    estimate = measure({"A": peer_offset, "B": peer_offset + 0.02, "C": peer_offset - 0.02})
    assert estimate is not None and estimate.peers == 3
    assert abs(estimate.offset - -peer_offset) <= estimate.uncertainty + 1e-9, estimate
    assert estimate.uncertainty <= 0.2  # the read interval plus the DHT's round trip, not the period
    assert estimate.spread == pytest.approx(0.04, abs=0.3)


def test_the_median_peer_decides_not_one_wrong_clock():
    estimate = measure({"A": 0.05, "B": 0.0, "C": 30.0})
    assert estimate is not None and abs(estimate.offset) < 0.25 and estimate.spread > 29


def test_a_slow_dht_widens_the_uncertainty_instead_of_biasing_the_offset():
    estimate = measure({"A": 1.0}, propagation=0.3, latency=0.4)
    assert estimate is not None and abs(estimate.offset - -1.0) <= estimate.uncertainty + 1e-9
    assert estimate.uncertainty > 0.2


def test_no_heartbeat_gives_no_estimate():
    assert measure({}) is None
    assert estimate_offset([HeartbeatRead(0.0, 0.1, {}), HeartbeatRead(1.0, 1.1, {})], 4.0, 1.0) is None


def test_verdicts_against_the_lease_margin():
    ok = check_clock(ClockOffset(offset=0.05, uncertainty=0.1, peers=3, spread=0.01), TIMING, 3.0)
    assert (
        ok.status == Status.OK and ok.detail.startswith("0.05 s ahead of the peers' (± 0.10 s") and not ok.fix
    )
    near = check_clock(ClockOffset(offset=-0.3, uncertainty=0.1, peers=1, spread=0.0), TIMING, 3.0)
    assert (
        near.status == Status.WARN
        and "0.30 s behind the peers'" in near.detail
        and "median of 1 peer)" in near.detail
    )
    assert "NTP" in near.fix and "tolerate 0.5 s" in near.fix
    # 0.7 s could be 0.55 s with its uncertainty: still beyond the 0.5 s margin
    far = check_clock(ClockOffset(offset=0.7, uncertainty=0.15, peers=2, spread=0.8), TIMING, 3.0)
    assert far.status == Status.FAIL and "beyond timing.lease_margin 0.5 s" in far.detail
    assert (
        "the peers disagree among themselves by 0.80 s" in far.detail
        and "timedatectl set-ntp true" in far.fix
    )
    unsure = check_clock(ClockOffset(offset=0.7, uncertainty=0.3, peers=2, spread=0.0), TIMING, 3.0)
    assert unsure.status == Status.WARN  # may be within the margin


def test_no_heartbeat_is_a_warning_that_names_the_clock_ahead_case():
    check = check_clock(None, TIMING, 3.0)
    assert check.status == Status.WARN and check.detail.startswith(
        "not compared: no peer's heartbeat read in 3 s"
    )
    assert "more than timing.heartbeat_ttl = 4 s ahead" in check.detail and "date -u" in check.fix
