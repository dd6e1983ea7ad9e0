"""Which thread may change an object: `Owner`, checked on every change while checks are on.

A `join` process shares no mutable state between its threads (`docs/architecture.md` lists them): each
object with changing state has one owning thread, other threads post events to it or read immutable
snapshots it publishes (a frozen value replaced whole, so one attribute read sees all of one version).
`Owner` records the owning thread: the thread that constructed it, until the thread it is handed to
calls `take` (an owner loop does so when it starts). Owned objects call `check` before each change;
with checks on it raises `WrongThread` on any other thread. Checks are on where the environment sets
``P2P_DILOCO_CHECK_OWNERS=1`` (the test suite does, also for the processes it starts) or after
`set_checks(True)`; off, `check` costs one global read.
"""

from __future__ import annotations

import os
import threading

CHECK_ENV = "P2P_DILOCO_CHECK_OWNERS"

_checks = os.environ.get(CHECK_ENV) == "1"


class WrongThread(AssertionError):
    """An owned object was changed on a thread that does not own it (a bug)."""


def set_checks(on: bool) -> bool:
    """Turn ownership checks on or off for this process; returns the previous setting."""
    global _checks
    previous, _checks = _checks, on
    return previous


def checks_on() -> bool:
    return _checks


class Owner:
    """The one thread that may change the objects holding this `Owner` (module docstring)."""

    def __init__(self, role: str):
        self.role = role  # what the owning thread is, for messages ("peer-owner", "training", ...)
        self._thread = threading.current_thread()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def take(self) -> None:
        """The calling thread owns the objects from now on (an owner loop's first call)."""
        self._thread = threading.current_thread()

    def owns(self) -> bool:
        return threading.current_thread() is self._thread

    def check(self, what: str) -> None:
        """Raise `WrongThread` if checks are on and the calling thread is not the owner."""
        if _checks and threading.current_thread() is not self._thread:
            raise WrongThread(
                f"{what} belongs to the {self.role} thread ({self._thread.name}), "
                f"changed on {threading.current_thread().name}"
            )
