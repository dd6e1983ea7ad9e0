"""Pure parts of the WAN emulator (no root needed): the delay line, its config, the peer syntax."""

from __future__ import annotations

import pytest

from p2p_diloco.wan.cli import parse_peer
from p2p_diloco.wan.emulator import LinkSpec, PeerSpec
from p2p_diloco.wan.forwarder import DelayLine, ForwarderConfig


def _ipv4(src: str, dst: str, payload: bytes = b"") -> bytes:
    header = bytearray(20)
    header[0] = 0x45
    header[12:16] = bytes(int(x) for x in src.split("."))
    header[16:20] = bytes(int(x) for x in dst.split("."))
    return bytes(header) + payload


def test_delay_is_sender_uplink_plus_receiver_downlink():
    config = ForwarderConfig(
        uplink_s={"10.0.1": 0.010, "10.0.2": 0.030}, downlink_s={"10.0.1": 0.005, "10.0.2": 0.0}
    )
    line = DelayLine(config.delay_table())
    assert line.delay_of(_ipv4("10.0.1.2", "10.0.2.2")) == pytest.approx(0.010)
    assert line.delay_of(_ipv4("10.0.2.2", "10.0.1.2")) == pytest.approx(0.035)
    assert line.delay_of(_ipv4("10.0.9.2", "10.0.1.2")) == 0.0  # a subnet the emulator did not make
    assert line.delay_of(b"\x60" + b"\0" * 39) == 0.0  # IPv6: passed through


def test_delay_line_releases_in_time_and_in_order():
    config = ForwarderConfig(
        uplink_s={"10.0.1": 0.1, "10.0.2": 0.0}, downlink_s={"10.0.1": 0.0, "10.0.2": 0.0}
    )
    line = DelayLine(config.delay_table())
    slow = [_ipv4("10.0.1.2", "10.0.2.2", bytes([i])) for i in range(3)]
    fast = _ipv4("10.0.2.2", "10.0.1.2", b"f")
    for i, packet in enumerate(slow):
        line.push(packet, now=1.0 + i * 0.001)
    line.push(fast, now=1.05)
    assert line.due(1.05) == [fast]
    assert line.due(1.0999) == []
    assert line.due(1.2) == slow  # FIFO within a pair
    assert line.held_bytes == 0 and line.forwarded == 4


def test_config_round_trips_through_json():
    config = ForwarderConfig(uplink_s={"10.0.1": 0.025}, downlink_s={"10.0.1": 0.01})
    assert ForwarderConfig.from_json(config.to_json()) == config


def test_peer_syntax():
    assert parse_peer("a") == PeerSpec("a")
    assert parse_peer("a:25:20") == PeerSpec("a", LinkSpec(25.0, 20.0))
    assert parse_peer("b::20") == PeerSpec("b", LinkSpec(0.0, 20.0))
    assert parse_peer("n:10:nat") == PeerSpec("n", LinkSpec(10.0), nat=True)
    for bad in ("a:x", "a:1:2:3", "a:-5", "router", "a b"):
        with pytest.raises(ValueError):
            parse_peer(bad)
