"""`scripts/gpu_check.sh --cpu`: the GPU check's whole flow with --device cpu and tiny sizes (not marked
``gpu``: it runs everywhere; marked ``soak``: about 90 s, so `scripts/test.sh --soak` runs it, not CI's
default run). With CUDA absent the CUDA tests skip with their reason, the figures are measured on the
CPU, and the real run's two peers must end with agreeing replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.soak]

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_on_the_cpu_writes_every_result(tmp_path):
    out = tmp_path / "gpu-check"
    env = {**os.environ, "PYTHON": sys.executable}  # this interpreter: the script leaves the venv alone
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    for step in range(1, 8):
        assert f"step {step}/7" in log  # progress is printed
    assert {p.name for p in out.iterdir()} >= {
        "env.json", "tests.log", "figures.json", "realrun.json", "summary.json", "summary.md", "gpu_check.log"
    }  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True and summary["problems"] == []
    counts = summary["tests"]["counts"]
    assert sum(counts.values()) >= 10
    if not torch.cuda.is_available():
        assert counts == {"skipped": sum(counts.values())}
        assert all(
            "no CUDA device" in c["detail"] or "NCCL" in c["detail"] for c in summary["tests"]["cases"]
        )
    rows = json.loads((out / "figures.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["ok"] and r["tokens_per_s"] > 0 and r["device"] == "cpu" for r in rows)
    assert {(r["optimizer"], r["activation_checkpointing"]) for r in rows} == {
        (o, c) for o in ("adamw", "adamw8bit") for c in (False, True)
    }
    run = json.loads((out / "realrun.json").read_text())
    assert run["ok"] is True and run["agreement"]["agree"] is True
    assert run["persisted_replicas"]["identical"] or not run["persisted_replicas"]["same_versions"]
    assert all(peer["tokens"] > 0 and peer["exit"] == 0 for peer in run["peers"].values())
    assert "all checks passed" in (out / "summary.md").read_text()
