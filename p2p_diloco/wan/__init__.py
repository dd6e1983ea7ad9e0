"""WAN emulation for tests and benchmarks: namespaces, delay (TUN forwarder), rate (tbf) and NAT."""

from p2p_diloco.wan.emulator import (
    EmulatorError,
    LinkSpec,
    PeerSpec,
    WanEmulator,
    cleanup,
    cleanup_stale,
    environment_problem,
    nat_problem,
)

__all__ = [
    "EmulatorError",
    "LinkSpec",
    "PeerSpec",
    "WanEmulator",
    "cleanup",
    "cleanup_stale",
    "environment_problem",
    "nat_problem",
]
