"""Item 1 of #32: the version flag, the LICENSE, and the tested set inside the dependency ranges."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from p2p_diloco import __version__
from p2p_diloco.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_version_flag_prints_the_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"p2p-diloco {__version__} (Python 3.")


def test_license_is_the_apache_2_text_the_metadata_names():
    text = (REPO_ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert "Apache-2.0" in str(project["license"])


def test_tested_set_lies_inside_the_dependency_ranges():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    ranges = {Requirement(r).name.lower(): Requirement(r) for r in project["dependencies"]}
    ranges.update(
        {Requirement(r).name.lower(): Requirement(r) for r in project["optional-dependencies"]["test"]}
    )
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.lower()] = version
    assert {"hivemind", "transformers", "tokenizers", "bitsandbytes", "numpy"} <= set(pins)
    for name, version in pins.items():
        if name in ranges:
            assert ranges[name].specifier.contains(version), f"{name}=={version} outside {ranges[name]}"
    exact = [str(r) for r in ranges.values() if any(s.operator == "==" for s in r.specifier)]
    assert exact == ["ruff==0.17.6"], exact  # only the linter is pinned exactly (its rules change)
