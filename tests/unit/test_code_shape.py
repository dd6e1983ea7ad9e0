"""scripts/code_shape.py: its histogram bins and the function measure it shares with test_module_graph."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.support.modules import function_lengths, long_functions

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "code_shape.py"


def load_script():  # noqa: ANN201 - the script's module
    spec = importlib.util.spec_from_file_location("code_shape", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_histogram_bins_are_half_open_and_keep_empty_bins():
    bins = load_script().histogram([0, 19, 20, 61], 20)
    assert [(b["lo"], b["hi"], b["count"]) for b in bins] == [
        (0, 20, 2),
        (20, 40, 1),
        (40, 60, 0),
        (60, 80, 1),
    ]
    assert load_script().histogram([], 20) == [{"lo": 0, "hi": 20, "count": 0}]


def test_function_lengths_count_nested_functions_and_long_functions_leave_out_tables():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    source = f"def build_parser():\n{body}\n    def inner():\n        pass\n"
    assert function_lengths(source, "cli.py") == {"cli.py:build_parser": 63, "cli.py:inner": 2}
    assert long_functions(source, "cli.py") == {}  # a declared table
    assert long_functions(source, "m.py") == {"m.py:build_parser": "63 lines"}
