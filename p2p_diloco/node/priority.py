"""The training thread yields the CPU to the peer's control plane.

A peer's heartbeats, lease renewals, DHT reads and update pushes are tiny, but late ones cost the whole
swarm: a lease renewal that reaches the other peers after its old expiry makes them claim the next term
while the holder still merges, and a DHT node starved for seconds drops out of its neighbours' lookups
(the 30-minute chaos run on two shared cores showed both). So, where the system allows it per thread
(Linux), the training thread runs at a higher nice value than the owner, DHT I/O and transport threads
and the DHT and p2pd processes, which keep the priority they started with. Training only waits while
the control plane actually needs the CPU; on an idle core nothing changes, and on a GPU the inner steps
hardly use the CPU at all.

Threads and processes started by the training thread after the change inherit it (torch's intra-op
pool is created lazily by its first parallel op, normally on this thread).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MAX_NICE = 19


def lower_this_thread(niceness: int) -> int | None:
    """Add `niceness` to the calling thread's nice value (capped at 19); returns the new value, or None
    when `niceness` is 0 or this system cannot set one thread's priority (only Linux can)."""
    if niceness < 0:
        raise ValueError(f"niceness must be >= 0 (a thread may only lower its own priority), got {niceness}")
    if niceness == 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()  # on Linux PRIO_PROCESS with a thread ID sets that thread alone
    current = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, current + niceness))
    return os.getpriority(os.PRIO_PROCESS, tid)


def run_lowered(niceness: int, work: Callable[[], T], name: str = "lowered") -> T:
    """`work()` on a thread whose nice value is raised by `niceness`; its result, or its exception re-raised
    here. The calling thread keeps its priority (what a hot spare does before it may take over)."""
    results: list[T] = []
    failures: list[BaseException] = []

    def run() -> None:
        lower_this_thread(niceness)
        try:
            results.append(work())
        except BaseException as exc:  # handed to the caller's thread below
            failures.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]
    return results[0]
