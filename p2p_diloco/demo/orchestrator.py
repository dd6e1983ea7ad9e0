"""Runs one system of the demo as real processes on 127.0.0.1 and executes the chaos schedule.

`SwarmRun` (the processes: `demo.workers.Workers`) starts a bootstrap node and N workers, waits until
every worker is up (its ``start`` event), then runs for `schedule.duration` seconds: SIGKILLs victims at
the scheduled times (the current synchronizer for ``kill_sync``, found from the peers'
``published``/``progress`` events), restarts them with the same identity and state directory after
their down time, evaluates the newest saved global model now and then, and feeds the live view. At the
end it stops every worker with SIGTERM (they persist), evaluates the final global model and returns the
raw material of the report (`RunRecord`). A long schedule (``--chaos-every``) is executed by
`demo.faults.FaultInjector` instead (also SIGSTOPs and bootstrap restarts), and its end of run (replica
agreement, stop all, restart, resume) is `demo.endgame`; its findings go to `RunRecord.checks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.demo.chaos import KILL_SYNC, Fault, Schedule
from p2p_diloco.demo.endgame import finish_long_run
from p2p_diloco.demo.faults import FaultInjector
from p2p_diloco.demo.slots import Slot
from p2p_diloco.demo.workers import DECOUPLED, Workers, stop_slots


@dataclass
class RunRecord:
    system: str
    learners: int
    start: float
    end: float
    events: dict[str, list[dict[str, Any]]]
    marks: dict[str, list[tuple[float, str]]]
    kills: list[dict[str, Any]]
    eval_curve: list[tuple[float, float, float]]  # (seconds since start, tokens so far, eval loss)
    final_eval_loss: float | None
    peer_ids: dict[str, str]
    checks: dict[str, Any] | None = None  # the long chaos mode's end-of-run findings (demo.endgame)


class SwarmRun(Workers):
    """One system's timed run with its schedule (module docstring)."""

    def __init__(
        self,
        system: str,
        manifest_path: Path,
        learners: int,
        schedule: Schedule,
        workdir: Path,
        *,
        on_tick: Callable[[SwarmRun], None] | None = None,
        eval_every: float = 20.0,
        hot_spares: bool = False,
    ):
        super().__init__(system, manifest_path, learners, schedule, workdir, hot_spares=hot_spares)
        self.on_tick = on_tick
        self.eval_every = eval_every
        self.eval_curve: list[tuple[float, float, float]] = []
        self.pending: list[Fault] = sorted(schedule.faults, key=lambda f: f.at)
        self.injector: FaultInjector | None = FaultInjector(self) if schedule.every > 0 else None

    def _apply_faults(self, now: float) -> None:
        if self.injector is not None:
            self.injector.apply(now)
            return
        while self.pending and now - self.start_time >= self.pending[0].at:
            fault = self.pending.pop(0)
            victim: Slot | None = None
            why = "scheduled learner"
            if fault.action == KILL_SYNC and self.system == DECOUPLED:
                victim, why = self.current_synchronizer(), "the current synchronizer"
            if victim is None:
                victim = self.live_slot_from(fault.learner)
                why = why if fault.action != KILL_SYNC else "fallback for the synchronizer (none seen)"
            if victim is None:
                self.kills.append({"t": now - self.start_time, "action": fault.action, "skipped": "all down"})
                continue
            self.kill(victim, now, fault, why)
        for slot in self.slots:
            if slot.restart_at is not None and now >= slot.restart_at:
                slot.restart_at = None
                self.launch(slot, now)

    # ---- the run -----------------------------------------------------------------------------------

    def run(self) -> RunRecord:
        self.workdir.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(1)
        try:
            return self._run()
        finally:
            self.kill_all()

    def _run(self) -> RunRecord:
        self.start_bootstrap()
        self.start_slots()
        self.saved.load()  # model and eval text now, not in the middle of the timed run
        self.wait_until_up()
        self.start_time = time.time()
        if self.hot_spares:  # prepared while the swarm runs, as a volunteer's would be
            for slot in self.slots:
                self.prepare_spare(slot)
        end = self.start_time + self.schedule.duration
        next_eval = self.start_time + self.eval_every
        while (now := time.time()) < end:
            self.poll_events(now)
            self._apply_faults(now)
            if now >= next_eval:
                next_eval = now + self.eval_every
                loss = self.evaluate_saved()
                if loss is not None:
                    self.eval_curve.append((now - self.start_time, self.tokens_so_far(now), loss))
            if self.on_tick is not None:
                self.on_tick(self)
            time.sleep(0.25)
        checks = None
        if self.injector is not None:
            checks = finish_long_run(
                self, self.injector
            )  # agreement, stop all, final eval inside, restart, resume
            final = checks.pop("final_eval_loss")
        else:
            stop_slots(self.slots)
            final = self.evaluate_saved()
        if final is not None:
            self.eval_curve.append((end - self.start_time, self.tokens_so_far(end), final))
        for slot in self.slots:
            slot.tail.poll()
        return RunRecord(
            system=self.system,
            learners=self.learners,
            start=self.start_time,
            end=end,
            events={s.name: s.tail.events for s in self.slots},
            marks={s.name: s.marks for s in self.slots},
            kills=self.kills,
            eval_curve=self.eval_curve,
            final_eval_loss=final,
            peer_ids={s.name: s.peer_id for s in self.slots},
            checks=checks,
        )
