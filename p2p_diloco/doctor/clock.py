"""`doctor`'s clock line: this clock against the peers' (estimated by `node.clock_offset` from when their
heartbeats appear in the DHT), judged against `timing.lease_margin`, the disagreement leases tolerate
(`protocol.election`: a holder stops at its lease's expiry less the margin, claimants wait until the expiry
plus it). Fail when the offset surely exceeds the margin, warn above half of it, ok below; a line that
says why when nothing could be compared (no manifest, no answering peer, no heartbeat).
"""

from __future__ import annotations

import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from p2p_diloco.doctor.checks import Check, Status
from p2p_diloco.errors import ConfigError
from p2p_diloco.node.clock_offset import ClockOffset, estimate_offset, read_heartbeats
from p2p_diloco.protocol.timing import SwarmTiming


def unclocked(why: str, fix: str) -> Check:
    return Check("clock", Status.WARN, f"not compared: {why}", fix)


def check_clock(estimate: ClockOffset | None, timing: SwarmTiming, window: float) -> Check:
    """Verdict on this clock's offset: fail when it surely exceeds `lease_margin` (a claimant and a holder
    may then both act on one lease), warn above half of it, ok below."""
    margin = timing.lease_margin
    if estimate is None:
        why = f"no peer's heartbeat read in {window:.0f} s (no peer trains yet, or this clock is more than "
        why += f"timing.heartbeat_ttl = {timing.heartbeat_ttl:g} s ahead of theirs)"
        return unclocked(
            why, "run doctor again while peers train; meanwhile compare `date -u` with a time server"
        )
    size = abs(estimate.offset)
    side = "ahead of" if estimate.offset > 0 else "behind"
    plural = "s" if estimate.peers != 1 else ""
    detail = (
        f"{size:.2f} s {side} the peers' (± {estimate.uncertainty:.2f} s, "
        f"median of {estimate.peers} peer{plural})"
    )
    if estimate.spread > margin:
        detail += f"; the peers disagree among themselves by {estimate.spread:.2f} s"
    fix = (
        "synchronize this clock with NTP (`timedatectl set-ntp true`, or chrony); "
        f"leases tolerate {margin:g} s"
    )
    if size - estimate.uncertainty > margin:
        return Check("clock", Status.FAIL, f"{detail}: beyond timing.lease_margin {margin:g} s", fix)
    if size > margin / 2:
        return Check("clock", Status.WARN, f"{detail}: near timing.lease_margin {margin:g} s", fix)
    return Check("clock", Status.OK, detail)


def measure_clock(manifest: Any, peers: list[str], answered: bool, timeout: float) -> Check:
    """Join the DHT as a client through `peers` and time the run's heartbeats for a few periods."""
    from hivemind.utils.timed_storage import get_dht_time

    from p2p_diloco.net.dht_store import DhtKeyValueStore, create_dht
    from p2p_diloco.wire.keys import heartbeat_key

    if manifest is None:
        return unclocked(
            "the run's heartbeats need its manifest", "p2p-diloco doctor RUN.toml --initial-peers ..."
        )
    if not answered:
        return unclocked("no initial peer answers", "pass --initial-peers of a live bootstrap node or peer")
    timing = manifest.timing
    window = max(3 * timing.heartbeat_period, 2.0)
    try:
        dht_peer = create_dht(initial_peers=peers, client_mode=True)
    except (ConnectionError, ConfigError) as exc:
        return unclocked(f"cannot join the DHT: {exc}", "check the initial peers")
    try:
        kv = DhtKeyValueStore(dht_peer, timeout=timeout)
        key = heartbeat_key(manifest.run_id, manifest.manifest_hash)
        interval = min(0.25, timing.heartbeat_period / 4)
        reads = read_heartbeats(
            kv, key, clock=get_dht_time, sleep=time.sleep, window=window, interval=interval
        )
    except TimeoutError as exc:
        return unclocked(str(exc), "check the initial peers")
    finally:
        dht_peer.shutdown()
    return check_clock(estimate_offset(reads, timing.heartbeat_ttl, timing.heartbeat_period), timing, window)


def ntp_synchronized() -> bool | None:
    """Whether systemd says NTP keeps this clock (None: it cannot say, e.g. no systemd here)."""
    if Path("/run/systemd/timesync/synchronized").exists():
        return True
    try:
        answer = subprocess.run(
            ["timedatectl", "show", "--property=NTPSynchronized", "--value"],
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"yes": True, "no": False}.get(answer.stdout.strip()) if answer.returncode == 0 else None


def system_clock(synced: bool | None = None) -> Check:
    """The clock without a run (no peers' heartbeats to compare with): the time and whether NTP keeps it."""
    synced = ntp_synchronized() if synced is None else synced
    now = f"reads {datetime.now(UTC).isoformat(timespec='seconds')}"
    compare = "p2p-diloco doctor RUN.toml --initial-peers ... compares it with the peers'"
    if synced:
        return Check("clock", Status.OK, f"{now}, kept by NTP")
    if synced is False:
        return Check(
            "clock",
            Status.WARN,
            f"{now}, not kept by NTP",
            f"timedatectl set-ntp true (or chrony); {compare}",
        )
    return Check("clock", Status.WARN, f"{now}; whether NTP keeps it is unknown (no timedatectl)", compare)
