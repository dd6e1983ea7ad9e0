"""An asyncio event loop on virtual time, for unit tests of code whose deadlines are the loop's clock.

`run_virtual(coro)` runs `coro` like `asyncio.run`, on a `VirtualTimeLoop`: its clock starts at 0 and
moves only while every task waits, then straight to the next timer (an `asyncio.sleep`, a `wait_for`
deadline, a `call_later`). A test of "closed after 0.4 s" then takes no wall time and never depends on
how loaded the machine is. Only in-loop work is covered: a callback from another thread is seen at the
loop's next turn, and the clock may have jumped by then, so such tests keep real time.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Selector(selectors.DefaultSelector):
    """Never blocks: when nothing is ready it moves the loop's clock by the time the loop would wait."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if not ready and timeout:
            self._loop.now += timeout
        elif not ready and timeout is None:
            raise RuntimeError("every task waits and no timer is set: the test would hang")
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose `time()` is virtual (module docstring)."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_Selector(self))

    def time(self) -> float:
        return self.now


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` on a fresh `VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
