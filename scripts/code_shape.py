"""The shape of the `p2p_diloco` package, measured (issue #39): import cycles, upward imports, long functions
and how long modules are.

    .venv/bin/python scripts/code_shape.py --out docs/results/code-shape

Reads the sources with `ast` (nothing imported) through the functions the structure tests use
(`tests/support/modules.py`: `module_graph` and `cycles` as in tests/unit/test_module_graph.py,
`layer_violations` and `LAYERS` as in tests/unit/test_layers.py, `function_lengths` and `TABLES`), so
the figures are the ones the tests hold the package to. Writes ``code_shape.json`` and ``code_shape.png``
(module lengths in 20-line bins, function lengths in 5-line bins) and prints a short summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.modules import (  # noqa: E402
    LAYERS,
    MAX_FUNCTION_LINES,
    PACKAGE,
    TABLES,
    cycles,
    function_lengths,
    layer_violations,
    module_graph,
    package_files,
    package_sources,
    relative,
    short,
)

MODULE_BIN = 20  # lines per bin of the module-length histogram
FUNCTION_BIN = 5
OLD_MODULE_CAP = 400  # the module-length cap issue #39 dropped: lengths used to pile up just under it


def histogram(values: list[int], width: int) -> list[dict[str, int]]:
    """Counts per bin [lo, lo + width), from 0 to the bin of the largest value, empty bins included."""
    top = max(values, default=0) // width
    counts = [0] * (top + 1)
    for value in values:
        counts[value // width] += 1
    return [{"lo": i * width, "hi": (i + 1) * width, "count": n} for i, n in enumerate(counts)]


def source_version() -> dict[str, Any]:
    """The commit measured, and whether `p2p_diloco/` differed from it (None outside a git checkout)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", PACKAGE],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "package_modified": None}
    return {"commit": commit.stdout.strip(), "package_modified": bool(dirty.stdout.strip())}


def measure() -> dict[str, Any]:
    """Everything `code_shape.json` holds."""
    graph = module_graph(package_sources())
    found_cycles = sorted(sorted(map(short, members)) for members in cycles(graph))
    scanned, upward, checked = layer_violations()
    lengths: dict[str, int] = {}
    functions: dict[str, int] = {}
    for _, path in package_files():
        text = path.read_text()
        lengths[relative(path)] = len(text.splitlines())
        functions.update(function_lengths(text, relative(path)))
    long = sorted(
        (
            {"function": name, "lines": n, "table": name in TABLES}
            for name, n in functions.items()
            if n > MAX_FUNCTION_LINES
        ),
        key=lambda row: -row["lines"],
    )
    module_lines = sorted(lengths.values())
    return {
        "package": PACKAGE,
        **source_version(),
        "modules": len(lengths),
        "import_edges": sum(map(len, graph.values())),
        "cycles": {"count": len(found_cycles), "members": found_cycles},
        "upward_imports": {
            "count": len(upward),
            "imports_checked": checked,
            "layers": [list(names) for names in LAYERS],
            "found": upward,
        },
        "functions": {
            "count": len(functions),
            "max_lines": MAX_FUNCTION_LINES,
            "over_max": len([row for row in long if not row["table"]]),
            "over_max_tables": len([row for row in long if row["table"]]),
            "long": long,
            "histogram": histogram(list(functions.values()), FUNCTION_BIN),
        },
        "module_lines": {
            "total": sum(module_lines),
            "median": statistics.median(module_lines),
            "max": module_lines[-1],
            "longest": sorted(lengths.items(), key=lambda item: -item[1])[:10],
            "over_400": len([n for n in module_lines if n > OLD_MODULE_CAP]),
            "in_380_400": len([n for n in module_lines if OLD_MODULE_CAP - MODULE_BIN <= n < OLD_MODULE_CAP]),
            "bin_lines": MODULE_BIN,
            "histogram": histogram(module_lines, MODULE_BIN),
            "by_module": dict(sorted(lengths.items())),
        },
        "modules_scanned_for_layers": len(scanned),
    }


def plot(shape: dict[str, Any], path: Path) -> None:
    """Module lengths (20-line bins, the old 400-line cap marked) beside function lengths (the 60-line cap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (modules, functions) = plt.subplots(1, 2, figsize=(12, 4))
    for ax, bins, cap, what in (
        (modules, shape["module_lines"]["histogram"], OLD_MODULE_CAP, "old module cap"),
        (functions, shape["functions"]["histogram"], MAX_FUNCTION_LINES, "function cap"),
    ):
        ax.bar([b["lo"] for b in bins], [b["count"] for b in bins], width=bins[0]["hi"], align="edge")
        ax.axvline(cap, color="red", linestyle="--", label=f"{what} ({cap} lines)")
        ax.set_ylabel("count")
        ax.legend()
    modules.set_xlabel(f"module length (lines, {MODULE_BIN}-line bins)")
    modules.set_title(f"{shape['modules']} modules of {PACKAGE}", fontsize=10)
    functions.set_xlabel(f"function length (lines of its definition, {FUNCTION_BIN}-line bins)")
    functions.set_yscale("log")
    functions.set_title(
        f"{shape['functions']['count']} functions; {shape['functions']['over_max']} over {MAX_FUNCTION_LINES} "
        f"(+{shape['functions']['over_max_tables']} declared tables)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(shape: dict[str, Any]) -> str:
    f, m = shape["functions"], shape["module_lines"]
    lines = [
        f"{shape['modules']} modules, {shape['import_edges']} import edges, {m['total']} lines",
        f"import cycles: {shape['cycles']['count']}",
        f"upward imports (layers of tests/unit/test_layers.py): {shape['upward_imports']['count']} "
        f"of {shape['upward_imports']['imports_checked']} checked",
        f"functions over {MAX_FUNCTION_LINES} lines: {f['over_max']} (+{f['over_max_tables']} declared tables) "
        f"of {f['count']}",
    ]
    lines += [
        f"  {row['lines']:4d}  {row['function']}{'  (table)' if row['table'] else ''}" for row in f["long"]
    ]
    lines.append(
        f"module lines: median {m['median']:g}, max {m['max']}; {m['over_400']} over {OLD_MODULE_CAP}, "
        f"{m['in_380_400']} in [{OLD_MODULE_CAP - MODULE_BIN}, {OLD_MODULE_CAP})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for code_shape.json and code_shape.png"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = measure()
    (args.out / "code_shape.json").write_text(json.dumps(shape, indent=1) + "\n")
    plot(shape, args.out / "code_shape.png")
    print(summary(shape))
    print(f"wrote {args.out / 'code_shape.json'} and {args.out / 'code_shape.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
