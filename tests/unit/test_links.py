"""The per-peer link model of the in-memory network (swarm/links.py): serialized uplinks, latency, downlinks."""

from __future__ import annotations

import pytest

from p2p_diloco.errors import ConfigError
from p2p_diloco.swarm.links import LinkModel, LinkSpec
from p2p_diloco.swarm.memory import EventLoop, FakeClock, SimNetwork

SPEC = LinkSpec(up=1000.0, down=4000.0, latency=0.05)  # bytes/s, s


def test_one_frame_takes_its_upload_time_plus_both_latencies():
    links = LinkModel(default=SPEC)
    assert links.arrival("a", "b", 500, now=10.0) == pytest.approx(10.0 + 0.5 + 0.1)
    assert links.sent == {"a": 500} and links.received == {"b": 500}


def test_a_peers_uploads_queue_behind_each_other():
    links = LinkModel(default=SPEC)
    arrivals = [links.arrival("a", dst, 1000, now=0.0) for dst in ("b", "c", "d")]
    # pushing to three peers takes three upload times: the cost of one publisher serving everyone
    assert arrivals == pytest.approx([1.1, 2.1, 3.1])
    assert links.busy_until("a") == pytest.approx(3.0)
    # another sender's uplink is free: its frame does not wait for a's
    assert links.arrival("e", "f", 1000, now=0.0) == pytest.approx(1.1)


def test_an_idle_uplink_starts_at_now_not_when_it_last_finished():
    links = LinkModel(default=SPEC)
    links.arrival("a", "b", 1000, now=0.0)
    assert links.arrival("a", "b", 1000, now=5.0) == pytest.approx(6.1)


def test_a_slow_downlink_queues_frames_from_many_senders():
    slow = LinkSpec(up=1000.0, down=500.0, latency=0.0)
    links = LinkModel(default=LinkSpec(up=1000.0, down=1000.0, latency=0.0), per_peer={"sink": slow})
    first = links.arrival("a", "sink", 1000, now=0.0)
    second = links.arrival("b", "sink", 1000, now=0.0)
    assert first == pytest.approx(2.0)  # sent by 1.0, but 1000 bytes at 500 B/s take 2 s to come in
    assert second == pytest.approx(first + 2.0)  # then the next sender's 1000 bytes, another 2 s
    assert links.received["sink"] == 2000


def test_bad_specs_and_sizes_are_refused():
    with pytest.raises(ConfigError):
        LinkSpec(up=0.0)
    with pytest.raises(ConfigError):
        LinkSpec(latency=-1.0)
    with pytest.raises(ValueError):
        LinkModel().arrival("a", "b", -1, now=0.0)


def test_the_sim_network_delivers_at_the_modelled_time():
    loop = EventLoop(FakeClock())
    network = SimNetwork(loop, links=LinkModel(default=SPEC))
    got: list[tuple[float, str]] = []

    class Sink:
        def handle_update(self, src, frame):
            got.append((loop.clock.now(), src))

    network.register("b", Sink())
    network.deliver("a", "b", b"x" * 1000, "update", None)
    network.deliver("a", "b", b"x" * 1000, "update", None)
    loop.run_until(10.0)
    assert [t for t, _ in got] == pytest.approx([1.1, 2.1])
    assert network.bytes_received["b"] == 2000
