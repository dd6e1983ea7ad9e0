"""A peer's tasks: work that needs answers from the network, written as generators.

A task yields a `Request` (`swarm.effects`) and is resumed with its result, so catch-up, repair and the
election's reads read top to bottom while the peer keeps handling other events. `Tasks` runs them on the
peer's owner thread: `spawn` runs a task until its first request, which goes out as a `Perform` intent;
the driver performs it and posts a `TaskResult`, which `resume` hands back to the task. A task that raises
ends (its completion callback gets None) and the peer goes on. A task that yields `Together(subtasks)`
waits here, without the driver, while its subtasks run side by side; it resumes with their results.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from p2p_diloco.swarm.effects import Intent, Perform, Request, Task, Together
from p2p_diloco.swarm.journal import Journal


class Tasks:
    def __init__(self, emit: Callable[[Intent], None], journal: Journal):
        self._emit = emit
        self.journal = journal
        self._tasks: dict[int, tuple[Task, Callable[[Any], None]]] = {}
        self._ids = itertools.count(1)

    def spawn(self, task: Task, on_done: Callable[[Any], None] | None = None) -> None:
        """Run `task` until it first needs I/O; its requests go out as `Perform` intents."""
        task_id = next(self._ids)
        self._tasks[task_id] = (task, on_done or (lambda value: None))
        self._step(task_id, lambda: next(task))

    def resume(self, task_id: int, value: Any, error: BaseException | None) -> None:
        """Hand a request's result (or its error) back to the task that yielded it."""
        if task_id not in self._tasks:
            return
        task = self._tasks[task_id][0]
        self._step(task_id, (lambda: task.throw(error)) if error is not None else (lambda: task.send(value)))

    def _step(self, task_id: int, advance: Callable[[], Request]) -> None:
        try:
            request = advance()
        except StopIteration as done:
            _, on_done = self._tasks.pop(task_id)
            on_done(done.value)
            return
        except Exception as exc:  # a bug in a task: it ends (answering None), the peer goes on
            _, on_done = self._tasks.pop(task_id)
            self.journal.note(f"task failed: {type(exc).__name__}: {exc}")
            on_done(None)
            return
        if isinstance(request, Together):
            self._together(task_id, request.tasks)
        else:
            self._emit(Perform(task_id, request))

    def _together(self, task_id: int, subtasks: tuple[Task, ...]) -> None:
        """Spawn `subtasks`; when the last one ends, resume `task_id` with their results in order."""
        results: list[Any] = [None] * len(subtasks)
        left = [len(subtasks)]

        def finished(i: int, value: Any) -> None:
            results[i] = value
            left[0] -= 1
            if not left[0]:
                self.resume(task_id, results, None)

        if not subtasks:
            self.resume(task_id, results, None)
        for i, subtask in enumerate(subtasks):
            self.spawn(subtask, lambda value, i=i: finished(i, value))
