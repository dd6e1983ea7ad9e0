"""The processes of one demo run: the bootstrap node and the learner slots, started, killed and watched.

`Workers` starts a bootstrap node and N worker processes (`p2p-diloco join`, or `p2p-diloco
baseline-worker` for the lock-step baseline, `baseline-worker --mode diloco` for synchronous DiLoCo),
each in its own process group with a fresh key and state directory under the work dir; it SIGKILLs a
victim (`kill`: the fault log row), relaunches a slot (its hot spare takes over when it has a live one:
`join --standby`, node/standby.py), reads the workers' events (`poll_events`), finds the current
synchronizer and evaluates the newest saved global model (`demo.saved_models`). The run's timeline
(`demo.orchestrator.SwarmRun`), the long schedule's executor (`demo.faults`) and the end of a long run
(`demo.endgame`) all drive these processes through it. A learner slot (`Slot`, `EventTail`) is
`demo.slots`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from p2p_diloco.config import RunManifest
from p2p_diloco.demo.accounting import counters_in_window
from p2p_diloco.demo.chaos import Fault, Schedule
from p2p_diloco.demo.saved_models import SavedModels
from p2p_diloco.demo.slots import EventTail, Slot
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.supervise import dismiss, tell_takeover

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 120.0  # imports, DHT and model on a loaded 2-core machine
STOP_TIMEOUT = 20.0
DECOUPLED, BASELINE, DILOCO = "decoupled", "baseline", "diloco"  # BASELINE: elastic data parallel
ADDRESS_LINE = "bootstrap address: "


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", *args]


def killpg(proc: subprocess.Popen | None, sig: int) -> None:
    """Send `sig` to the process group of `proc` (it was started in its own), if it still exists."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def read_addresses(log_path: Path) -> list[str]:
    """The addresses a bootstrap node printed to its log so far."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln.removeprefix(ADDRESS_LINE).strip() for ln in lines if ln.startswith(ADDRESS_LINE)]


def dismiss_spare(slot: Slot) -> None:
    """End a slot's hot spare, if any (`node.supervise.dismiss`), with whatever it started."""
    spare, slot.spare = slot.spare, None
    if spare is not None:
        dismiss(spare)
        killpg(spare, signal.SIGKILL)


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
        killpg(slot.proc, signal.SIGKILL)


