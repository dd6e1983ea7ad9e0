"""Layering: no module under `p2p_diloco/` imports from a higher layer (read with `ast`, nothing imported).

The layers (`LAYERS`) and the scan live in `tests/support/modules.py` (scripts/code_shape.py counts with them).

Every import counts, at module level or inside a function; only the bodies of ``if TYPE_CHECKING:``
blocks are exempt (they never run), see `tests/support/modules.py`. Imports within one layer are allowed.
"""

from __future__ import annotations

import ast

from tests.support.modules import imported_modules, layer_violations, top_level


def test_no_module_imports_from_a_higher_layer():
    modules, violations, checked = layer_violations()
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
