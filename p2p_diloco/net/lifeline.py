"""Helper processes that die with the peer: a parent-death signal for the hivemind DHT process.

hivemind forks its DHT node (`hivemind.DHT` is a fork `multiprocessing` process) and cleans it up from the
parent's exit handlers, which a SIGKILL (the OOM killer, `kill -9`, a crashed machine's supervisor) never
runs. The orphaned DHT process then keeps the peer's identity announced and, since it inherited the
state directory's lock, refuses every restart of the peer ("--state-dir ... is in use"). Forks made
inside `dies_with_parent()` by the calling thread ask Linux for SIGKILL when that thread's process ends
(``prctl(PR_SET_PDEATHSIG)``); its p2pd then loses its client and exits on its own.

Only forks of the thread that entered the block are marked: the kernel sends the signal when the
*forking thread* ends, so a fork from a short-lived worker thread must not get it. Elsewhere than
Linux this is a no-op (`supported()` says so).

The commands that run a DHT node stop on SIGINT/SIGTERM through `install_stop_handlers` (they set a
stop event in this process only: a forked child such as the DHT gets the default action back) and put
the old handlers back with `restore_handlers`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_armed: dict[int, int] = {}  # forking thread ident -> pid the child must outlive (its parent)
_lock = threading.Lock()
_hook_installed = False

Handler = Callable[[int, FrameType | None], Any] | int | None  # what `signal.signal` returns


def supported() -> bool:
    return sys.platform.startswith("linux")


def _set_parent_death_signal(sig: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _in_child() -> None:
    """After a fork, in the child (the forking thread is its only thread)."""
    parent = _armed.get(threading.get_ident())
    _armed.clear()  # the child's own forks are not marked unless it asks
    if parent is None:
        return
    if _set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent:
        os._exit(1)  # the parent died between the fork and the prctl: the signal will never come


def _install_hook() -> None:
    global _hook_installed
    with _lock:
        if not _hook_installed:
            os.register_at_fork(after_in_child=_in_child)
            _hook_installed = True


@contextmanager
def dies_with_parent() -> Iterator[None]:
    """Processes this thread forks inside the block get SIGKILL when this process ends (Linux)."""
    if not supported():
        yield
        return
    _install_hook()
    me = threading.get_ident()
    _armed[me] = os.getpid()
    try:
        yield
    finally:
        _armed.pop(me, None)


def install_stop_handlers(stop: threading.Event) -> dict[int, Handler]:
    """SIGINT/SIGTERM set `stop` in this process; forked children (the DHT) get the default action back.

    The DHT process is forked after this and inherits Python-level handlers; without the pid check it
    would swallow the SIGTERM that hivemind uses as its last resort to stop it.
    """
    main_pid = os.getpid()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stop.set()

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore_handlers(previous: Mapping[int, Handler]) -> None:
    """Put back the handlers `install_stop_handlers` (and any added to its dict) replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)
