"""Issue #43 item 6: the volunteer's pinned install (`pip install 'WHEEL[tested]'`) is constraints.txt's
run-time part, and `--help` lists the volunteer's commands first."""

from __future__ import annotations

import signal
import tomllib
from argparse import Namespace

import pytest
from packaging.requirements import Requirement

from p2p_diloco.cli import build_parser
from p2p_diloco.errors import ConfigError
from p2p_diloco.node.join_command import cli_join_entry
from tests.support.wheel import REPO_ROOT

TEST_ONLY = {"pyarrow", "datasets", "pandas", "pytest", "pytest-timeout", "pytest-xdist", "execnet"}
TEST_ONLY |= {"hypothesis", "ruff"}


def pins(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", line
        out[req.name.lower()] = spec.version
    return out


def test_the_tested_extra_is_constraints_txt_without_the_test_tools():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extra = pins(project["optional-dependencies"]["tested"])
    text = (REPO_ROOT / "constraints.txt").read_text().splitlines()
    constrained = pins([line.split("#")[0].strip() for line in text if line.split("#")[0].strip()])
    assert extra == {name: v for name, v in constrained.items() if name not in TEST_ONLY}


def test_help_lists_the_volunteers_commands_first():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    names = [action.dest for action in sub._choices_actions]
    assert names[:5] == ["join", "status", "doctor", "keygen", "bootstrap"]
    assert names.index("simulate") > 4 and names.index("demo") > 4


def test_join_takes_sigint_back_from_an_inherited_ignore():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's background job starts
    try:
        with pytest.raises(ConfigError):  # refused at once, after the handler is back
            cli_join_entry(Namespace(hot_spare=True, standby=True))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_packaged_demo_gets_one_line_not_the_organizers_warning(monkeypatch, capsys):
    from p2p_diloco.cli import main
    from p2p_diloco.net import manifest_signature

    monkeypatch.setattr(manifest_signature, "_warned", set())  # as in a fresh process
    assert main(["status", "demo"]) == 2  # no peer to ask, after loading the manifest
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "unsigned" in line] == [
        "note: demo is a packaged example manifest, unsigned: fine for trying p2p-diloco, not for a run "
        "open to strangers (those use a signed manifest from their organizer)"
    ]
    assert not any("manifest sign" in line for line in lines)
