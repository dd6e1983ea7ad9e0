"""Runs one system of the demo as real processes on 127.0.0.1 and executes the chaos schedule.

`SwarmRun` starts a bootstrap node and N worker processes (`p2p-diloco join`, or `p2p-diloco
baseline-worker` for the lock-step baseline, `baseline-worker --mode diloco` for synchronous DiLoCo), each in its own process group with a fresh key and state
directory under the work dir, waits until every worker is up (its ``start`` event), then runs for
`schedule.duration` seconds: SIGKILLs victims at the scheduled times (the current synchronizer for
``kill_sync``, found from the peers' ``published``/``progress`` events), restarts them with the same
identity and state directory after their down time, evaluates the newest saved global model now and
then, and feeds the live view. At the end it stops every worker with SIGTERM (they persist), evaluates
the final global model and returns the raw material of the report (`RunRecord`). A learner slot
(`Slot`, `EventTail`) is `demo.slots`; evaluating the saved global model is `demo.saved_models`.
A long schedule (``--chaos-every``) is executed by `demo.faults.FaultInjector` instead (also SIGSTOPs
and bootstrap restarts), and its end of run (replica agreement, stop all, restart, resume) is
`demo.endgame`; its findings go to `RunRecord.checks`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.demo.chaos import KILL_SYNC, Fault, Schedule
from p2p_diloco.demo.faults import FaultInjector
from p2p_diloco.demo.saved_models import SavedModels
from p2p_diloco.demo.slots import EventTail, Slot
from p2p_diloco.errors import ConfigError
from p2p_diloco.node.supervise import dismiss, tell_takeover

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 120.0  # imports, DHT and model on a loaded 2-core machine
STOP_TIMEOUT = 20.0
DECOUPLED, BASELINE, DILOCO = "decoupled", "baseline", "diloco"  # BASELINE: elastic data parallel


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", *args]


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


def dismiss_spare(slot: Slot) -> None:
    """End a slot's hot spare, if any (`node.supervise.dismiss`), with whatever it started."""
    spare, slot.spare = slot.spare, None
    if spare is not None:
        dismiss(spare)
        _killpg(spare, signal.SIGKILL)


def stop_slots(slots: list[Slot]) -> None:
    """SIGTERM every live worker together, wait up to `STOP_TIMEOUT` for all, then SIGKILL each group.
    Hot spares are dismissed first: a restart after this is a cold one."""
    for slot in slots:
        dismiss_spare(slot)
    now = time.time()
    for slot in slots:
        if slot.alive and slot.proc is not None:
            slot.proc.send_signal(signal.SIGTERM)
        slot.marks.append((now, "stop"))
    deadline = time.monotonic() + STOP_TIMEOUT
    for slot in slots:
        if slot.proc is None:
            continue
        try:
            slot.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _killpg(slot.proc, signal.SIGKILL)


