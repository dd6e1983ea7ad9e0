"""The peer core's plumbing: tasks that fail, events it does not know, and the threaded driver's threads."""

from __future__ import annotations

import threading

import pytest

from p2p_diloco.node.threads import ThreadedDriver
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.memory import FakeClock, InMemoryKeyValueStore
from tests.support.manifests import tiny_manifest
from tests.support.peers import StubTransport, make_peer

MANIFEST = tiny_manifest("core")


def test_a_failing_task_ends_with_a_note_and_answers_none():
    peer = make_peer(MANIFEST, learner=False).peer
    done: list = []

    def broken():
        yield peer.membership.read_swarm()
        raise RuntimeError("bug in a task")

    peer.spawn(broken(), done.append)
    (perform,) = peer.flush()
    assert isinstance(perform, fx.Perform) and isinstance(perform.request, fx.ReadSwarm)
    peer.handle(fx.TaskResult(perform.task, fx.SwarmRecords({}, {}, 0.0)))
    assert done == [None]
    assert any("task failed: RuntimeError: bug in a task" in line for line in peer.journal.decisions)
    peer.handle(fx.TaskResult(perform.task, None))  # a late result of a finished task changes nothing


def test_an_unknown_event_is_a_type_error():
    with pytest.raises(TypeError, match="not a peer event"):
        make_peer(MANIFEST, learner=False).peer.handle("tick")  # type: ignore[arg-type]


def test_the_threaded_driver_handles_events_on_the_owner_thread_and_dht_calls_on_the_io_thread():
    peer = make_peer(MANIFEST, learner=False).peer
    seen: dict[str, set[str]] = {"observer": set(), "store": set(), "get": set()}

    class RecordingStore(InMemoryKeyValueStore):
        def store(self, *args):  # noqa: ANN002, ANN202
            seen["store"].add(threading.current_thread().name)
            return super().store(*args)

        def get(self, *args):  # noqa: ANN002, ANN202
            seen["get"].add(threading.current_thread().name)
            return super().get(*args)

    elected = threading.Event()  # the election runs once the swarm read came back as a TaskResult

    def observe(intent: fx.Intent) -> None:
        seen["observer"].add(threading.current_thread().name)
        if isinstance(intent, fx.Note) and intent.line.startswith("election:"):
            elected.set()

    driver = ThreadedDriver(
        peer, kv=RecordingStore(), transport=StubTransport(), clock=FakeClock(10.0), observer=observe
    )
    driver.start()
    try:
        driver.post(fx.Tick(fx.TickKind.SWARM, 10.0))
        assert driver.call(lambda: threading.current_thread().name, timeout=5) == "peer-owner"
        assert elected.wait(timeout=10)
        assert driver.call(lambda: peer.membership.last_read, timeout=5) == 10.0
    finally:
        driver.stop(timeout=5)
    assert seen["store"] == {"dht-io_0"} and seen["get"] == {"dht-io_0"}
    assert seen["observer"] == {"peer-owner"}
