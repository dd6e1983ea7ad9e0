"""The training thread lowers only its own priority (node/priority.py)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from p2p_diloco.node.priority import lower_this_thread, run_lowered


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux only")
def test_lowering_the_training_thread_leaves_the_other_threads_alone():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int | None] = {}

    def trainer() -> None:
        seen["new"] = lower_this_thread(5)
        seen["now"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=trainer)
    thread.start()
    thread.join()
    assert seen["new"] == seen["now"] == min(19, before + 5)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # this thread unchanged
    assert lower_this_thread(0) is None
    with pytest.raises(ValueError, match="only lower"):
        lower_this_thread(-1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux only")
def test_work_run_lowered_returns_its_result_or_raises_and_leaves_the_caller_alone():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = run_lowered(10, lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert seen == min(19, before + 10)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before

    def fails() -> None:
        raise KeyError("no such module")

    with pytest.raises(KeyError, match="no such module"):
        run_lowered(10, fails)
