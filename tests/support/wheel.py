"""The project's wheel, built from a copy of the repository, and a clean venv that installs it.

`build_wheel(dest)` builds from a copy (an in-tree build leaves build/ behind, whose stale files later
wheels would carry). `clean_venv(dest, wheel)` makes a venv without system site-packages and installs
torch (the version this interpreter runs, as scripts/_venv.sh does: first, so the project's requirement
never pulls another build) and then the wheel at the tested versions of constraints.txt, all from the
package index or pip's cache (nothing of the repository is importable from it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SKIP = (".venv", ".git", "build", "*.egg-info", "__pycache__", "*-out", "data", ".*_cache", ".hypothesis")
# pip's byte-compilation of torch, transformers and scipy is most of an install's time; imports compile
# what they load instead
PIP_INSTALL = ("-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile")


def _run(cmd: list[str], timeout: float) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)}: rc {result.returncode}\n{result.stderr[-3000:]}"


def build_wheel(dest: Path) -> Path:
    """The wheel of the repository's current files, written into `dest`."""
    source = dest / "src"
    shutil.copytree(REPO_ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest)]
    _run([*cmd, str(source)], timeout=300)
    wheels = list(dest.glob("p2p_diloco-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def clean_venv(dest: Path, wheel: Path) -> Path:
    """A new venv at `dest` with `wheel` installed; its bin directory."""
    import torch

    _run([sys.executable, "-m", "venv", str(dest)], timeout=120)  # venv starts from the base interpreter
    python = str(dest / "bin" / "python")
    torch_version = torch.__version__.split("+")[0]
    _run([python, *PIP_INSTALL, f"torch=={torch_version}"], timeout=600)
    _run([python, *PIP_INSTALL, "-c", str(REPO_ROOT / "constraints.txt"), str(wheel)], timeout=900)
    return dest / "bin"
