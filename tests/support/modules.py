"""Reading `p2p_diloco`'s modules and their imports with `ast` (nothing imported), for the structure tests.

`tests/unit/test_layers.py` checks the layers with it and `tests/unit/test_module_graph.py` the module
graph. Every import counts, at module level or inside a function; the bodies of ``if TYPE_CHECKING:``
blocks (they never run) only where asked for.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "p2p_diloco"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE


@dataclass(frozen=True)
class Import:
    """One import statement: `base` is the module named (resolved if relative); `names` what `from` takes."""

    line: int
    base: str
    names: tuple[str, ...] = ()
    in_function: bool = False


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_level(module: str) -> str:
    """`p2p_diloco.swarm.peer` -> "swarm"; the package root -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_files() -> Iterator[tuple[str, Path]]:
    """(module name, path) of every module under `p2p_diloco/`, sorted by path."""
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        yield module_name(path), path


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.Module, module: str, is_package: bool, *, type_checking: bool = False) -> list[Import]:
    """Every import of the package in `tree`, relative ones resolved; those in TYPE_CHECKING blocks only
    if `type_checking` (annotations name the module: it still knows the other one)."""
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, alias.name, (), in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(Import(node.lineno, base, tuple(alias.name for alias in node.names), in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return [found_import for found_import in found if is_ours(found_import.base)]


def is_ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def imported_modules(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, p2p_diloco module) for every import of the package in `tree`, outside TYPE_CHECKING blocks.

    `from p2p_diloco import x` names `p2p_diloco.x` (x may be a subpackage or module); any other
    `from a.b import x` names `a.b`.
    """
    found: list[tuple[int, str]] = []
    for item in imports(tree, module, is_package):
        if item.base == PACKAGE and item.names:
            found.extend((item.line, f"{PACKAGE}.{name}") for name in item.names)
        else:
            found.append((item.line, item.base))
    return found
