"""The end of a long chaos run (``demo --chaos-every``): did the swarm keep its global state?

`finish_long_run(run, injector)` runs after the timed window, in this order:

1. every SIGSTOPped learner is continued, the bootstrap node brought back if it was down, faults still
   pending are logged as skipped (`FaultInjector.finish`); workers still starting get up to
   `STARTING_WAIT` seconds to come up (learners still down stay out of the checks);
2. (decoupled only) every learner that is up gets SIGUSR1 (stop training, keep serving) and the run
   waits up to `SETTLE_SECONDS` for their versions to settle; then ``p2p-diloco status --json`` asks the
   swarm, through the bootstrap node, for every live peer's per-fragment versions and checksums and
   replica digest (`checks.digest_agreement`; the same from the peers' last progress events too);
3. all workers are stopped together (SIGTERM: they persist) and the final global model is evaluated;
4. (decoupled only) the workers that were up are restarted from their state dirs; the versions each one
   restores (its ``start`` event) are compared with what it persisted at the stop (`checks.resume_check`),
   then they are stopped again;
5. versions never went back over the whole run (`checks.versions_went_back`).

Returns the `RunRecord.checks` dict (plus ``final_eval_loss``, which the caller takes out).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from typing import Any

from p2p_diloco.demo import checks as verdicts
from p2p_diloco.demo.faults import FaultInjector
from p2p_diloco.demo.slots import Slot
from p2p_diloco.demo.workers import DECOUPLED, Workers, python_cmd, stop_slots
from p2p_diloco.node.state import read_peer_state

STARTING_WAIT = 20.0  # for workers still starting when the window ends
SETTLE_SECONDS = 8.0  # after SIGUSR1: time for rounds in flight to publish and replicas to apply them
STATUS_TIMEOUT = 45.0
RESTART_TIMEOUT = 120.0  # imports, DHT and model on a loaded 2-core machine


def _latest_progress(slot: Slot, since: float) -> dict[str, Any] | None:
    for event in reversed(slot.tail.events):
        if event.get("event") == "progress":
            return event if float(event.get("t") or 0) >= since else None
    return None


def _settle(up: list[Slot], since: float) -> bool:
    """Wait until every slot in `up` reports (after `since`) the same versions; False on timeout."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        for slot in up:
            slot.tail.poll()
        latest = [_latest_progress(slot, since) for slot in up]
        if all(latest) and len({tuple(p.get("versions") or ()) for p in latest if p}) == 1:
            return True
        time.sleep(0.25)
    return False


def ask_status(run: Workers) -> dict[str, Any]:
    """``p2p-diloco status --json`` entering through the bootstrap node and the learners' own addresses (a
    restarted bootstrap knows no peer until they contact it again): {"peers": [...]} or {"error": ...}."""
    cmd = python_cmd(
        "status",
        str(run.manifest_path),
        "--initial-peers",
        *run.bootstrap_addresses,
        *_learner_addresses(run),
        "--json",
        "--wait",
        "10",
    )
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=STATUS_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"status did not answer within {STATUS_TIMEOUT:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"status exited {done.returncode}: {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def _learner_addresses(run: Workers) -> list[str]:
    """The addresses live learners announced in their latest ``start`` event."""
    found = []
    for slot in run.slots:
        if slot.alive:
            start = next((e for e in reversed(slot.tail.events) if e.get("event") == "start"), None)
            found += [str(a) for a in (start or {}).get("addresses") or []]
    return found


def _replica_rows(run: Workers, status: dict[str, Any]) -> list[dict[str, Any]]:
    names = {s.peer_id: s.name for s in run.slots}
    return [
        {
            "peer": names.get(p["peer_id"], p["peer_id"]),
            "versions": p.get("versions"),
            "digest": p.get("digest"),
            "tips": p.get("tips") or [],
        }
        for p in status.get("peers", [])
    ]


def _persisted_versions(slot: Slot) -> list[int] | None:
    try:
        state = read_peer_state(slot.state_dir)
    except (OSError, ValueError):
        return None
    return list(state["versions"]) if state and "versions" in state else None


def _restart_and_read(run: Workers, slots: list[Slot]) -> dict[str, list[int] | None]:
    """Restart `slots` from their state dirs; the versions each restored (its next ``start`` event)."""
    seen = {slot.name: len(slot.tail.events) for slot in slots}
    for slot in slots:
        run.launch(slot, time.time())
    restored: dict[str, list[int] | None] = {}
    deadline = time.monotonic() + RESTART_TIMEOUT
    while len(restored) < len(slots) and time.monotonic() < deadline:
        for slot in slots:
            if slot.name in restored:
                continue
            slot.tail.poll()
            start = next((e for e in slot.tail.events[seen[slot.name] :] if e.get("event") == "start"), None)
            if start is not None:
                restored[slot.name] = list(start.get("versions") or [])
            elif not slot.alive:
                restored[slot.name] = None
        time.sleep(0.2)
    return restored


def finish_long_run(run: Workers, injector: FaultInjector) -> dict[str, Any]:
    """The end of a long chaos run (module docstring)."""
    injector.finish(time.time())
    found: dict[str, Any] = {"bootstrap_restarts": injector.bootstrap_restarts, "exits": injector.exits}
    decoupled = run.system == DECOUPLED
    deadline = time.monotonic() + STARTING_WAIT
    while time.monotonic() < deadline and any(
        s.alive and s.marks and s.marks[-1][1] == "launch" for s in run.slots
    ):
        run.poll_events(time.time())  # workers restarted late in the run: let them come up and be checked
        injector.watch_exits(time.time(), relaunch=False)
        time.sleep(0.25)
    up = [s for s in run.slots if injector.up(s)]
    if decoupled and up:
        quiet = time.time()
        for slot in up:
            if slot.proc is not None:
                slot.proc.send_signal(signal.SIGUSR1)  # the join process only: its DHT child must not get it
        found["settled"] = _settle(up, quiet + 1.0)
        status = ask_status(run)
        found["status_error"] = status.get("error")
        found["replicas"] = verdicts.digest_agreement(_replica_rows(run, status))
        last = [(slot.name, _latest_progress(slot, 0.0)) for slot in up]
        found["replicas_from_events"] = verdicts.digest_agreement(
            [
                {"peer": name, "versions": p.get("versions"), "digest": p.get("digest")}
                for name, p in last
                if p
            ]
        )
    stop_slots(run.slots)
    found["final_eval_loss"] = run.evaluate_saved()
    if decoupled:
        stopped_ok = [s for s in up if s.proc is not None and s.proc.returncode == 0]
        before = {s.name: _persisted_versions(s) for s in stopped_ok}
        after = _restart_and_read(run, stopped_ok)
        stop_slots(stopped_ok)
        found["resume"] = verdicts.resume_check(before, after)
        found["resume"]["not_checked"] = sorted({s.name for s in run.slots} - set(before))
    for slot in run.slots:
        slot.tail.poll()
    went_back = verdicts.versions_went_back({s.name: s.tail.events for s in run.slots})
    found["versions_went_back"] = went_back
    found["faults"] = verdicts.faults_by_kind(run.kills)
    found["newcomers"] = injector.newcomers.results()  # fresh peers through the restarted bootstrap (#31)
    found["no_state_lost"] = (
        not went_back and found.get("resume", {}).get("resumed", False) if decoupled else not went_back
    )
    return found
