"""Newcomers through a restarted bootstrap node (``demo --chaos-every``, issue #31).

After each bootstrap restart that came up, `Newcomers.start` launches a fresh peer (`p2p-diloco join`, a
new key and state dir, the bootstrap node's addresses as its only initial peers), unless one still runs
or less than `newcomer_lead` seconds of the run are left (it would not finish starting: not a newcomer
that failed, and not launched).
`watch` reads its events every tick and stops it (SIGTERM, its graceful stop) once it reached the swarm's
versions or `NEWCOMER_SECONDS` after its launch; `results` judges each one with
`demo.checks.newcomer_check` (the swarm's versions at its start, within 2 heartbeat periods, never a
version published from 0). The newcomers are not learner slots: no fault picks them and the run's
accounting does not count them.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.demo import checks
from p2p_diloco.demo.slots import EventTail
from p2p_diloco.demo.workers import LOOPBACK, STOP_TIMEOUT, Workers, killpg, python_cmd
from p2p_diloco.net.identity import write_identity

NEWCOMER_SECONDS = 60.0  # launch to stop at the latest: imports and DHT on a loaded 2-core machine
NEWCOMER_LEAD = 45.0  # no newcomer launched this close to the run's end (one started 24 s before never did)


def newcomer_lead(duration: float) -> float:
    """Seconds before the end of a run of `duration` s after which no newcomer is launched: `NEWCOMER_LEAD`,
    or a quarter of a short run."""
    return min(NEWCOMER_LEAD, duration / 4)


@dataclass
class Newcomer:
    name: str
    launched: float
    proc: subprocess.Popen
    tail: EventTail
    stopped: float | None = None
    result: dict[str, Any] = field(default_factory=dict)


class Newcomers:
    """The fresh peers a long chaos run sends through its restarted bootstrap node (module docstring)."""

    def __init__(self, run: Workers):
        self.run = run
        self.all: list[Newcomer] = []
        self.closed = False  # the run is ending: no more newcomers

    def running(self) -> bool:
        return any(n.stopped is None for n in self.all)

    def start(self, now: float, addresses: list[str]) -> None:
        run = self.run
        if self.closed or self.running() or not addresses:
            return
        if now > run.start_time + run.schedule.duration - newcomer_lead(run.schedule.duration):
            return
        name = f"newcomer-{len(self.all) + 1}"
        key, state_dir = run.workdir / f"{name}.key", run.workdir / f"state-{name}"
        write_identity(key, force=True)
        cmd = python_cmd(
            "join",
            str(run.manifest_path),
            "--initial-peers",
            *addresses,
            "--identity",
            str(key),
            "--state-dir",
            str(state_dir),
            "--listen",
            LOOPBACK,
            "--progress-every",
            "1",
        )
        proc = run.spawn(cmd, run.workdir / f"{name}.log")
        self.all.append(Newcomer(name, now, proc, EventTail(state_dir / "events.jsonl")))

    def watch(self, now: float) -> None:
        """Poll each running newcomer; stop it once it reached the swarm's versions, or timed out."""
        for newcomer in self.all:
            if newcomer.stopped is not None:
                continue
            newcomer.tail.poll()
            judged = self._judge(newcomer)
            if judged["reached_after"] is not None or now - newcomer.launched > NEWCOMER_SECONDS:
                self._stop(newcomer, now)

    def finish(self, now: float) -> None:
        """Stop the newcomers still running, wait up to `STOP_TIMEOUT` for each, then SIGKILL its group."""
        self.closed = True
        for newcomer in self.all:
            if newcomer.stopped is None:
                self._stop(newcomer, now)
        deadline = time.monotonic() + STOP_TIMEOUT
        for newcomer in self.all:
            try:
                newcomer.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            killpg(newcomer.proc, signal.SIGKILL)
            newcomer.tail.poll()

    def results(self) -> list[dict[str, Any]]:
        """One `checks.newcomer_check` row per newcomer, with its name and launch time (run seconds)."""
        rows = []
        for newcomer in self.all:
            newcomer.tail.poll()
            row = {"name": newcomer.name, "launched": round(newcomer.launched - self.run.start_time, 1)}
            rows.append({**row, **self._judge(newcomer)})
        return rows

    def _judge(self, newcomer: Newcomer) -> dict[str, Any]:
        swarm = {s.name: s.tail.events for s in self.run.slots}
        period = self.run.manifest.timing.heartbeat_period
        return checks.newcomer_check(newcomer.tail.events, swarm, period)

    def _stop(self, newcomer: Newcomer, now: float) -> None:
        """SIGTERM the join process (its graceful stop); `finish` waits for it."""
        newcomer.stopped = now
        if newcomer.proc.poll() is None:
            newcomer.proc.send_signal(signal.SIGTERM)
