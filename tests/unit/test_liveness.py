"""Liveness probes: a refused TCP connection is DOWN, an accepting socket ALIVE, anything else UNKNOWN;
and which heartbeat addresses are probed at all."""

from __future__ import annotations

import asyncio
import socket

from p2p_diloco.net.addresses import tcp_endpoints
from p2p_diloco.net.liveness import probe_endpoints, refused
from p2p_diloco.wire.interfaces import Liveness

PEER = "QmNYmKu9sGVkkzD5LST6jn2X9DQ52JVZp3zQ7GvXXGVN89"


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_listening_port_is_alive_a_closed_one_down_and_a_mix_never_down():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        alive = ("127.0.0.1", server.getsockname()[1])
        dead = ("127.0.0.1", closed_port())
        assert asyncio.run(probe_endpoints([alive])) == Liveness.ALIVE
        assert asyncio.run(probe_endpoints([dead])) == Liveness.DOWN
        assert asyncio.run(probe_endpoints([dead, alive])) == Liveness.ALIVE  # any address answering


def test_only_plain_tcp_addresses_are_probed():
    texts = [
        f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}",
        "/ip6/::1/tcp/4002",
        f"/ip4/1.2.3.4/tcp/4001/p2p/{PEER}/p2p-circuit/p2p/{PEER}",  # relayed: not this peer's socket
        "/ip4/127.0.0.1/udp/4001/quic-v1",
        "not an address",
    ]
    assert tcp_endpoints(texts) == [("127.0.0.1", 4001), ("::1", 4002)]


def test_libp2p_errors_count_as_refused_only_without_a_timeout():
    assert refused(ConnectionError("dial tcp4 127.0.0.1:4001: connect: connection refused"))
    assert not refused(ConnectionError("* [/ip4/127.0.0.1/tcp/4001] dial backoff"))
    assert not refused(ConnectionError("connection refused; * [/ip4/10.0.0.1/tcp/1] i/o timeout"))
