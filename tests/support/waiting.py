"""Waiting for a condition with a deadline: how the process tiers (integration, WAN, GPU) synchronize."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """Poll `predicate` until it returns something truthy (returned) or `timeout` s pass (`TimeoutError`
    naming `what`)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(interval)
