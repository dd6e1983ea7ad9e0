"""Redo the dashboard screenshots: a short real run on 127.0.0.1 and headless-Chromium screenshots of its page.

    .venv/bin/python scripts/dashboard_screenshot.py [--learners 3] [--seconds 120] [--widths 1400,420]

Starts a bootstrap, `--learners` `join` processes of a small byte-level GPT (the synchronizer evaluates
the global model every 8 merged updates and hands its role on every 150 rounds, a planned rotation) and
`p2p-diloco dashboard` on a free port; at `--kill-sync-at` seconds it SIGKILLs the synchronizer (so a
failover is marked too); after `--seconds` it saves one screenshot per window width with Chromium
(`chromium --headless --screenshot`): `--out` (docs/dashboard.png) at the first width, the others beside it
as dashboard-WIDTH.png, and stops everything. Needs `chromium` on PATH (Debian: `apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = """
run_id = "dashboard-demo"
[diloco]
inner_steps = 8
fragments = 2
max_in_flight = 2
min_quorum = 1
batch_size = 8
outer_lr = 1.0
outer_momentum = 0.0
[model]
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64
[timing]
# the demo's timing: on a loaded machine shorter leases lapse now and then (extra failovers on the page)
heartbeat_period = 1.0
heartbeat_ttl = 4.0
lease_ttl = 6.0
claim_grace = 2.0
term_rounds = 150
[robust]
min_cosine = -1.0
"""


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", *args]


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=ROOT, start_new_session=True
    )


def first_lines(proc: subprocess.Popen, prefix: str, timeout: float) -> list[str]:
    deadline, found = time.monotonic() + timeout, []
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            found.append(line[len(prefix) :].strip())
        elif not line:
            if found:
                return found
            time.sleep(0.2)
    raise TimeoutError(f"no {prefix!r} line within {timeout} s")


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def screenshot(chromium: str, url: str, width: int, out: Path) -> None:
    """The page at `width` px, tall enough for all of it (one column of cards below 1100 px, the peers'
    cells stacked below 600 px)."""
    height = 1900 if width >= 1100 else 3100 if width > 600 else 3500
    out.parent.mkdir(parents=True, exist_ok=True)
    window = [f"--window-size={width},{height}", "--virtual-time-budget=5000", f"--screenshot={out}"]
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *window]
    subprocess.run([chromium, *flags, url], check=True, capture_output=True, timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--kill-sync-at", type=float, default=60.0, help="0: no failover")
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    parser.add_argument("--widths", default="1400,420", help="window widths, comma-separated")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("needs chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 1
    from p2p_diloco.net.identity import write_identity

    work = Path(tempfile.mkdtemp(prefix="dashboard-demo-"))
    (work / "run.toml").write_text(MANIFEST)
    procs: list[subprocess.Popen] = []
    try:
        write_identity(work / "boot.key")
        boot = spawn(
            cli("bootstrap", "--identity", str(work / "boot.key"), "--listen", "/ip4/127.0.0.1/tcp/0"),
            work / "boot.log",
        )
        procs.append(boot)
        initial = first_lines(boot, "bootstrap address: ", 60)
        peers = {}
        for i in range(args.learners):
            key = work / f"p{i}.key"
            peer_id = write_identity(key)
            cmd = cli(
                "join", str(work / "run.toml"), "--initial-peers", *initial, "--identity", str(key),
                "--state-dir", str(work / f"state-p{i}"), "--listen", "/ip4/127.0.0.1/tcp/0",
                "--min-step-time", "0.05", "--eval-every", "8", "--eval-batches", "8",
            )  # fmt: skip
            peers[peer_id] = spawn(cmd, work / f"p{i}.log")
            procs.append(peers[peer_id])
        dash = spawn(
            cli("dashboard", str(work / "run.toml"), "--initial-peers", *initial, "--port", "0"),
            work / "dash.log",
        )
        procs.append(dash)
        url = first_lines(dash, "dashboard: ", 90)[0]
        print(f"dashboard at {url} (logs in {work})")
        started, killed = time.monotonic(), False
        while time.monotonic() - started < args.seconds:
            time.sleep(5)
            view = get(url + "api/summary")
            sync = view["synchronizer"]
            print(f"{time.monotonic() - started:5.0f} s: {len(view['peers'])} peers, {len(view['eval'])} evals, "
                  f"sync {sync and sync['peer_id'][:12]}")  # fmt: skip
            if args.kill_sync_at and not killed and time.monotonic() - started >= args.kill_sync_at and sync:
                victim = peers.get(sync["peer_id"])
                if victim is not None:
                    os.killpg(victim.pid, signal.SIGKILL)
                    killed = True
                    print("killed the synchronizer")
        widths = [int(w) for w in args.widths.split(",")]
        for width in widths:
            out = Path(args.out)
            if width != widths[0]:
                out = out.with_name(f"{out.stem}-{width}{out.suffix}")
            screenshot(chromium, url, width, out)
            print(f"wrote {out}")
        return 0
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(main())
