"""Real `p2p-diloco join` learners across emulated 100 ms RTT links, one of them behind NAT.

A bootstrap and three learners (``l1``, ``l2`` public, ``ln`` behind a MASQUERADE NAT that accepts no
inbound connection), every access link 25 ms one-way (100 ms RTT between any two peers) and
20 Mbit/s. They train a tiny manifest; the test waits until every fragment version has advanced, the
NAT'ed learner's deltas were merged (its peer ID among the contributors of published updates, its own
``deltas_merged`` counter > 0) and ``p2p-diloco status --json`` lists all three peers, then stops every
peer with SIGTERM (exit status 0). The NAT'ed learner runs with ``--behind-nat``: a peer nobody can dial
must never hold the synchronizer role.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.state import read_events
from p2p_diloco.wan import LinkSpec, PeerSpec, nat_problem
from tests.support.manifests import tiny_swarm_toml

pytestmark = [
    pytest.mark.wan,
    pytest.mark.slow,
    pytest.mark.skipif(nat_problem() is not None, reason=f"NAT emulation: {nat_problem()}"),
]

ONE_WAY_MS = 25.0
RATE_MBIT = 20.0
START_TIMEOUT = 120.0
TRAIN_TIMEOUT = 180.0
STOP_TIMEOUT = 40.0
MIN_VERSION = 3

TINY_MANIFEST = tiny_swarm_toml(
    "wan-join",
    timing={
        "heartbeat_period": 1.0,
        "heartbeat_ttl": 5.0,
        "lease_ttl": 6.0,
        "claim_grace": 2.0,
        "lease_margin": None,
    },
)


def _status(wan, manifest: Path, bootstrap: str) -> dict:
    argv = [
        sys.executable,
        "-m",
        "p2p_diloco",
        "status",
        str(manifest),
        "--initial-peers",
        bootstrap,
        "--json",
    ]
    out = subprocess.run(wan.command("boot", argv), capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else {"peers": []}


def test_join_learners_train_across_wan_with_a_nat_learner(make_wan, ns_spawn, wait_for, tmp_path):
    link = LinkSpec(ONE_WAY_MS, rate_mbit=RATE_MBIT)
    learners = {"l1": False, "l2": False, "ln": True}  # name -> behind NAT
    wan = make_wan([PeerSpec("boot", link), *(PeerSpec(n, link, nat=nat) for n, nat in learners.items())])
    manifest = tmp_path / "tiny.toml"
    manifest.write_text(TINY_MANIFEST)
    listen = f"/ip4/{wan.address('boot')}/tcp/31337"
    boot = ns_spawn(
        wan, "boot", [sys.executable, "-m", "p2p_diloco", "bootstrap", "--listen", listen], name="boot"
    )
    bootstrap = boot.next_line("bootstrap address: ", START_TIMEOUT).removeprefix("bootstrap address: ")

    procs, state_dirs, peer_ids = {}, {}, {}
    for name, nat in learners.items():
        identity = tmp_path / f"{name}.key"
        peer_ids[name] = write_identity(identity)
        state_dirs[name] = tmp_path / f"state-{name}"
        argv = [
            sys.executable, "-m", "p2p_diloco", "join", str(manifest), "--initial-peers", bootstrap,
            "--identity", str(identity), "--state-dir", str(state_dirs[name]),
            "--listen", f"/ip4/{wan.address(name)}/tcp/0", "--min-step-time", "0.05",
            "--persist-every", "5", "--progress-every", "2", *(["--behind-nat"] if nat else []),
        ]  # fmt: skip
        procs[name] = ns_spawn(wan, name, argv, name=name)
    for proc in procs.values():
        proc.next_line("joined run", START_TIMEOUT)

    def events(name: str, kind: str) -> list[dict]:
        return [e for e in read_events(state_dirs[name]) if e["event"] == kind]

    def published() -> list[dict]:
        return [e for name in learners for e in events(name, "published")]

    def trained() -> bool:
        for name, proc in procs.items():
            assert proc.popen.poll() is None, f"{name} exited\n{proc.stderr_tail()}"
        updates = published()
        versions = {}
        for e in updates:
            versions[e["fragment"]] = max(versions.get(e["fragment"], 0), e["version"])
        nat_merged = any(peer_ids["ln"] in e["contributors"] for e in updates)
        return len(versions) == 2 and min(versions.values()) >= MIN_VERSION and nat_merged

    try:
        wait_for(
            trained,
            TRAIN_TIMEOUT,
            "every fragment at version >= 3 with the NAT'ed learner's deltas merged",
            1.0,
        )
    except TimeoutError as exc:
        tails = "\n".join(f"--- {n}:\n{p.stderr_tail(12)}" for n, p in procs.items())
        raise AssertionError(f"{exc}\npublished: {published()[-6:]}\n{tails}") from exc

    assert not events("ln", "published"), "the NAT'ed learner must never synchronize"
    assert all(e["leader"] != peer_ids["ln"] for e in published())
    # updates reach the NAT'ed learner (pushed over connections it opened, or repaired by fetching)
    wait_for(
        lambda: events("ln", "applied") or events("ln", "catch_up"),
        30,
        "updates applied at the NAT'ed learner",
    )
    wait_for(
        lambda: any(e.get("deltas_merged", 0) > 0 for e in events("ln", "progress")),
        30,
        "the NAT'ed learner counting its merged deltas",
    )
    status = wait_for(
        lambda: (s := _status(wan, manifest, bootstrap)) and len(s["peers"]) == 3 and s,
        60,
        "status --json listing the three learners",
    )
    assert {p["peer_id"] for p in status["peers"]} == set(peer_ids.values())
    assert status["synchronizer"]["peer_id"] != peer_ids["ln"]

    for proc in procs.values():
        proc.popen.send_signal(signal.SIGTERM)
    started = time.monotonic()
    for name, proc in procs.items():
        code = proc.popen.wait(timeout=max(1.0, STOP_TIMEOUT - (time.monotonic() - started)))
        assert code == 0, f"{name} exited with {code}\n{proc.stderr_tail()}"
