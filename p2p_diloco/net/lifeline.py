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

When the peer runs in its terminal's foreground process group (`in_terminal_foreground`), such a fork
also moves into a process group of its own, which the p2pd it starts joins: a Ctrl-C there sends
SIGINT to every process of the foreground group, and p2pd (started by libuv with every signal reset to
its default action) used to die on it before the peer's orderly shutdown, which then could not release
its lease to the swarm, and logged `use of closed network connection` and hivemind's "did not shut down
within the grace period". The peer alone gets the terminal's signals and stops its helpers in order.
Peers started by scripts without a terminal (their own session, as the tests and the demo do) keep their
helpers in their group, so killing the group still takes the DHT process and p2pd along.

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

# forking thread ident -> (pid the child must outlive (its parent), whether the child leaves the group)
_armed: dict[int, tuple[int, bool]] = {}
_lock = threading.Lock()
_hook_installed = False

Handler = Callable[[int, FrameType | None], Any] | int | None  # what `signal.signal` returns


def supported() -> bool:
    return sys.platform.startswith("linux")


def _set_parent_death_signal(sig: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def in_terminal_foreground() -> bool:
    """Whether this process's group is the foreground group of a controlling terminal (whose Ctrl-C
    sends SIGINT to every process in the group)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _leave_terminal_group() -> None:
    """In the child: a process group of its own, in the same session (out of reach of the terminal's
    SIGINT, SIGQUIT and SIGTSTP); SIGTTOU ignored so that its log lines still reach the terminal from the
    background when the terminal has `stty tostop`."""
    try:
        os.setpgid(0, 0)
    except OSError:
        return
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)


def _in_child() -> None:
    """After a fork, in the child (the forking thread is its only thread)."""
    armed = _armed.get(threading.get_ident())
    _armed.clear()  # the child's own forks are not marked unless it asks
    if armed is None:
        return
    parent, leave_group = armed
    if _set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent:
        os._exit(1)  # the parent died between the fork and the prctl: the signal will never come
    if leave_group:
        _leave_terminal_group()


def _install_hook() -> None:
    global _hook_installed
    with _lock:
        if not _hook_installed:
            os.register_at_fork(after_in_child=_in_child)
            _hook_installed = True


@contextmanager
def dies_with_parent() -> Iterator[None]:
    """Processes this thread forks inside the block get SIGKILL when this process ends (Linux), and a
    process group of their own when this process runs in its terminal's foreground group."""
    if not supported():
        yield
        return
    _install_hook()
    me = threading.get_ident()
    _armed[me] = (os.getpid(), in_terminal_foreground())
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
