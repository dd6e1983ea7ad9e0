"""The latency half of the WAN emulator: a user-space forwarder that holds IPv4 packets for a fixed delay.

It runs inside the router namespace, attached to one TUN device. The router's policy routing sends every
packet between peer subnets into that device; the forwarder reads it, looks up the delay for its
(source subnet, destination subnet) pair (the sender's uplink plus the receiver's downlink one-way
delay), and after that delay writes it back into the same device. The kernel then sees it arrive on the
TUN device, where a higher-priority rule routes it by the main table to the destination's veth.
(This kernel has no netem: FINDINGS.md.)

Packets of one pair keep their order (equal delay, FIFO heap ties). Delays come from a JSON file
(`ForwarderConfig`); SIGHUP reloads it (`WanEmulator.shape`), SIGTERM/SIGINT stop the loop.
Run as ``python -m p2p_diloco.wan.forwarder --tun NAME --config FILE``; prints ``ready`` once attached.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import heapq
import json
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READY_LINE = "ready"
MAX_HELD_BYTES = 256 * 1024 * 1024  # drop beyond this many bytes in flight (a runaway sender)
READ_SIZE = 65536


@dataclass(frozen=True)
class ForwarderConfig:
    """One-way delays per /24 subnet (``"10.0.3"`` -> seconds): sender's uplink and receiver's downlink."""

    uplink_s: dict[str, float]
    downlink_s: dict[str, float]

    def to_json(self) -> str:
        return json.dumps({"uplink_s": self.uplink_s, "downlink_s": self.downlink_s}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ForwarderConfig:
        raw = json.loads(text)
        return cls(
            uplink_s={str(k): float(v) for k, v in raw["uplink_s"].items()},
            downlink_s={str(k): float(v) for k, v in raw["downlink_s"].items()},
        )

    def delay_table(self) -> dict[tuple[bytes, bytes], float]:
        """(source /24 as 3 bytes, destination /24) -> seconds, for every pair of known subnets."""
        subnets = set(self.uplink_s) | set(self.downlink_s)
        table = {}
        for src in subnets:
            for dst in subnets:
                delay = self.uplink_s.get(src, 0.0) + self.downlink_s.get(dst, 0.0)
                table[(_subnet_bytes(src), _subnet_bytes(dst))] = delay
        return table


def _subnet_bytes(subnet: str) -> bytes:
    parts = [int(x) for x in subnet.split(".")]
    if len(parts) != 3 or not all(0 <= p <= 255 for p in parts):
        raise ValueError(f"subnet must be three octets like '10.0.3', got {subnet!r}")
    return bytes(parts)


def open_tun(name: str) -> int:
    """Attach to the (persistent) TUN device `name` in this namespace; a non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        ifreq = struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI).ljust(40, b"\0")
        fcntl.ioctl(fd, TUNSETIFF, ifreq)
    except OSError:
        os.close(fd)
        raise
    return fd


class DelayLine:
    """Packets held until their release time; `push` and `due` take the clock as an argument."""

    def __init__(self, table: dict[tuple[bytes, bytes], float]):
        self.table = table
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self.held_bytes = 0
        self.forwarded = 0
        self.dropped = 0

    def delay_of(self, packet: bytes) -> float:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return 0.0  # not IPv4 (the namespaces disable IPv6): pass through undelayed
        return self.table.get((packet[12:15], packet[16:19]), 0.0)

    def push(self, packet: bytes, now: float) -> None:
        if self.held_bytes + len(packet) > MAX_HELD_BYTES:
            self.dropped += 1
            return
        self._seq += 1
        heapq.heappush(self._heap, (now + self.delay_of(packet), self._seq, packet))
        self.held_bytes += len(packet)

    def next_release(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[bytes]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            packet = heapq.heappop(self._heap)[2]
            self.held_bytes -= len(packet)
            out.append(packet)
        self.forwarded += len(out)
        return out


def raise_priority(increment: int = -10) -> None:
    """Run ahead of ordinary processes (root only): a starved forwarder would add delay and drop packets
    on a loaded machine, and the emulated link must not be what a CPU-bound test measures."""
    try:
        os.nice(increment)
    except OSError:
        pass


def run(tun: str, config_path: Path) -> int:
    raise_priority()
    fd = open_tun(tun)
    line = DelayLine(ForwarderConfig.from_json(config_path.read_text()).delay_table())
    flags = {"stop": False, "reload": False}

    def on_stop(_signum: int, _frame: FrameType | None) -> None:
        flags["stop"] = True

    def on_hup(_signum: int, _frame: FrameType | None) -> None:
        flags["reload"] = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_hup)
    poller = select.epoll()
    poller.register(fd, select.EPOLLIN)
    print(READY_LINE, flush=True)
    while not flags["stop"]:
        if flags["reload"]:
            flags["reload"] = False
            line.table = ForwarderConfig.from_json(config_path.read_text()).delay_table()
        release = line.next_release()
        timeout = 0.5 if release is None else max(0.0, release - time.monotonic())
        try:
            ready = poller.poll(timeout)
        except InterruptedError:
            continue
        if ready:
            now = time.monotonic()
            while True:
                try:
                    line.push(os.read(fd, READ_SIZE), now)
                except BlockingIOError:
                    break
        for packet in line.due(time.monotonic()):
            try:
                os.write(fd, packet)
            except OSError as exc:  # e.g. EINVAL for a malformed packet, ENOBUFS under pressure
                if exc.errno not in (errno.EINVAL, errno.ENOBUFS, errno.EAGAIN, errno.EIO):
                    raise
                line.dropped += 1
    print(f"forwarded {line.forwarded} dropped {line.dropped}", file=sys.stderr, flush=True)
    os.close(fd)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tun", required=True, help="persistent TUN device to attach to")
    parser.add_argument("--config", required=True, type=Path, help="ForwarderConfig JSON file")
    args = parser.parse_args(argv)
    return run(args.tun, args.config)


if __name__ == "__main__":
    sys.exit(main())
