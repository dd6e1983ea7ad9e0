"""The wheel carries the shipped manifests and the example tokenizer (so `p2p-diloco demo` works from it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SKIP = (".venv", ".git", "build", "*.egg-info", "__pycache__", "*-out", "data", ".*_cache", ".hypothesis")
PACKAGED = (
    "p2p_diloco/peers/demo.toml",
    "p2p_diloco/peers/llama-tiny.toml",
    "p2p_diloco/peers/public.toml",
    "p2p_diloco/peers/public.toml.sig",
    "p2p_diloco/peers/llama-tiny/tokenizer.json",
    "p2p_diloco/py.typed",
)


@pytest.mark.slow
def test_wheel_contains_the_manifests_and_the_tokenizer(tmp_path: Path):
    # build from a copy: an in-tree build leaves build/ behind, whose stale files later wheels would carry
    source = tmp_path / "src"
    shutil.copytree(REPO_ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    wheels = list(tmp_path.glob("p2p_diloco-*.whl"))
    assert len(wheels) == 1, wheels
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    missing = [name for name in PACKAGED if name not in names]
    assert not missing, f"not in the wheel: {missing}"


def test_demo_manifest_is_found_inside_the_package():
    from p2p_diloco.demo import DEMO_MANIFEST

    assert DEMO_MANIFEST.is_file()
    assert DEMO_MANIFEST.parent.parent.name == "p2p_diloco"
    assert (REPO_ROOT / "peers" / "demo.toml").resolve() == DEMO_MANIFEST.resolve()
