"""Reading `p2p_diloco`'s modules and their imports with `ast` (nothing imported), for the structure tests.

`tests/unit/test_layers.py` checks the layers with it (`LAYERS`, `layer_violations`) and
`tests/unit/test_module_graph.py` the module graph (`module_graph`, `cycles`) and function lengths
(`long_functions`); `scripts/code_shape.py` measures the package with the same functions. Every import counts, at module level or inside a function; the bodies of ``if TYPE_CHECKING:``
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


def package_sources() -> dict[str, tuple[str, bool]]:
    """{module: (source, is_package)} of the whole package."""
    return {module: (path.read_text(), path.name == "__init__.py") for module, path in package_files()}


def short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def relative(path: Path) -> str:
    """A module's path below `p2p_diloco/` (`swarm/peer.py`)."""
    return path.as_posix().split(f"/{PACKAGE}/", 1)[1]


# The module graph (cycles: `tests/unit/test_module_graph.py`). An edge runs from a module to each package
# module it imports, at module level, in a function or in an ``if TYPE_CHECKING:`` block.


def targets(found: Import, modules: set[str]) -> list[str]:
    """The package modules one import statement points at."""
    if found.base not in modules:
        return []
    named = [f"{found.base}.{name}" for name in found.names if f"{found.base}.{name}" in modules]
    return named if named and len(named) == len(found.names) else [*named, found.base]


def module_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules it imports, from {module: (source, is_package)}."""
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        found = imports(ast.parse(source), module, is_package, type_checking=True)
        graph[module] = {target for item in found for target in targets(item, modules) if target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found


# Function length (`tests/unit/test_module_graph.py`): a function is capped at `MAX_FUNCTION_LINES`, its
# whole definition, except the declarative tables in `TABLES`.

MAX_FUNCTION_LINES = 60

# Functions that are declarative tables, read as a list rather than as logic (path:function).
TABLES = {"cli.py:build_parser", "node/join_command.py:add_join_command"}


def function_lengths(source: str, path: str) -> dict[str, int]:
    """`path:name` -> lines of its whole definition, for every function or method (nested ones too)."""
    return {
        f"{path}:{node.name}": node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def long_functions(source: str, path: str) -> dict[str, str]:
    """`path:name` -> its length, for every function (or method) over `MAX_FUNCTION_LINES` lines."""
    return {
        name: f"{lines} lines"
        for name, lines in function_lengths(source, path).items()
        if lines > MAX_FUNCTION_LINES and name not in TABLES
    }


# The layers of `p2p_diloco`, low to high, by top-level module or package (`tests/unit/test_layers.py`).
# A module may import from its own layer and the ones below it, never from one above. "" is the package
# root (`p2p_diloco/__init__.py`, only `__version__`). `files` (the atomic-write helper) sits at the bottom
# so `protocol` can use it. `specs` (the [model], [data] and [train] sections, re-exported by `config`) is
# a leaf, as is `schema` (pydantic sections and their error lines); `dashboard` (the run's web page) is a
# command.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "errors", "files", "owner", "schema", "specs", "manifest_types", "trust_config", "packaged"),  # 0
    ("protocol",),  # 1: pure protocol rules and the replica
    ("config",),  # 2: the run manifest
    ("model", "wire"),  # 3: the model; DHT keys, record codecs, store/transport interfaces
    ("swarm",),  # 4: the peer core
    ("net",),  # 5: hivemind DHT and libp2p transport
    ("node", "preflight"),  # 6: a real process; command-line checks before one starts
    ("baseline", "demo", "sim", "wan", "cli", "cli_peers", "doctor", "__main__", "dashboard"),  # 7: commands
)
LAYER_OF = {name: level for level, names in enumerate(LAYERS) for name in names}


def layer_violations() -> tuple[list[str], list[str], int]:
    """(modules scanned, imports from a higher layer, imports checked)."""
    modules, violations, checked = [], [], 0
    for module, path in package_files():
        modules.append(module)
        own = top_level(module)
        assert own in LAYER_OF, f"{module}: top-level `{own}` is in no layer; add it to LAYERS in {__file__}"
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in imported_modules(tree, module, path.name == "__init__.py"):
            other = top_level(target)
            if other not in LAYER_OF:  # `from p2p_diloco import __version__` and the like: the root
                other = ""
            checked += 1
            if LAYER_OF[other] > LAYER_OF[own]:
                violations.append(
                    f"{module} (layer {LAYER_OF[own]} `{own or PACKAGE}`) imports {target} "
                    f"(layer {LAYER_OF[other]} `{other or PACKAGE}`) at {path.relative_to(PACKAGE_DIR.parent)}:{line}"
                )
    return modules, violations, checked