def _killpg(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class SwarmRun:
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
        if system not in (DECOUPLED, BASELINE, DILOCO):
            raise ConfigError(f"unknown system {system!r}")
        self.hot_spares = hot_spares and system == DECOUPLED  # `join --standby` per slot (node.standby)
        self.system = system
        self.manifest_path = manifest_path
        self.manifest = RunManifest.load(manifest_path)
        self.learners = learners
        self.schedule = schedule
        self.workdir = workdir
        self.on_tick = on_tick
        self.eval_every = eval_every
        self.slots: list[Slot] = []
        self.bootstrap: subprocess.Popen | None = None
        self.bootstrap_addresses: list[str] = []
        self.kills: list[dict[str, Any]] = []
        self.eval_curve: list[tuple[float, float, float]] = []
        self.start_time = 0.0
        self.pending: list[Fault] = sorted(schedule.faults, key=lambda f: f.at)
        self.saved = SavedModels(self.manifest, baseline=system != DECOUPLED)  # both baselines: baseline.pt
        self.bootstrap_key = workdir / "bootstrap.key"
        self.injector: FaultInjector | None = FaultInjector(self) if schedule.every > 0 else None

    # ---- processes ---------------------------------------------------------------------------------

    def _spawn(self, cmd: list[str], log_path: Path, stdin: int | None = None) -> subprocess.Popen:
        with open(log_path, "a") as log:
            return subprocess.Popen(
                cmd,
                stdin=stdin,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # its own group: a kill takes its DHT child and p2pd too
            )

    def bootstrap_cmd(self, listen: list[str]) -> list[str]:
        # watching the run, it remembers its peers and the proof the run is under way across restarts (#31)
        state = str(self.workdir / "bootstrap-state")
        return python_cmd(
            "bootstrap", "--identity", str(self.bootstrap_key), "--listen", *listen,
            "--manifest", str(self.manifest_path), "--state-dir", state,
        )  # fmt: skip

    def _start_bootstrap(self) -> None:
        from p2p_diloco.net.identity import write_identity

        write_identity(self.bootstrap_key, force=True)
        log_path = self.workdir / "bootstrap.log"
        self.bootstrap = self._spawn(self.bootstrap_cmd([LOOPBACK]), log_path)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            lines = log_path.read_text(errors="replace").splitlines()
            found = [
                ln.removeprefix("bootstrap address: ").strip()
                for ln in lines
                if ln.startswith("bootstrap address: ")
            ]
            if found:
                self.bootstrap_addresses = found
                return
            if self.bootstrap.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the bootstrap node did not start; see {log_path}")

    def _worker_cmd(self, slot: Slot) -> list[str]:
        slow = self.schedule.slow_learner == slot.index and self.schedule.slow_step_time > 0
        pace = ["--min-step-time", str(self.schedule.slow_step_time)] if slow else []
        common = [
            str(self.manifest_path), "--initial-peers", *self.bootstrap_addresses, "--identity", str(slot.identity),
            "--state-dir", str(slot.state_dir), "--listen", LOOPBACK, "--progress-every", "1", *pace,
        ]  # fmt: skip
        if self.system == DECOUPLED:
            return python_cmd("join", *common, "--persist-every", "5")
        mode = ["--mode", "diloco"] if self.system == DILOCO else []
        return python_cmd(
            "baseline-worker", *common, "--learners", str(self.learners), "--checkpoint-every", "5", *mode
        )

    def _launch(self, slot: Slot, now: float) -> None:
        """Start the slot's worker: its hot spare takes over if it has a live one, else a cold process."""
        spare, slot.spare = slot.spare, None
        if spare is not None and tell_takeover(spare):
            slot.proc = spare
        else:
            _killpg(spare, signal.SIGKILL)  # a spare that died: whatever it started goes too
            slot.proc = self._spawn(self._worker_cmd(slot), slot.log_path)
        slot.launched_at = now
        slot.marks.append((now, "launch"))

    def _replace_spare(self, slot: Slot, now: float) -> None:
        """A slot whose worker is up again prepares its next spare (not while that worker starts, which
        it would slow down, nor for the end-of-run restarts)."""
        if (
            self.hot_spares
            and slot.spare is None
            and self.start_time < now < self.start_time + self.schedule.duration
        ):
            self._prepare_spare(slot)

    def _prepare_spare(self, slot: Slot) -> None:
        slot.spare = self._spawn([*self._worker_cmd(slot), "--standby"], slot.log_path, stdin=subprocess.PIPE)

    def _kill(self, slot: Slot, now: float, fault: Fault, why: str) -> None:
        # whatever the fault, was the victim the synchronizer? (the stall table counts every such kill)
        was_sync = why == "the current synchronizer" or (
            self.system == DECOUPLED and self.current_synchronizer() is slot
        )
        _killpg(slot.proc, signal.SIGKILL)
        if slot.proc is not None:
            slot.proc.wait(timeout=10)
        slot.marks.append((now, "kill"))
        slot.kills += 1
        slot.restart_at = now + fault.down
        self.kills.append(
            {"t": now - self.start_time, "learner": slot.name, "peer_id": slot.peer_id, "action": fault.action,
             "why": why, "down": fault.down, "synchronizer": was_sync}
        )  # fmt: skip

    # ---- observation -------------------------------------------------------------------------------

    def _poll_events(self, now: float) -> None:
        for slot in self.slots:
            for event in slot.tail.poll():
                kind = event.get("event")
                if kind == "progress":
                    slot.last_progress = event
                if kind in ("progress", "start") and slot.marks and slot.marks[-1][1] == "launch":
                    slot.marks.append((float(event.get("t") or now), "up"))
                    self._replace_spare(slot, now)

    def current_synchronizer(self) -> Slot | None:
        """The live slot that published most recently, else the one whose last progress says so."""
        by_id = {s.peer_id: s for s in self.slots if s.alive}
        latest: tuple[float, str] | None = None
        for slot in self.slots:
            for event in reversed(slot.tail.events[-400:]):
                if event.get("event") == "published":
                    t = float(event.get("t") or 0)
                    if latest is None or t > latest[0]:
                        latest = (t, str(event.get("leader")))
                    break
        if latest is not None and latest[1] in by_id and time.time() - latest[0] < 10:
            return by_id[latest[1]]
        for slot in by_id.values():
            if slot.last_progress.get("role") == "synchronizer":
                return slot
        return None

    def _live_slot_from(self, index: int) -> Slot | None:
        """Slot `index` if it is up (training), else the next one that is, else the next live one."""
        order = [self.slots[(index + k) % len(self.slots)] for k in range(len(self.slots))]
        live = [slot for slot in order if slot.alive and slot.restart_at is None]
        up = [slot for slot in live if slot.marks and slot.marks[-1][1] == "up"]
        return (up or live or [None])[0]

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
                victim = self._live_slot_from(fault.learner)
                why = why if fault.action != KILL_SYNC else "fallback for the synchronizer (none seen)"
            if victim is None:
                self.kills.append({"t": now - self.start_time, "action": fault.action, "skipped": "all down"})
                continue
            self._kill(victim, now, fault, why)
        for slot in self.slots:
            if slot.restart_at is not None and now >= slot.restart_at:
                slot.restart_at = None
                self._launch(slot, now)

    # ---- evaluation --------------------------------------------------------------------------------

    def _load_model(self) -> None:
        self.saved.load()

    def evaluate_saved(self) -> float | None:
        """Eval loss of the most advanced global model saved in any state directory (None if none)."""
        return self.saved.evaluate(slot.state_dir for slot in self.slots)

    def tokens_so_far(self, now: float) -> float:
        from p2p_diloco.demo.accounting import counters_in_window

        return sum(counters_in_window(s.tail.events, self.start_time, now)["tokens"] for s in self.slots)

    # ---- the run -----------------------------------------------------------------------------------

    def run(self) -> RunRecord:
        self.workdir.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(1)
        try:
            return self._run()
        finally:
            for slot in self.slots:
                _killpg(slot.proc, signal.SIGKILL)
                _killpg(slot.spare, signal.SIGKILL)
            _killpg(self.bootstrap, signal.SIGKILL)

    def _run(self) -> RunRecord:
        from p2p_diloco.net.identity import write_identity

        self._start_bootstrap()
        for i in range(self.learners):
            name = f"learner-{i}"
            key = self.workdir / f"{name}.key"
            state_dir = self.workdir / f"state-{name}"
            slot = Slot(
                index=i, name=name, identity=key, peer_id=write_identity(key, force=True), state_dir=state_dir,
                log_path=self.workdir / f"{name}.log", tail=EventTail(state_dir / "events.jsonl"),
            )  # fmt: skip
            self.slots.append(slot)
            self._launch(slot, time.time())
        self._load_model()  # model and eval text now, not in the middle of the timed run
        deadline = time.monotonic() + START_TIMEOUT
        while not all(any(m == "up" for _, m in s.marks) for s in self.slots):
            self._poll_events(time.time())
            dead = [s.name for s in self.slots if not s.alive]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"workers did not start ({dead or 'timeout'}); logs in {self.workdir}")
            time.sleep(0.2)
        self.start_time = time.time()
        if self.hot_spares:  # prepared while the swarm runs, as a volunteer's would be
            for slot in self.slots:
                self._prepare_spare(slot)
        end = self.start_time + self.schedule.duration
        next_eval = self.start_time + self.eval_every
        while (now := time.time()) < end:
            self._poll_events(now)
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
            from p2p_diloco.demo.endgame import finish_long_run

            checks = finish_long_run(self, end)  # agreement, stop all, final eval inside, restart, resume
            final = checks.pop("final_eval_loss")
        else:
            self._stop_all()
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

    def _stop_all(self) -> None:
        stop_slots(self.slots)
