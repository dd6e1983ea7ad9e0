"""`p2p-diloco demo --chaos-every` end to end, briefly: real bootstrap and `join` processes on 127.0.0.1
under a fault about every 8 s (synchronizer and learner SIGKILLs, a SIGSTOPped learner, a bootstrap
restart on the same address, then a fresh peer through it). The report must list faults of several kinds, and after all peers were
stopped together and restarted they must resume from their last versions, not from 0. Versions must
never have gone back; where they did (a holder's fork over versions only dead or frozen peers held) the test reports xfail with
the count instead of passing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.demo.newcomers import newcomer_lead

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.soak]

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(330)
def test_long_chaos_injects_several_kinds_of_faults_and_loses_no_global_state(tmp_path: Path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "p2p_diloco", "demo", "--chaos-every", "8", "--learners", "3",
           "--duration", "40", "--seed", "0", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=310)
    assert done.returncode == 0, f"demo failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads((out / "report.json").read_text())
    assert report["schedule"]["every"] == 8
    decoupled = report["decoupled"]
    checks = decoupled["checks"]
    summary = f"{done.stdout[-2500:]}\nchecks: {json.dumps(checks)[:3000]}"
    executed = checks["faults"]["executed"]
    assert len(executed) >= 3, summary  # several kinds (seed 0: all four are scheduled)
    resume = checks["resume"]
    assert resume["peers"] and resume["resumed"], summary
    assert resume["swarm_after"] == resume["swarm_before"] and sum(resume["swarm_after"]) > 0, summary
    if "kill_bootstrap" in executed:
        assert all(r["same_address"] for r in checks["bootstrap_restarts"]), summary
        # a fresh peer joins through a restarted bootstrap that came up before the end (#31); none
        # published from version 0 (on a loaded machine the restart may come up only after the run)
        last_launch = 40 - newcomer_lead(40)  # none launched later: it would not finish starting
        if any(r["up"] is not None and r["up"] < last_launch for r in checks["bootstrap_restarts"]):
            assert checks["newcomers"] and "through the restarted bootstrap" in done.stdout, summary
        assert not any(row["published_from_zero"] for row in checks["newcomers"]), summary
    assert "stall_summary" in decoupled and "stalls" in decoupled
    # A version that went back is a failure, not a known xfail (#42); the simulator's versions_monotone rule
    # found one such way in (a reconcile overtaken by applied updates, seed 13) and it is fixed.
    assert not checks["versions_went_back"], (
        f"{len(checks['versions_went_back'])} version(s) republished\n{summary}"
    )
    assert checks["no_state_lost"], summary
    assert "no global state lost: yes" in done.stdout
