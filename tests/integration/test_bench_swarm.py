"""scripts/bench_swarm.py end to end, small: real `join` processes on 127.0.0.1 (2 learners, a short window)
and the in-process half (the model at 8 and 16 peers, real `Peer` objects at 8). The reports and plots
must be complete; the numbers themselves are the benchmark's business, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.soak]

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_swarm.py"


def bench(*args: str, timeout: float) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"bench_swarm failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.timeout(360)
def test_real_processes_report_bytes_per_update_and_propagation(tmp_path: Path):
    bench("--learners", "2", "--warmup", "5", "--duration", "25", "--out", str(tmp_path), timeout=340)
    report = json.loads((tmp_path / "swarm.json").read_text())
    (row,) = report["rows"]
    assert row["learners"] == 2 and row["shards"] == 1
    assert row["merged_updates"] > 0, row
    assert set(row["per_peer"]) == {"learner-0", "learner-1"}
    assert row["busiest_bytes_per_update"] > row["update_bytes"] > 0
    assert row["propagation"]["updates"] > 0 and row["propagation"]["p50"] >= 0
    assert row["publisher_fanout"], "no publisher held the role for a good part of the window"
    assert 0 < row["goodput"] <= 1.1  # paced time counts as compute, so a little over 1 can happen
    assert (tmp_path / "swarm.png").stat().st_size > 0
    assert "n2-s1" in row["workdir"] and (tmp_path / "n2-s1" / "manifest.toml").exists()


@pytest.mark.timeout(300)
def test_inprocess_model_and_real_peers_report_busiest_bytes_and_depth(tmp_path: Path):
    small = "--inprocess 8,16 --real-upto 8 --real-seconds 5 --rounds 1 --peers-per-shard 4".split()
    bench(*small, "--out", str(tmp_path), timeout=280)
    report = json.loads((tmp_path / "inprocess.json").read_text())
    rules = {(r["peers"], r["fanout"], r["shards"], r["fragments"]) for r in report["model"]}
    # S = M / 4 over as many fragments: 8 peers S = 2 (the manifest's 4 fragments), 16 peers S = 4
    assert rules == {(8, 0, 1, 4), (8, 3, 1, 4), (8, 3, 2, 4), (16, 0, 1, 4), (16, 3, 1, 4), (16, 3, 4, 4)}
    assert all(r["every_peer_got_every_update"] for r in report["model"])
    (real,) = report["real"]
    assert real["peers"] == 8 and real["replicas_agree"] and real["busiest_bytes_per_round"] > 0
    assert report["figures"]["fanout=3 S=1"]["depth"] == {"8": 2, "16": 3}
    assert "busiest_bytes_per_round_16_over_8" in report["figures"]["fanout=3 S=M/4"]
    assert (tmp_path / "inprocess.png").stat().st_size > 0
