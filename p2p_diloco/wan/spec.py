"""What a WAN emulation is made of and whether this host can run one.

The peers and their access links (`PeerSpec`, `LinkSpec`), the names and address plan every run uses
(`FAMILY` prefixes, `PUBLIC_NET`/`PRIVATE_NET` subnets, `REGISTRY_DIR` records), the setup error
(`EmulatorError`), `run_cmd` (a host command that raises it) and the checks of the host
(`environment_problem`, `nat_problem`). The emulator itself is `wan.emulator`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

FAMILY = "pdw"  # every run's prefix starts with this; `cleanup --prefix pdw` removes all runs
REGISTRY_DIR = Path("/run/p2p-diloco-wan")
PUBLIC_NET = "10.0"
PRIVATE_NET = "192.168"
MAX_PEERS = 250
KILL_GRACE_S = 2.0


class EmulatorError(RuntimeError):
    """A setup command failed; the message names the command and its stderr."""


@dataclass(frozen=True)
class LinkSpec:
    """One peer's access link: one-way delay each way (ms) and rate each way (Mbit/s, None = unlimited)."""

    delay_ms: float = 0.0
    rate_mbit: float | None = None
    queue_ms: float = 100.0  # tbf queue length in time at the link rate

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or (self.rate_mbit is not None and self.rate_mbit <= 0) or self.queue_ms <= 0:
            raise ValueError(f"bad link {self}: delay must be >= 0, rate and queue > 0")


@dataclass(frozen=True)
class PeerSpec:
    name: str
    link: LinkSpec = field(default_factory=LinkSpec)
    nat: bool = False

    def __post_init__(self) -> None:
        if not self.name.replace("-", "").isalnum() or len(self.name) > 20 or self.name == "router":
            raise ValueError(
                f"peer name must be alphanumeric (dashes allowed), <= 20 chars, not 'router': {self.name!r}"
            )


def new_prefix() -> str:
    return FAMILY + secrets.token_hex(3)


def run_cmd(
    argv: Sequence[str], *, check: bool = True, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise EmulatorError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def environment_problem() -> str | None:
    """Why the emulator cannot run here (None if it can): root, `ip`, `tc`, /dev/net/tun, `ip netns add`."""
    if os.geteuid() != 0:
        return "the WAN emulator needs root (network namespaces, veth, tc, TUN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (no TUN support)"
    probe = f"{FAMILY}probe{os.getpid()}"
    created = run_cmd(["ip", "netns", "add", probe], check=False)
    if created.returncode != 0:
        return f"`ip netns add` fails here: {created.stderr.strip()}"
    run_cmd(["ip", "netns", "delete", probe], check=False)
    return None


def nat_problem() -> str | None:
    """Why NAT peers cannot be emulated here (None if they can)."""
    if shutil.which("iptables") is None:
        return "`iptables` is not installed (Debian/Ubuntu package: iptables)"
    return None


# ---- cleanup (module level: also used for runs whose owner died) ------------------------------------
