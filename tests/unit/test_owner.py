"""One owner per piece of state (`p2p_diloco.owner`): the objects a `join` process shares between threads
are changed on their owning thread only; other threads post to it or read immutable snapshots."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from p2p_diloco.net.traffic import TrafficBook
from p2p_diloco.node.evaluation import EvalMode, EvalOptions, GlobalEvaluator
from p2p_diloco.node.events import GoodputCounters
from p2p_diloco.node.guard import REJECT_NOT_READY, HandlerSlot
from p2p_diloco.node.reporting import Telemetry
from p2p_diloco.node.threads import ThreadedDriver
from p2p_diloco.node.training import TrainingLoop, TrainingView
from p2p_diloco.owner import Owner, WrongThread, checks_on, set_checks
from p2p_diloco.swarm import effects as fx
from tests.support.manifests import tiny_manifest
from tests.support.peers import AnsweringPeer

WAIT = 10.0
REPO = Path(__file__).resolve().parents[2]


def on_thread(fn: Callable[[], object], name: str = "intruder") -> BaseException | None:
    """Run `fn` on a new thread; the exception it raised, if any."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            raised.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive()
    return raised[0] if raised else None


def test_the_test_suite_runs_with_checks_on_also_in_the_processes_it_starts():
    assert checks_on()
    probe = "from p2p_diloco.owner import checks_on; print(checks_on())"
    started = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert started.stdout.strip() == "True", started.stderr[-2000:]


def test_an_owner_is_the_constructing_thread_until_another_takes_it():
    owner = Owner("peer-owner")
    owner.check("x")  # the constructing thread
    error = on_thread(lambda: owner.check("the peer"), name="p2p-transport")
    assert isinstance(error, WrongThread) and "peer-owner" in str(error) and "p2p-transport" in str(error)
    assert on_thread(lambda: (owner.take(), owner.check("x"))) is None  # handed over, then checked there
    with pytest.raises(WrongThread):
        owner.check("x")  # the constructing thread no longer owns it
    previous = set_checks(False)
    try:
        owner.check("x")  # checks off: nothing is checked
    finally:
        set_checks(previous)


def test_node_state_changed_off_its_owner_thread_fails():
    owner = Owner("peer-owner")
    telemetry, counters = Telemetry(owner), GoodputCounters(owner)
    evaluator = GlobalEvaluator(
        tiny_manifest("owner-unit"), EvalOptions(), peer_id="QmA", ledger=None, owner=owner
    )
    peer = SimpleNamespace(sync=None, term_seen=0)
    changes = {
        "Telemetry": lambda: telemetry.heartbeat_fields(1.0, peer, TrainingView(), None, None),
        "GoodputCounters": lambda: counters.fields(TrainingView(), peer, None),
        "GlobalEvaluator": lambda: evaluator.finish(None, None),  # type: ignore[arg-type]
    }
    for what, change in changes.items():
        error = on_thread(change)
        assert isinstance(error, WrongThread) and what in str(error), (what, error)
    assert counters.fields(TrainingView(), peer, None)["bytes_sent"] == 0  # fine on the owner


def test_transport_counts_change_on_the_loop_thread_and_are_read_as_immutable_snapshots():
    book = TrafficBook()
    book.moved(sent=10, received=3)
    book.rejected("busy")
    before = book.counts
    book.moved(sent=5)
    book.served("delta")
    assert (before.bytes_sent, before.rejected["busy"], before.served["delta"]) == (10, 1, 0)  # unchanged
    assert (book.counts.bytes_sent, book.counts.bytes_received, book.counts.served["delta"]) == (15, 3, 1)
    with pytest.raises(TypeError):
        book.counts.rejected["busy"] = 0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        book.counts.bytes_sent = 0  # type: ignore[misc]
    assert isinstance(on_thread(lambda: book.moved(sent=1)), WrongThread)
    assert book.counts.bytes_sent == 15


def test_the_handler_slot_counts_refusals_on_the_transport_thread_only():
    slot = HandlerSlot()  # owned by its constructing thread until a transport's loop takes the owner
    assert slot.handle_delta("QmA", b"x").tag == REJECT_NOT_READY
    error = on_thread(lambda: slot.handle_delta("QmA", b"x"), name="peer-owner")
    assert isinstance(error, WrongThread) and "p2p-transport" in str(error)
    assert slot.rejections == {REJECT_NOT_READY: 1}
    with pytest.raises(TypeError):
        slot.rejections[REJECT_NOT_READY] = 0  # type: ignore[index]


