"""`net.lifeline.install_stop_handlers`: SIGINT/SIGTERM set the stop event; `restore_handlers` undoes it."""

from __future__ import annotations

import os
import signal
import threading

from p2p_diloco.net.lifeline import install_stop_handlers, restore_handlers


def test_sigterm_and_sigint_set_the_stop_event_and_the_old_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in (signal.SIGTERM, signal.SIGINT):
        stop = threading.Event()
        previous = install_stop_handlers(stop)
        try:
            assert previous == before
            os.kill(os.getpid(), sig)  # Python runs the handler in this, the main, thread
            assert stop.wait(5.0)
        finally:
            restore_handlers(previous)
        assert {s: signal.getsignal(s) for s in before} == before
