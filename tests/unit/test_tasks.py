"""A peer's tasks (swarm/tasks.py): requests go out as `Perform` intents and results come back in order;
`Together` runs subtasks side by side without the driver and resumes its task with their results."""

from __future__ import annotations

from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.tasks import Tasks


def world() -> tuple[Tasks, list[fx.Intent]]:
    emitted: list[fx.Intent] = []
    return Tasks(emitted.append, Journal("me", emitted.append)), emitted


def fetch(fragment: int):  # noqa: ANN201
    frames = yield fx.FetchUpdates("A", fragment, 0)
    return (fragment, frames)


def performs(emitted: list[fx.Intent]) -> list[fx.Perform]:
    return [i for i in emitted if isinstance(i, fx.Perform)]


def test_together_sends_every_subtasks_request_before_any_answer_and_keeps_their_order() -> None:
    tasks, emitted = world()
    done: list[object] = []

    def parent():  # noqa: ANN202
        results = yield fx.Together((fetch(0), fetch(1), fetch(2)))
        return results

    tasks.spawn(parent(), done.append)
    out = performs(emitted)
    assert [p.request.fragment for p in out] == [0, 1, 2]  # all three at once, none answered yet
    assert not done
    for perform in reversed(out):  # answers arrive in any order
        tasks.resume(perform.task, f"frames of {perform.request.fragment}", None)
    assert done == [[(0, "frames of 0"), (1, "frames of 1"), (2, "frames of 2")]]


def test_a_failed_subtask_gives_none_and_the_others_still_count() -> None:
    tasks, emitted = world()
    done: list[object] = []

    def parent():  # noqa: ANN202
        return (yield fx.Together((fetch(0), fetch(1))))

    tasks.spawn(parent(), done.append)
    first, second = performs(emitted)
    tasks.resume(first.task, None, ConnectionError("A is down"))
    assert not done
    tasks.resume(second.task, "frames", None)
    assert done == [[None, (1, "frames")]]
    assert any(isinstance(i, fx.Note) and "A is down" in i.line for i in emitted)


def test_together_of_nothing_or_of_tasks_without_io_resumes_at_once() -> None:
    tasks, emitted = world()
    done: list[object] = []

    def instant(value: int):  # noqa: ANN202
        return value
        yield  # a generator that needs no I/O

    def parent():  # noqa: ANN202
        empty = yield fx.Together(())
        quick = yield fx.Together((instant(1), instant(2)))
        return empty, quick

    tasks.spawn(parent(), done.append)
    assert done == [([], [1, 2])] and not performs(emitted)