class Workers:
    """The bootstrap node and learner slots of one system's run (module docstring)."""

    def __init__(
        self,
        system: str,
        manifest_path: Path,
        learners: int,
        schedule: Schedule,
        workdir: Path,
        *,
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
        self.slots: list[Slot] = []
        self.bootstrap: subprocess.Popen | None = None
        self.bootstrap_addresses: list[str] = []
        self.bootstrap_key = workdir / "bootstrap.key"
        self.kills: list[dict[str, Any]] = []
        self.start_time = 0.0
        self.saved = SavedModels(self.manifest, baseline=system != DECOUPLED)  # both baselines: baseline.pt

    # ---- processes ---------------------------------------------------------------------------------

    def spawn(self, cmd: list[str], log_path: Path, stdin: int | None = None) -> subprocess.Popen:
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
        return python_cmd(
            "bootstrap",
            "--identity",
            str(self.bootstrap_key),
            "--listen",
            *listen,
            "--manifest",
            str(self.manifest_path),
            "--state-dir",
            str(self.workdir / "bootstrap-state"),
        )

    def start_bootstrap(self) -> None:
        write_identity(self.bootstrap_key, force=True)
        log_path = self.workdir / "bootstrap.log"
        self.bootstrap = self.spawn(self.bootstrap_cmd([LOOPBACK]), log_path)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            found = read_addresses(log_path)
            if found:
                self.bootstrap_addresses = found
                return
            if self.bootstrap.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the bootstrap node did not start; see {log_path}")

    def start_slots(self) -> None:
        """A fresh key and state directory per learner, and its first worker."""
        for i in range(self.learners):
            name = f"learner-{i}"
            key = self.workdir / f"{name}.key"
            state_dir = self.workdir / f"state-{name}"
            slot = Slot(
                index=i,
                name=name,
                identity=key,
                peer_id=write_identity(key, force=True),
                state_dir=state_dir,
                log_path=self.workdir / f"{name}.log",
                tail=EventTail(state_dir / "events.jsonl"),
            )
            self.slots.append(slot)
            self.launch(slot, time.time())

    def worker_cmd(self, slot: Slot) -> list[str]:
        slow = self.schedule.slow_learner == slot.index and self.schedule.slow_step_time > 0
        pace = ["--min-step-time", str(self.schedule.slow_step_time)] if slow else []
        common = [
            str(self.manifest_path),
            "--initial-peers",
            *self.bootstrap_addresses,
            "--identity",
            str(slot.identity),
            "--state-dir",
            str(slot.state_dir),
            "--listen",
            LOOPBACK,
            "--progress-every",
            "1",
            *pace,
        ]
        if self.system == DECOUPLED:
            return python_cmd("join", *common, "--persist-every", "5")
        mode = ["--mode", "diloco"] if self.system == DILOCO else []
        return python_cmd(
            "baseline-worker", *common, "--learners", str(self.learners), "--checkpoint-every", "5", *mode
        )

    def launch(self, slot: Slot, now: float) -> None:
        """Start the slot's worker: its hot spare takes over if it has a live one, else a cold process."""
        spare, slot.spare = slot.spare, None
        if spare is not None and tell_takeover(spare):
            slot.proc = spare
        else:
            killpg(spare, signal.SIGKILL)  # a spare that died: whatever it started goes too
            slot.proc = self.spawn(self.worker_cmd(slot), slot.log_path)
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
            self.prepare_spare(slot)

    def prepare_spare(self, slot: Slot) -> None:
        slot.spare = self.spawn([*self.worker_cmd(slot), "--standby"], slot.log_path, stdin=subprocess.PIPE)

    def kill(self, slot: Slot, now: float, fault: Fault, why: str) -> None:
        """SIGKILL the slot's worker for `fault` (relaunched after its down time) and log it."""
        # whatever the fault, was the victim the synchronizer? (the stall table counts every such kill)
        was_sync = why == "the current synchronizer" or (
            self.system == DECOUPLED and self.current_synchronizer() is slot
        )
        killpg(slot.proc, signal.SIGKILL)
        if slot.proc is not None:
            slot.proc.wait(timeout=10)
        slot.marks.append((now, "kill"))
        slot.kills += 1
        slot.restart_at = now + fault.down
        self.kills.append(
            {
                "t": now - self.start_time,
                "learner": slot.name,
                "peer_id": slot.peer_id,
                "action": fault.action,
                "why": why,
                "down": fault.down,
                "synchronizer": was_sync,
            }
        )

    def kill_all(self) -> None:
        """SIGKILL every process group the run started (its last resort)."""
        for slot in self.slots:
            killpg(slot.proc, signal.SIGKILL)
            killpg(slot.spare, signal.SIGKILL)
        killpg(self.bootstrap, signal.SIGKILL)

    # ---- observation -------------------------------------------------------------------------------

    def poll_events(self, now: float) -> None:
        for slot in self.slots:
            for event in slot.tail.poll():
                kind = event.get("event")
                if kind == "progress":
                    slot.last_progress = event
                if kind in ("progress", "start") and slot.marks and slot.marks[-1][1] == "launch":
                    slot.marks.append((float(event.get("t") or now), "up"))
                    self._replace_spare(slot, now)

    def wait_until_up(self) -> None:
        """Until every slot's worker has started (its first ``start`` or ``progress`` event)."""
        deadline = time.monotonic() + START_TIMEOUT
        while not all(any(m == "up" for _, m in s.marks) for s in self.slots):
            self.poll_events(time.time())
            dead = [s.name for s in self.slots if not s.alive]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"workers did not start ({dead or 'timeout'}); logs in {self.workdir}")
            time.sleep(0.2)

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

    def live_slot_from(self, index: int) -> Slot | None:
        """Slot `index` if it is up (training), else the next one that is, else the next live one."""
        order = [self.slots[(index + k) % len(self.slots)] for k in range(len(self.slots))]
        live = [slot for slot in order if slot.alive and slot.restart_at is None]
        up = [slot for slot in live if slot.marks and slot.marks[-1][1] == "up"]
        return (up or live or [None])[0]

    # ---- evaluation --------------------------------------------------------------------------------

    def evaluate_saved(self) -> float | None:
        """Eval loss of the most advanced global model saved in any state directory (None if none)."""
        return self.saved.evaluate(slot.state_dir for slot in self.slots)

    def tokens_so_far(self, now: float) -> float:
        return sum(counters_in_window(s.tail.events, self.start_time, now)["tokens"] for s in self.slots)