def test_the_driver_takes_the_peer_to_its_owner_thread_and_reports_io_errors_there():
    errors: list[tuple[str, str]] = []
    reported = threading.Event()

    def on_error(what: str, exc: BaseException) -> None:
        errors.append((what, threading.current_thread().name))
        reported.set()

    clock = SimpleNamespace(now=lambda: 5.0)
    driver = ThreadedDriver(
        AnsweringPeer(), kv=None, transport=None, clock=clock, bind=False, on_error=on_error
    )
    driver.start()
    try:
        answer: concurrent.futures.Future = concurrent.futures.Future()
        delta = fx.DeltaArrived("QmB", b"x", answer, 5.0)
        with pytest.raises(WrongThread, match="peer-owner"):
            driver.process(delta)  # the test's thread no longer owns the peer
        driver.post(delta)  # posted: handled on the owner thread
        assert answer.result(WAIT).ok
        assert driver.call(lambda: driver.accepts.count, timeout=WAIT) == 1
        assert isinstance(on_thread(lambda: driver.accepts.note(3, 1.0)), WrongThread)

        def fail() -> None:
            raise TimeoutError("dht")

        driver.run_io(fail, None)
        assert reported.wait(WAIT)
        assert errors == [("dht", "peer-owner")]  # raised on the I/O thread, counted on the owner thread
    finally:
        driver.stop(timeout=WAIT)


def test_one_evaluation_at_a_time_and_a_failed_one_frees_the_next():
    evaluator = GlobalEvaluator(
        tiny_manifest("owner-unit"), EvalOptions(mode=EvalMode.ALWAYS), peer_id="QmA", ledger=None
    )
    evaluator.refreshed = True
    frozen = lambda: ({}, (0, 0))  # noqa: E731
    ask = lambda: evaluator.ask(10.0, versions=(0, 0), holds_lease=False, term=1, frozen=frozen)  # noqa: E731
    request = ask()
    assert request is not None and request.versions == (0, 0) and request.term == 1
    assert ask() is None  # the training thread has not answered yet
    assert evaluator.finish(request, None) is None and evaluator.history == ()  # it failed
    again = ask()
    assert again is not None
    point = evaluator.finish(again, 4.0)
    assert point is not None and evaluator.history == (point,) and evaluator.evaluations == 1


class CountingLearner:
    """What `TrainingLoop` uses of a `Learner`: steps that count, a delta due at step 2."""

    def __init__(self) -> None:
        self.step, self.tokens_trained, self.last_loss = 0, 0, float("nan")
        self.steps_merged = self.compute_seconds = self.compute_merged = 0.0
        self.deltas_sent = self.deltas_rejected = self.settled = 0

    def train_step(self, compute_seconds: float | None = None) -> None:
        self.step, self.tokens_trained, self.last_loss = (
            self.step + 1,
            self.tokens_trained + 16,
            5.0 - self.step,
        )

    def take_due(self, now: float, gate: object) -> tuple[str, int] | None:
        return ("delta", self.step) if self.step == 2 and gate == "open" else None

    def settle(self) -> None:
        self.settled += 1


def test_the_training_loop_publishes_a_frozen_view_that_only_its_thread_replaces():
    posted, events, views = [], [], []
    stop = threading.Event()
    options = SimpleNamespace(train_nice=0, min_step_time=0.0, max_steps=3)

    def after_step() -> None:  # the loop's own thread, between steps
        views.append(loop.view)
        if not loop.view.training:
            stop.set()

    loop = TrainingLoop(
        options,  # type: ignore[arg-type]
        CountingLearner(),  # type: ignore[arg-type]
        gate=lambda: "open",
        post=posted.append,
        clock=SimpleNamespace(now=lambda: 7.0),
        stop=stop,
        finish_training=threading.Event(),
        tokens_per_step=16,
        after_step=after_step,
        event=lambda kind, **fields: events.append((kind, fields["step"])),
    )
    assert on_thread(loop.run, name="MainThread-like") is None
    assert posted == [("delta", 2)]  # the due delta went to the owner thread's queue
    assert [v.step for v in views] == [1, 2, 3, 3] and all(v.training for v in views[:3])
    final = loop.view
    assert (final.training, final.step, final.tokens, final.loss, final.tokens_per_s) == (
        False,
        3,
        48,
        3.0,
        0.0,
    )
    assert events == [("training_stopped", 3)] and final.loop_started > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        final.step = 0  # type: ignore[misc]
    with pytest.raises(WrongThread, match="training"):
        loop._publish()  # the test's thread is not the one that ran the loop
