"""Getting rid of emulations: the cleanup of runs by prefix (also of runs whose owner died) and the
teardown of this process's live emulators at interpreter exit and on SIGTERM/SIGINT.

`cleanup(prefix)` kills every process in the run's namespaces and deletes them and their registry
files; `cleanup_stale()` does so for every run whose owning process (per its `REGISTRY_DIR` record) is
gone. `LIVE` lists the emulators this process started and still owns; `install_handlers` makes exit and
the signals tear them down.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, Protocol

from p2p_diloco.wan.spec import FAMILY, KILL_GRACE_S, REGISTRY_DIR, run_cmd


def list_namespaces(prefix: str) -> list[str]:
    out = run_cmd(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]


def namespace_pids(namespace: str) -> list[int]:
    out = run_cmd(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _kill_pids(pids: Sequence[int], grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after `grace_s`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if pid_alive(pid)]
        if alive:
            time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def cleanup(prefix: str) -> list[str]:
    """Kill every process in namespaces named `prefix`*, delete them and their registry files."""
    if len(prefix) < len(FAMILY) or not prefix.startswith(FAMILY):
        raise ValueError(
            f"refusing to clean up namespaces with prefix {prefix!r}: it must start with {FAMILY!r}"
        )
    namespaces = list_namespaces(prefix)
    pids = sorted({pid for ns in namespaces for pid in namespace_pids(ns)})
    _kill_pids(pids)
    for ns in namespaces:
        run_cmd(["ip", "netns", "delete", ns], check=False)
    if REGISTRY_DIR.is_dir():
        for file in REGISTRY_DIR.glob(f"{prefix}*"):
            file.unlink(missing_ok=True)
    return namespaces


def cleanup_stale() -> list[str]:
    """Remove runs whose owning process is gone (and family namespaces without any registry record)."""
    removed: list[str] = []
    live_prefixes: set[str] = set()
    if REGISTRY_DIR.is_dir():
        for record_file in REGISTRY_DIR.glob(f"{FAMILY}*.json"):
            try:
                record = json.loads(record_file.read_text())
                prefix, pid, ticks = record["prefix"], int(record["owner_pid"]), record["owner_start"]
            except (OSError, ValueError, KeyError):
                continue
            if pid_alive(pid) and start_ticks(pid) == ticks:
                live_prefixes.add(prefix)
            else:
                removed += cleanup(prefix)
    orphans = [ns for ns in list_namespaces(FAMILY) if not any(ns.startswith(p) for p in live_prefixes)]
    for ns in orphans:
        removed += cleanup(ns.split("-", 1)[0])
    return sorted(set(removed))


# ---- teardown on exit and signals --------------------------------------------------------------------


class TearsDown(Protocol):
    """What `LIVE` holds: an emulator (`wan.emulator.WanEmulator`) that can remove what it set up."""

    def teardown(self) -> None: ...


LIVE: list[TearsDown] = []
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_MAIN_PID = os.getpid()


def _teardown_all() -> None:
    for emulator in list(LIVE):
        emulator.teardown()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if os.getpid() == _MAIN_PID:
        _teardown_all()
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_handlers() -> None:
    if _PREVIOUS_HANDLERS or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        _PREVIOUS_HANDLERS[sig] = signal.signal(sig, _on_signal)
    atexit.register(_teardown_all)
