"""`p2p-diloco` as a hostile listed synchronizer runs it: every union round it merges is forged.

Run as ``python -m tests.support.insider_join join RUN.toml ...`` (the repository on ``sys.path``): the
normal CLI (`p2p_diloco.cli.main`) with one function patched, `Merger.merge_union`, where a sparse
round's update and its checksum are produced. The forged update lists the learners' genuine signed
deltas and their weights, as an honest one does, but claims, by its checksum, the honest merge plus
`FILL` on every weight of the fragment: the state this process installs on its own replica, serves
(snapshots, its update log, heartbeat tips) and pushes. The insider of `tests/sim/test_insider_synchronizer.py`,
in a real `join` process: no hostile flag exists in the product.

With ``INSIDER_FORGED_LOG=PATH`` in the environment, each forged update appends one JSON line to PATH:
``{"fragment", "version", "checksum", "term"}`` (the state it claims), for the test to look for it on the
honest replicas.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from p2p_diloco.cli import main
from p2p_diloco.protocol.checksum import fragment_checksum
from p2p_diloco.swarm.merging import Merger

FILL = 0.2  # what the forged result adds to every weight of the fragment
FORGED_LOG = "INSIDER_FORGED_LOG"


def forge(merge_union):  # noqa: ANN001, ANN201
    """`Merger.merge_union`, its result moved by `FILL` and the record's checksum that of the moved state."""

    def forged(self: Merger, p: int, contributions, *, live: int, term: int):  # noqa: ANN001, ANN202
        record, pending, grad = merge_union(self, p, contributions, live=live, term=term)
        params = {name: t + FILL for name, t in pending.params.items()}
        checksum = fragment_checksum(self.replica.plan.names(p), params, pending.momentum, pending.to_version)
        pending = dataclasses.replace(pending, params=params, checksum=checksum)
        path = os.environ.get(FORGED_LOG)
        if path:
            with open(path, "a") as out:
                line = {"fragment": p, "version": pending.to_version, "checksum": checksum, "term": term}
                out.write(json.dumps(line) + "\n")
        return dataclasses.replace(record, checksum=checksum), pending, grad

    return forged


def read_forged(path: str | os.PathLike[str]) -> list[dict]:
    """The forged states logged at `path` so far (none if the file is absent)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [
        json.loads(line) for line in text.splitlines() if line.endswith("}")
    ]  # a line being written: not yet


if __name__ == "__main__":
    Merger.merge_union = forge(Merger.merge_union)
    raise SystemExit(main())
