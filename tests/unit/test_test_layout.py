"""The test tree's layout: pytest imports the test files of unit/ and integration/ (no __init__.py) by
their base name, so two files of one name in those folders stop the whole run at collection, and the fast
tier (unit + sim) does not collect integration/ to see it.

The real-process tier (issue #42): tests that start real processes (a bootstrap, `join`s, hivemind's DHT
process and p2pd, network namespaces, a venv, chromium) are in tests/integration, tests/wan and tests/gpu.
CI runs at most `MAX_REAL_PROCESS_TESTS` of them, the cheapest that prove the wiring; every other one is
marked ``soak`` (scenarios kept for `scripts/test.sh --soak`, left to the simulator of tests/sim in CI).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
MAX_REAL_PROCESS_TESTS = 15
REAL_PROCESS_DIRS = ("tests/integration", "tests/wan", "tests/gpu")
# modules there that start no process: the WAN emulator's pure parts (no root, no namespace)
NO_PROCESS_MODULES = ("tests/wan/test_wan_pure.py",)
# the kept tier must keep proving the two baselines on hivemind
REQUIRED = (
    "tests/integration/test_baseline.py::test_two_workers_average_survive_a_kill_and_account_their_goodput",
    "tests/integration/test_baseline_diloco.py::test_two_diloco_workers_average_outer_gradients_and_survive_a_kill",
)
# what starts daemons in tests (a bootstrap, `join`s, DHT peers, a rogue's DHT peer, namespaces): a unit
# test that imports one would be a real-process test outside the tier's count
REAL_PROCESS_HELPERS = re.compile(
    r"^\s*(?:from|import)\s+(tests\.(?:integration|wan|support\.(?:real_swarm|rogue)))\b", re.M
)


def test_test_files_outside_packages_have_unique_names() -> None:
    names = Counter(
        path.name for path in TESTS.rglob("test_*.py") if not (path.parent / "__init__.py").exists()
    )
    assert not [name for name, count in names.items() if count > 1], names.most_common(3)


def kept_real_process_tests() -> list[str]:
    """The node IDs CI's default run (`-m "not soak"`) collects that start real processes. Tests marked
    ``gpu`` are left out: without CUDA (CI) they skip, and scripts/gpu_check.sh runs them on a GPU."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "not soak and not gpu", *REAL_PROCESS_DIRS],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    return [i for i in ids if not i.startswith(NO_PROCESS_MODULES)]


@pytest.mark.slow
def test_ci_runs_at_most_15_real_process_tests_and_the_baselines_among_them() -> None:
    kept = kept_real_process_tests()
    assert len(kept) <= MAX_REAL_PROCESS_TESTS, (
        f"{len(kept)} real-process tests run in CI (at most {MAX_REAL_PROCESS_TESTS}): mark a scenario "
        "`soak` (and cover it in tests/sim) or drop a test that proves the same wiring:\n" + "\n".join(kept)
    )
    assert set(REQUIRED) <= set(kept), set(REQUIRED) - set(kept)
    assert (
        '"${PYTEST[@]}" -m "not soak" tests/integration tests/wan tests/gpu'
        in (REPO / "scripts" / "test.sh").read_text()
    ), "CI's run must leave out soak"
    for node_id in kept:  # a kept test holds or fails: no runtime xfail hides a failure in CI
        path, name = node_id.split("::", 1)
        tree = ast.parse((REPO / path).read_text())
        test = next(
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name.split("[")[0]
        )
        xfails = [
            n.lineno
            for n in ast.walk(test)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "xfail"
        ]
        assert not xfails, f"{node_id} calls pytest.xfail (line {xfails}): CI's tier must hold or fail"


def test_unit_tests_start_no_daemons() -> None:
    """Unit tests may run a one-shot CLI or `python -c` subprocess (test_owner, test_cli_mistakes,
    test_dataset_input, test_pretrained, test_scale_kernels, test_wheel: seconds each) or fork a gloo pair
    (test_island_control), but start no DHT, p2pd or `join` and wait on no lease: none carries the
    real-process markers or imports the helpers that start daemons."""
    offenders = {}
    for path in sorted((TESTS / "unit").glob("test_*.py")):
        text = path.read_text()
        found = REAL_PROCESS_HELPERS.findall(text) or re.findall(r"pytest\.mark\.(integration|wan)\b", text)
        if found:
            offenders[path.name] = found
    assert not offenders, f"real-process tests belong in {REAL_PROCESS_DIRS}, counted there: {offenders}"
