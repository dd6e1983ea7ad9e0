"""How soon a restarted bootstrap node shows the whole swarm again (issue #31, item 1): a figure, not a test.

Starts a bootstrap node that watches the run (``--manifest --state-dir``, as the demo does) and N learners
of a manifest (default: peers/demo.toml) on 127.0.0.1, waits until they trained, then restarts the
bootstrap node R times (SIGKILL, `--down` seconds, the same address and key). After each restart it
measures, from the moment the restarted node printed its address:

- ``seen_all``: when a fresh DHT client that knows only the bootstrap node (what ``p2p-diloco status``,
  the dashboard and a newcomer through it do first) reads the heartbeats of every learner, polling with
  a new client each time (``client_setup``: that client's own start-up, included);
- in heartbeat periods of the manifest.

Writes ``--out`` (JSON: every restart's figures and the manifest's heartbeat period) and prints a line per
restart. Example: ``python scripts/bootstrap_visibility.py --learners 3 --restarts 5 --out vis.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import RunManifest
from p2p_diloco.net.dht_store import DhtKeyValueStore, create_dht
from p2p_diloco.net.identity import write_identity
from p2p_diloco.wire.keys import heartbeat_key

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
ADDRESS_LINE = "bootstrap address: "


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "p2p_diloco", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )


def addresses(log: Path, deadline: float) -> list[str]:
    while time.monotonic() < deadline:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        found = [ln.removeprefix(ADDRESS_LINE).strip() for ln in lines if ln.startswith(ADDRESS_LINE)]
        if found:
            return found
        time.sleep(0.05)
    raise RuntimeError(f"no bootstrap address in {log}")


def seen(initial: list[str], key: str, want: set[str]) -> tuple[bool, float]:
    """Whether a fresh client through `initial` reads every heartbeat in `want`; its set-up seconds."""
    t0 = time.monotonic()
    client = create_dht(initial_peers=initial, client_mode=True, host_maddrs=[LOOPBACK])
    setup = time.monotonic() - t0
    try:
        found = DhtKeyValueStore(client, timeout=5.0).get(key, get_dht_time())
    except TimeoutError:
        return False, setup
    finally:
        client.shutdown()
    return want <= set(found), setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=ROOT / "peers" / "demo.toml")
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--down", type=float, default=3.0, help="seconds the bootstrap node stays down")
    parser.add_argument("--train", type=float, default=30.0, help="seconds of training before the first")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    manifest = RunManifest.load(args.manifest)
    period = manifest.timing.heartbeat_period
    key = heartbeat_key(manifest.run_id, manifest.manifest_hash)
    work = Path(tempfile.mkdtemp(prefix="bootstrap-visibility-"))
    write_identity(work / "bootstrap.key")
    boot_args = ["bootstrap", "--identity", str(work / "bootstrap.key"), "--manifest", str(args.manifest)]
    boot_args += ["--state-dir", str(work / "bootstrap-state")]
    procs: list[subprocess.Popen] = []
    boot = spawn([*boot_args, "--listen", LOOPBACK], work / "bootstrap-0.log")
    first = addresses(work / "bootstrap-0.log", time.monotonic() + args.timeout)
    listen = [a.rsplit("/p2p/", 1)[0] for a in first]
    want = set()
    for i in range(args.learners):
        want.add(write_identity(work / f"l{i}.key"))
        procs.append(
            spawn(
                ["join", str(args.manifest), "--initial-peers", *first, "--identity", str(work / f"l{i}.key")]
                + ["--state-dir", str(work / f"state-l{i}"), "--listen", LOOPBACK],
                work / f"l{i}.log",
            )
        )
    rows = []
    try:
        deadline = time.monotonic() + args.timeout
        while not seen(first, key, want)[0]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the learners never showed up; see {work}")
        time.sleep(args.train)
        for r in range(1, args.restarts + 1):
            os.killpg(boot.pid, signal.SIGKILL)
            boot.wait()
            time.sleep(args.down)
            log = work / f"bootstrap-{r}.log"
            boot = spawn([*boot_args, "--listen", *listen], log)
            again = addresses(log, time.monotonic() + args.timeout)
            up = time.monotonic()
            polls, setups, ok = 0, [], False
            while time.monotonic() - up < args.timeout:
                polls += 1
                ok, setup = seen(again, key, want)
                setups.append(round(setup, 2))
                if ok:
                    break
            took = round(time.monotonic() - up, 2)
            row = {
                "restart": r,
                "same_address": sorted(again) == sorted(first),
                "seen_all": took if ok else None,
            }
            row |= {"in_heartbeat_periods": round(took / period, 2) if ok else None, "polls": polls}
            row |= {"client_setup": setups}
            rows.append(row)
            print(json.dumps(row), flush=True)
            time.sleep(args.train / 2)
    finally:
        for proc in [*procs, boot]:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    took = [r["seen_all"] for r in rows if r["seen_all"] is not None]
    summary = {"heartbeat_period": period, "learners": args.learners, "down": args.down, "restarts": rows}
    summary["seen_all_median"] = sorted(took)[len(took) // 2] if took else None
    summary["seen_all_max"] = max(took) if took else None
    summary["load_average_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"seen all after a restart: median {summary['seen_all_median']} s, max {summary['seen_all_max']} s")
    print(f"(heartbeat period {period} s); work dir {work}")


if __name__ == "__main__":
    main()
