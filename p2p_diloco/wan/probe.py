"""Measuring what the WAN emulator delivers: UDP round trips and TCP throughput between two peers.

The servers and clients are tiny Python programs run inside the peers' namespaces
(``python -m p2p_diloco.wan.probe udp-echo|udp-ping|tcp-sink|tcp-send ...``), each printing one JSON
line; `measure_rtt` and `measure_throughput` drive them through a `WanEmulator`. No `ping` or `iperf`
is needed. Throughput is measured at the receiver, after a warm-up (TCP slow start over a long RTT).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from p2p_diloco.wan.forwarder import raise_priority

if TYPE_CHECKING:
    from p2p_diloco.wan.emulator import WanEmulator

PROBE_PORT = 47001
LISTENING_LINE = "listening"
CHUNK = 64 * 1024


@dataclass(frozen=True)
class RttResult:
    samples_ms: list[float]
    lost: int

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    def summary(self) -> dict[str, Any]:
        s = sorted(self.samples_ms)
        return {
            "median_ms": self.median_ms,
            "min_ms": s[0],
            "max_ms": s[-1],
            "count": len(s),
            "lost": self.lost,
        }


@dataclass(frozen=True)
class ThroughputResult:
    bytes: int
    seconds: float
    mbit: float  # whole transfer, first byte to last
    steady_mbit: float  # after the warm-up


# ---- the programs (run inside namespaces) ---------------------------------------------------------


def _udp_echo(port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    print(LISTENING_LINE, flush=True)
    while True:
        data, addr = sock.recvfrom(2048)
        sock.sendto(data, addr)


def _udp_ping(host: str, port: int, count: int, interval: float, timeout: float) -> dict[str, Any]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(timeout)
    samples, lost = [], 0
    for seq in range(count):
        payload = seq.to_bytes(4, "big") + b"\0" * 60
        start = time.monotonic()
        sock.sendto(payload, (host, port))
        while True:
            try:
                data, _ = sock.recvfrom(2048)
            except TimeoutError:
                lost += 1
                break
            if data[:4] == payload[:4]:
                samples.append((time.monotonic() - start) * 1000.0)
                break  # a late reply to an earlier probe is skipped above
        time.sleep(interval)
    return {"samples_ms": samples, "lost": lost}


def _tcp_sink(port: int, warmup: float) -> dict[str, Any]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(1)
    print(LISTENING_LINE, flush=True)
    conn, _ = server.accept()
    total, first, last = 0, None, 0.0
    steady_start_bytes, steady_start = None, None
    while True:
        data = conn.recv(CHUNK)
        now = time.monotonic()
        if not data:
            break
        if first is None:
            first = now
        total += len(data)
        last = now
        if steady_start is None and now - first >= warmup:
            steady_start, steady_start_bytes = now, total
    conn.close()
    seconds = (last - first) if first is not None else 0.0
    mbit = total * 8 / seconds / 1e6 if seconds > 0 else 0.0
    steady = mbit
    if steady_start is not None and last > steady_start:
        steady = (total - (steady_start_bytes or 0)) * 8 / (last - steady_start) / 1e6
    return asdict(ThroughputResult(bytes=total, seconds=seconds, mbit=mbit, steady_mbit=steady))


def _tcp_send(host: str, port: int, seconds: float) -> dict[str, Any]:
    sock = socket.create_connection((host, port), timeout=10)
    chunk = b"\0" * CHUNK
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        sent += sock.send(chunk)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # wait for the sink to close: everything was delivered
    sock.close()
    return {"bytes": sent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("udp-echo")
    p.add_argument("--port", type=int, default=PROBE_PORT)
    p = sub.add_parser("udp-ping")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=PROBE_PORT)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=2.0)
    p = sub.add_parser("tcp-sink")
    p.add_argument("--port", type=int, default=PROBE_PORT)
    p.add_argument("--warmup", type=float, default=1.0)
    p = sub.add_parser("tcp-send")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=PROBE_PORT)
    p.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    raise_priority()  # measure the link, not how starved the probe is on a loaded machine
    if args.cmd == "udp-echo":
        _udp_echo(args.port)
    elif args.cmd == "udp-ping":
        print(json.dumps(_udp_ping(args.host, args.port, args.count, args.interval, args.timeout)))
    elif args.cmd == "tcp-sink":
        print(json.dumps(_tcp_sink(args.port, args.warmup)), flush=True)
    else:
        print(json.dumps(_tcp_send(args.host, args.port, args.seconds)))
    return 0


# ---- drivers (run in the host namespace) -----------------------------------------------------------


def _probe_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco.wan.probe", *args]


def _start_server(wan: WanEmulator, peer: str, argv: list[str]) -> subprocess.Popen[str]:
    server = wan.spawn(peer, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline().strip()
    if line != LISTENING_LINE:
        raise RuntimeError(
            f"probe server in {peer} did not start: {line!r} {server.stderr.read() if server.stderr else ''}"
        )
    return server


def measure_rtt(
    wan: WanEmulator, src: str, dst: str, *, count: int = 20, interval: float = 0.05
) -> RttResult:
    """UDP round trips from `src` to `dst` (`dst` must accept inbound traffic: not a NAT peer)."""
    server = _start_server(wan, dst, _probe_argv("udp-echo"))
    try:
        argv = _probe_argv(
            "udp-ping", "--host", wan.address(dst), "--count", str(count), "--interval", str(interval)
        )
        out = subprocess.run(wan.command(src, argv), capture_output=True, text=True, timeout=60 + count * 3)
        if out.returncode != 0:
            raise RuntimeError(f"udp-ping failed: {out.stderr.strip()}")
        raw = json.loads(out.stdout)
        return RttResult(samples_ms=raw["samples_ms"], lost=raw["lost"])
    finally:
        server.kill()
        server.wait()


def measure_throughput(
    wan: WanEmulator, src: str, dst: str, *, seconds: float = 5.0, warmup: float = 1.0
) -> ThroughputResult:
    """One TCP stream from `src` to `dst` for `seconds`, measured at `dst`."""
    sink = _start_server(wan, dst, _probe_argv("tcp-sink", "--warmup", str(warmup)))
    try:
        argv = _probe_argv("tcp-send", "--host", wan.address(dst), "--seconds", str(seconds))
        out = subprocess.run(wan.command(src, argv), capture_output=True, text=True, timeout=seconds + 60)
        if out.returncode != 0:
            raise RuntimeError(f"tcp-send failed: {out.stderr.strip()}")
        assert sink.stdout is not None
        return ThroughputResult(**json.loads(sink.stdout.readline()))
    finally:
        sink.kill()
        sink.wait()


if __name__ == "__main__":
    sys.exit(main())
