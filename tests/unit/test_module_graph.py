"""The module graph of `p2p_diloco/` (read with `ast`, nothing imported): no cycles, short functions, no packing.

The graph, the cycle finder and the function measure live in `tests/support/modules.py`
(scripts/code_shape.py reports with them too); this file holds the rules and their allowlists.

A module's length is not capped (a cap decided where code split, not the concept: issue #39); a function
is, at `MAX_FUNCTION_LINES`, except the declarative tables in `TABLES` (argument parsers).

An edge runs from a module to each package module it imports: at module level, inside a function (an
import moved into a function to dodge a cycle is still the cycle) or in an ``if TYPE_CHECKING:`` block
(a type named across the pair still ties the two together). `from pkg import name` points at the module
`pkg.name` where there is one, else at `pkg` itself.

Each rule has an allowlist of what is not fixed yet, with the reason and the helper who owns it. An entry
that is no longer needed fails the test too, so the lists only shrink: remove yours when you fix it.
"""

from __future__ import annotations

import re

from tests.support.modules import (
    MAX_FUNCTION_LINES,
    cycles,
    long_functions,
    module_graph,
    package_files,
    package_sources,
    relative,
    short,
)

# Cycles not broken yet (each a strongly connected set of modules, names below `p2p_diloco.`).
CYCLES_LEFT: dict[frozenset[str], str] = {}

# Functions over MAX_FUNCTION_LINES lines, not split yet (path below `p2p_diloco/`:function).
LONG_LEFT: dict[str, str] = {}

# Modules with `# fmt: skip` lines packed by hand, not unpacked yet.
PACKED_LEFT: dict[str, str] = {}

FMT_SKIP = re.compile(r"#\s*fmt:\s*skip")


def check_allowlist(name: str, found: dict[str, str], allowed: dict) -> list[str]:  # noqa: ANN001
    """Problems: what `found` has beyond `allowed`, and entries of `allowed` no longer found (stale)."""
    new = [f"{name}: {key} ({detail})" for key, detail in found.items() if key not in allowed]
    stale = [
        f"{name}: stale allowlist entry {key} ({allowed[key]}): remove it"
        for key in allowed
        if key not in found
    ]
    return new + stale


def test_no_cycle_between_modules():
    graph = module_graph(package_sources())
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the scan saw the package
    found = {
        frozenset(map(short, members)): " -> ".join(sorted(map(short, members))) for members in cycles(graph)
    }
    problems = check_allowlist("cycle", found, CYCLES_LEFT)
    assert not problems, "module cycles (move the shared piece down or merge the pair):\n" + "\n".join(
        problems
    )


def test_no_function_over_60_lines():
    found = {}
    for _, path in package_files():
        found.update(long_functions(path.read_text(), relative(path)))
    problems = check_allowlist("long function", found, LONG_LEFT)
    assert not problems, f"functions over {MAX_FUNCTION_LINES} lines (split by step):\n" + "\n".join(problems)


def test_the_function_rule_measures_whole_definitions():
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    assert long_functions(f"def short():\n{body}\n", "m.py") == {}  # 60 lines with its def
    assert long_functions(f"def f():\n{body}\n    return 1\n", "m.py") == {"m.py:f": "61 lines"}
    assert long_functions(f"def build_parser():\n{body}\n    return 1\n", "cli.py") == {}  # a table


def test_no_lines_packed_with_fmt_skip():
    found = {}
    for _, path in package_files():
        packed = [
            number for number, line in enumerate(path.read_text().splitlines(), 1) if FMT_SKIP.search(line)
        ]
        if packed:
            found[relative(path)] = "`# fmt: skip` at lines " + ", ".join(map(str, packed))
    problems = check_allowlist("packed", found, PACKED_LEFT)
    assert not problems, "lines packed by hand (let the formatter lay them out):\n" + "\n".join(problems)


def test_the_graph_follows_function_and_type_checking_imports_and_finds_cycles():
    sources = {
        "p2p_diloco.a": ("from p2p_diloco import b\n", False),
        "p2p_diloco.b": ("def f():\n    from p2p_diloco.c import x\n", False),
        "p2p_diloco.c": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p2p_diloco.a import A\n",
            False,
        ),
        "p2p_diloco.pkg": ("from . import leaf\nfrom .leaf import y\n", True),
        "p2p_diloco.pkg.leaf": ("import os\nfrom p2p_diloco import __version__\n", False),
        "p2p_diloco": ("__version__ = '1'\n", True),
    }
    graph = module_graph(sources)
    assert graph["p2p_diloco.a"] == {"p2p_diloco.b"}
    assert graph["p2p_diloco.b"] == {"p2p_diloco.c"}
    assert graph["p2p_diloco.c"] == {"p2p_diloco.a"}
    assert graph["p2p_diloco.pkg"] == {"p2p_diloco.pkg.leaf"}
    assert graph["p2p_diloco.pkg.leaf"] == {"p2p_diloco"}  # `__version__` is no module: the root
    assert cycles(graph) == [frozenset({"p2p_diloco.a", "p2p_diloco.b", "p2p_diloco.c"})]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []


def test_an_allowlist_entry_no_longer_needed_fails():
    assert check_allowlist("long module", {"a.py": "401 lines"}, {"a.py": "h1"}) == []
    assert check_allowlist("long module", {"a.py": "401 lines"}, {}) == ["long module: a.py (401 lines)"]
    assert check_allowlist("long module", {}, {"a.py": "h1"}) == [
        "long module: stale allowlist entry a.py (h1): remove it"
    ]
