"""Issue #43 item 1: the wheel installs on every CPython >= 3.11 of its platform.

The C kernel is plain C loaded with ctypes, so setup.py tags the wheel `py3-none-<platform>` and names the
library with a suffix every CPython 3 imports. Checked here from setup.py's commands, without a build
(tests/unit/test_wheel.py builds one)."""

from __future__ import annotations

import importlib.machinery
import runpy

from setuptools import Distribution

from tests.support.wheel import REPO_ROOT

SETUP = runpy.run_path(str(REPO_ROOT / "setup.py"), run_name="setup_under_test")


def test_the_wheel_is_tagged_for_any_python_3_of_the_platform():
    dist = Distribution({"name": "p2p_diloco", "ext_modules": SETUP["EXT_MODULES"]})
    command = SETUP["AnyPythonWheel"](dist)
    command.ensure_finalized()
    python, abi, platform = command.get_tag()
    assert (python, abi) == ("py3", "none")
    assert platform != "any" and not command.root_is_pure  # it carries a compiled library


def test_the_library_has_a_suffix_every_python_3_imports():
    dist = Distribution({"name": "p2p_diloco", "ext_modules": SETUP["EXT_MODULES"]})
    command = SETUP["PlainLibraryBuild"](dist)
    command.ensure_finalized()
    name = command.get_ext_filename("p2p_diloco.protocol._fused")
    assert name == "p2p_diloco/protocol/_fused.abi3.so"
    assert ".abi3.so" in importlib.machinery.EXTENSION_SUFFIXES
