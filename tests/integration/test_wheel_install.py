"""Done-means of issue #32: the wheel built from the repository, installed into a clean venv (no system
site-packages, dependencies from the package index at constraints.txt's versions), runs
`p2p-diloco --version`, `join demo` and `doctor` from a directory outside the repository: the join trains
alone against a bootstrap node the wheel starts, until its own merged updates move the global model; then
doctor checks the manifest, the bootstrap node and this clock against the training peer's heartbeats.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.wheel import build_wheel, clean_venv

pytestmark = [pytest.mark.integration, pytest.mark.slow]
START_TIMEOUT = 60.0
NO_REPO = {"PYTHONPATH": ""}  # an empty PYTHONPATH adds nothing: the repository is not importable
VERSIONS = re.compile(r" versions (\d+),(\d+),(\d+),(\d+) ")


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    started = time.monotonic()
    wheel = build_wheel(root)
    built = time.monotonic()
    bin_dir = clean_venv(root / "venv", wheel)
    print(f"wheel built in {built - started:.0f} s, clean venv installed in {time.monotonic() - built:.0f} s")
    return bin_dir


def merged(lines: list[str]) -> bool:
    """A progress line shows every fragment past version 0."""
    found = [VERSIONS.search(line) for line in lines if line.startswith("step ")]
    return any(m and min(int(v) for v in m.groups()) > 0 for m in found)


def test_wheel_in_a_clean_venv_runs_version_doctor_and_join_demo(venv_bin, tmp_path, spawn):
    work = tmp_path / "volunteer"  # outside the repository
    work.mkdir()
    assert REPO_ROOT not in work.parents
    env = {**os.environ, **NO_REPO}

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [str(venv_bin / "p2p-diloco"), *args]
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, cwd=work, env=env, check=False
        )

    def start(*args: str):  # noqa: ANN202
        return spawn([str(venv_bin / "p2p-diloco"), *args], env=NO_REPO, cwd=work)

    probe = "import p2p_diloco, sys; print(p2p_diloco.__file__); print(sys.path)"
    where = subprocess.run(
        [str(venv_bin / "python"), "-c", probe], capture_output=True, text=True, cwd=work, env=env, check=True
    ).stdout
    assert where.startswith(str(venv_bin.parent)) and str(REPO_ROOT) not in where, where

    version = run("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith(f"p2p-diloco {importlib.metadata.version('p2p_diloco')} "), (
        version.stdout
    )

    for name in ("bootstrap", "me"):
        keygen = run("keygen", "--out", f"{name}.key")
        assert keygen.returncode == 0, keygen.stderr
    bootstrap = start("bootstrap", "--identity", "bootstrap.key", "--listen", "/ip4/127.0.0.1/tcp/0")
    address = bootstrap.wait_for_lines("bootstrap address: ", START_TIMEOUT)[0].split(": ", 1)[1]

    pacing = ("--max-steps", "200", "--min-step-time", "0.1", "--display", "plain", "--progress-every", "1")
    join = start(
        "join", "demo", "--initial-peers", address, "--identity", "me.key", "--state-dir", "state", *pacing
    )
    join.wait_for_lines("joined run demo ", START_TIMEOUT)
    wait_until(lambda: merged(join.lines), 90, "a merged update of every fragment (versions > 0)")
    doctor = run("doctor", "demo", "--initial-peers", address, "--state-dir", "state")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert re.search(r"^ok +manifest +\S+/p2p_diloco/peers/demo.toml: run demo ", doctor.stdout, re.M), (
        doctor.stdout
    )
    assert re.search(
        r"^(ok|warn) +clock +\d+\.\d\d s (ahead of|behind) the peers' .*median of 1 peer\)",
        doctor.stdout,
        re.M,
    ), doctor.stdout
    assert re.search(rf"^ok +initial peer +{re.escape(address)}: accepts", doctor.stdout, re.M), doctor.stdout
    join.signal(signal.SIGTERM)
    assert join.wait(timeout=60) == 0, join.stderr_tail()
    assert any(line.startswith("stopped: versions ") for line in join.lines), join.lines[-5:]
    assert (work / "state").is_dir()
