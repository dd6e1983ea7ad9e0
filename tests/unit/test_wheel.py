"""The wheel carries the shipped manifests and the example tokenizer (so `p2p-diloco demo` works from it);
tests/integration/test_wheel_install.py installs it into a clean venv and runs it."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tests.support.wheel import REPO_ROOT, build_wheel

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
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in PACKAGED if name not in names]
    assert not missing, f"not in the wheel: {missing}"
    # issue #43: one wheel for every CPython >= 3.11 of the platform (the C library is loaded with ctypes)
    assert "-py3-none-linux_" in wheel.name, wheel.name


def test_demo_manifest_is_found_inside_the_package():
    from p2p_diloco.demo import DEMO_MANIFEST

    assert DEMO_MANIFEST.is_file()
    assert DEMO_MANIFEST.parent.parent.name == "p2p_diloco"
    assert (REPO_ROOT / "peers" / "demo.toml").resolve() == DEMO_MANIFEST.resolve()
