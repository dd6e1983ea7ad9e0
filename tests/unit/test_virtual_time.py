"""`tests.support.virtual_time`: the loop's clock jumps to the next timer, and a loop with none says so."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.virtual_time import run_virtual


def test_sleeps_and_deadlines_take_virtual_time_only():
    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(5.0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100.0), 2.5)
        return loop.time()

    started = time.perf_counter()
    assert run_virtual(scenario()) == pytest.approx(7.5)
    assert time.perf_counter() - started < 5.0  # not the 7.5 s of real time it would take


def test_a_scenario_where_every_task_waits_without_a_timer_fails_instead_of_hanging():
    async def scenario() -> None:
        await asyncio.Event().wait()

    with pytest.raises(RuntimeError, match="no timer"):
        run_virtual(scenario())
