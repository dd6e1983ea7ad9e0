"""Executes the long chaos schedule (``demo --chaos-every``) on a running swarm (`demo.workers.Workers`).

`FaultInjector.apply(now)` is called every tick of the run. A due fault waits (stays pending) until it
can be done as a single fault, i.e. without leaving the swarm without the newest global state: a kill or
SIGSTOP needs another learner that is up (started, not stopped, not down) and current (its last
progress, at most `FRESH_SECONDS` old, at most one version behind the newest replica on each fragment;
a learner just continued from SIGSTOP is not, until it caught up). A SIGSTOP never picks the current
synchronizer (that is ``kill_sync``'s job); ``kill_bootstrap`` needs the bootstrap up. The fault log
(`SwarmRun.kills`) gets one row per executed fault (``action``, ``t``, victim, ``down``, ``delayed`` when it
waited) and ``{"skipped": ...}`` rows for faults still pending at the end (`finish`). A worker that exits on
its own (e.g. a restart that found the bootstrap down: its only initial peer) is logged in `exits` with the
last line of its log and relaunched after `RELAUNCH_SECONDS`, as a supervisor would.

The bootstrap node is SIGKILLed and restarted on the address it listened on (same port, same key, so
every peer's ``--initial-peers`` stays valid); its restart is watched without blocking the run
(``bootstrap_restarts``: when it was up again and whether its addresses were the same). Once it is up, a
fresh peer joins through it alone (`demo.newcomers`, issue #31).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from p2p_diloco.demo.chaos import KILL_BOOTSTRAP, KILL_LEARNER, KILL_SYNC, STOP_LEARNER, Fault
from p2p_diloco.demo.newcomers import Newcomers
from p2p_diloco.demo.slots import Slot
from p2p_diloco.demo.workers import DECOUPLED, Workers, killpg, read_addresses

RELAUNCH_SECONDS = 2.0
FRESH_SECONDS = 3.0  # a learner's progress older than this says nothing about its replica now


def listen_addresses(announced: list[str]) -> list[str]:
    """The listen multiaddrs behind announced ``.../p2p/ID`` addresses (the ID part stripped)."""
    return [a.split("/p2p/")[0] for a in announced]


def is_current(name: str, reports: dict[str, tuple[float, Any]], now: float, *, behind: int = 1) -> bool:
    """Whether `name`'s last report ``(t, versions)`` is at most `FRESH_SECONDS` old and at most `behind`
    versions behind the newest of the fresh `reports` on every fragment."""

    def fresh(report: tuple[float, Any]) -> list[int] | None:
        t, versions = report
        return versions if isinstance(versions, list) and now - t <= FRESH_SECONDS else None

    mine = fresh(reports[name]) if name in reports else None
    if mine is None:
        return False
    rows = [v for r in reports.values() if (v := fresh(r)) is not None and len(v) == len(mine)]
    newest = [max(column) for column in zip(*rows, strict=True)]
    return all(m >= n - behind for m, n in zip(mine, newest, strict=True))


class FaultInjector:
    """The long schedule's executor (module docstring)."""

    def __init__(self, run: Workers):
        self.run = run
        self.pending: list[Fault] = sorted(run.schedule.faults, key=lambda f: f.at)
        self.paused: dict[str, float] = {}  # slot name -> when to SIGCONT
        self.bootstrap_down_until: float | None = None
        self.bootstrap_log: Path | None = None  # the log of a restart still starting
        self.bootstrap_restarts: list[dict[str, Any]] = []
        self.original_addresses: list[str] = []
        self.exits: list[dict[str, Any]] = []
        self.newcomers = Newcomers(run)  # a fresh peer through each restarted bootstrap node

    # ---- state -------------------------------------------------------------------------------------

    def up(self, slot: Slot) -> bool:
        """Started and training: alive, not stopped, its last mark ``up``."""
        return (
            slot.alive
            and slot.restart_at is None
            and slot.name not in self.paused
            and bool(slot.marks)
            and slot.marks[-1][1] == "up"
        )

    def bootstrap_up(self) -> bool:
        return self.bootstrap_down_until is None and self.bootstrap_log is None

    # ---- choosing ----------------------------------------------------------------------------------

    def current(self, slot: Slot, up: list[Slot], now: float) -> bool:
        """Up and `is_current` among `up` (a worker without fragment versions, the baseline: up)."""
        if not self.up(slot) or "versions" not in slot.last_progress:
            return self.up(slot)
        reports = {
            s.name: (float(s.last_progress.get("t") or 0), s.last_progress.get("versions")) for s in up
        }
        return is_current(slot.name, reports, now)

    def _victim(self, fault: Fault, now: float) -> tuple[Slot | None, str]:
        """The victim, or None while the fault would leave no other current learner (module docstring)."""
        slots = self.run.slots
        order = [slots[(fault.learner + k) % len(slots)] for k in range(len(slots))]
        up = [s for s in order if self.up(s)]
        current = [s for s in up if self.current(s, up, now)]

        def spared(victim: Slot) -> bool:  # another learner keeps the newest state
            return any(s is not victim for s in current)

        sync = self.run.current_synchronizer() if self.run.system == DECOUPLED else None
        if fault.action == KILL_SYNC:
            if sync is not None and self.up(sync):
                return (sync, "the current synchronizer") if spared(sync) else (None, "")
            candidates, why = up, "fallback for the synchronizer (none seen)"
        elif fault.action == STOP_LEARNER:
            candidates, why = [s for s in up if s is not sync], "scheduled learner (not the synchronizer)"
        else:
            candidates, why = up, "scheduled learner"
        victim = next((s for s in candidates if spared(s)), None)
        return (victim, why) if victim is not None else (None, "")

    # ---- each tick ---------------------------------------------------------------------------------

    def apply(self, now: float) -> None:
        run = self.run
        self._resume_paused(now)
        self._watch_bootstrap(now)
        self.newcomers.watch(now)
        self.watch_exits(now)
        for slot in run.slots:
            if slot.restart_at is not None and now >= slot.restart_at:
                slot.restart_at = None
                run.launch(slot, now)
        waiting = []
        for fault in list(self.pending):
            if now - run.start_time < fault.at:
                waiting.append(fault)
                continue
            if not self._execute(fault, now):
                waiting.append(fault)  # not possible now: try again next tick
        self.pending = waiting

    def _execute(self, fault: Fault, now: float) -> bool:
        run = self.run
        delayed = round(now - run.start_time - fault.at, 1)
        if fault.action == KILL_BOOTSTRAP:
            if not self.bootstrap_up() or run.bootstrap is None:
                return False
            self.original_addresses = list(run.bootstrap_addresses)
            killpg(run.bootstrap, signal.SIGKILL)
            run.bootstrap.wait(timeout=10)
            self.bootstrap_down_until = now + fault.down
            run.kills.append(
                {
                    "t": now - run.start_time,
                    "action": fault.action,
                    "learner": "bootstrap",
                    "down": fault.down,
                    "why": "the bootstrap node",
                    "delayed": delayed,
                }
            )
            return True
        victim, why = self._victim(fault, now)
        if victim is None:
            return False
        if fault.action == STOP_LEARNER:
            killpg(victim.proc, signal.SIGSTOP)
            self.paused[victim.name] = now + fault.down
            victim.marks.append((now, "pause"))
            run.kills.append(
                {
                    "t": now - run.start_time,
                    "learner": victim.name,
                    "peer_id": victim.peer_id,
                    "action": fault.action,
                    "why": why,
                    "down": fault.down,
                    "delayed": delayed,
                }
            )
            return True
        assert fault.action in (KILL_SYNC, KILL_LEARNER), fault.action
        run.kill(victim, now, fault, why)
        run.kills[-1]["delayed"] = delayed
        return True

    def watch_exits(self, now: float, *, relaunch: bool = True) -> None:
        run = self.run
        for slot in run.slots:
            if slot.proc is None or slot.alive or slot.restart_at is not None or slot.name in self.paused:
                continue
            if slot.marks and slot.marks[-1][1] in ("exit", "kill", "stop"):
                continue
            try:
                last = slot.log_path.read_text(errors="replace").strip().splitlines()[-1][-300:]
            except (OSError, IndexError):
                last = ""
            self.exits.append(
                {
                    "t": now - run.start_time,
                    "learner": slot.name,
                    "code": slot.proc.returncode,
                    "last_line": last,
                }
            )
            slot.marks.append((now, "exit"))
            if relaunch:
                slot.restart_at = now + RELAUNCH_SECONDS

    def _resume_paused(self, now: float, *, all_now: bool = False) -> None:
        for name, until in list(self.paused.items()):
            if all_now or now >= until:
                slot = next(s for s in self.run.slots if s.name == name)
                killpg(slot.proc, signal.SIGCONT)
                slot.marks.append((now, "up"))
                del self.paused[name]

    def _watch_bootstrap(self, now: float) -> None:
        run = self.run
        if self.bootstrap_down_until is not None and now >= self.bootstrap_down_until:
            self.bootstrap_down_until = None
            self.bootstrap_log = run.workdir / f"bootstrap.restart-{len(self.bootstrap_restarts) + 1}.log"
            run.bootstrap = run.spawn(
                run.bootstrap_cmd(listen_addresses(self.original_addresses)), self.bootstrap_log
            )
            self.bootstrap_restarts.append({"t": now - run.start_time, "up": None, "same_address": None})
        if self.bootstrap_log is not None:
            found = read_addresses(self.bootstrap_log)
            if found or (run.bootstrap is not None and run.bootstrap.poll() is not None):
                restart = self.bootstrap_restarts[-1]
                restart["up"] = (now - run.start_time) if found else None
                restart["same_address"] = sorted(found) == sorted(self.original_addresses)
                restart["addresses"] = found
                if not found:
                    restart["error"] = f"exited with {run.bootstrap.returncode}; see {self.bootstrap_log}"
                else:
                    self.newcomers.start(now, found)
                self.bootstrap_log = None

    # ---- the end -----------------------------------------------------------------------------------

    def finish(self, now: float, *, wait_bootstrap: float = 30.0) -> None:
        """SIGCONT every stopped learner, bring the bootstrap back (waiting up to `wait_bootstrap` s) and
        log the faults still pending as skipped. Learners still down stay down; exits are still logged
        (`watch_exits`), no longer relaunched."""
        run = self.run
        self._resume_paused(now, all_now=True)
        self.newcomers.finish(now)
        self.watch_exits(now, relaunch=False)
        for fault in self.pending:
            run.kills.append({"t": fault.at, "action": fault.action, "skipped": "no learner would stay up"})
        self.pending = []
        if self.bootstrap_down_until is not None:
            self.bootstrap_down_until = now
        deadline = time.monotonic() + wait_bootstrap
        while True:
            self._watch_bootstrap(time.time())
            if self.bootstrap_up() or time.monotonic() > deadline:
                break
            time.sleep(0.2)
