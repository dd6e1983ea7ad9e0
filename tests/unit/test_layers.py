"""Layering: no module under `p2p_diloco/` imports from a higher layer (read with `ast`, nothing imported).

Every import counts, at module level or inside a function; only the bodies of ``if TYPE_CHECKING:``
blocks are exempt (they never run), see `tests/support/modules.py`. Imports within one layer are allowed.
"""

from __future__ import annotations

import ast

from tests.support.modules import PACKAGE, PACKAGE_DIR, imported_modules, package_files, top_level

# The layers of `p2p_diloco`, low to high, by top-level module or package. A module may import from its
# own layer and the ones below it, never from one above. "" is the package root (`p2p_diloco/__init__.py`,
# only `__version__`). `files` (the atomic-write helper) sits at the bottom so `protocol` can use it.
# `specs` (the [model], [data] and [train] sections, re-exported by `config`) is a leaf, as is `schema`
# (pydantic sections and their error lines); `dashboard` (the run's web page) is a command.
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


def scan() -> tuple[list[str], list[str], int]:
    """(modules scanned, violations, imports checked)."""
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


def test_no_module_imports_from_a_higher_layer():
    modules, violations, checked = scan()
    assert len(modules) > 50 and checked > 100  # the scan saw the package, not an empty folder
    assert not violations, "imports from a higher layer:\n" + "\n".join(violations)


def test_the_scanner_resolves_imports_and_skips_type_checking_blocks():
    source = (
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "from p2p_diloco.errors import ConfigError\n"
        "from p2p_diloco import node\n"
        "from . import replica\n"
        "from ..wire.keys import x\n"
        "if TYPE_CHECKING:\n"
        "    from p2p_diloco.swarm import Peer\n"
        "else:\n"
        "    import p2p_diloco.net.transport\n"
        "def f():\n"
        "    from p2p_diloco.demo import accounting\n"
    )
    found = imported_modules(ast.parse(source), "p2p_diloco.protocol.election", is_package=False)
    assert [name for _, name in found] == [
        "p2p_diloco.errors",
        "p2p_diloco.node",
        "p2p_diloco.protocol",
        "p2p_diloco.wire.keys",
        "p2p_diloco.net.transport",
        "p2p_diloco.demo",
    ]
    assert [top_level(name) for _, name in found] == ["errors", "node", "protocol", "wire", "net", "demo"]
