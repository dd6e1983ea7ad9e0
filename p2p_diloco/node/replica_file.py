"""The replica on disk: one file holding every fragment's Theta, momentum, version and checksum.

Written atomically (`p2p_diloco.files.atomic_file`) and read back with every fragment checked against
its checksum (`GlobalReplica.load_fragment`), so a truncated, foreign or bit-rotten file is refused with
a `ReplicaFileError` saying what is wrong, never loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from p2p_diloco.files import atomic_file
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.replica import LOAD, GlobalReplica

FILE_FORMAT = "p2p_diloco.replica"
FILE_FORMAT_VERSION = 1


class ReplicaFileError(ValueError):
    """A replica file is missing, unreadable, of another format or plan, or corrupt."""


def save_replica(replica: GlobalReplica, path: str | Path) -> None:
    """Write the whole replica to `path` atomically."""
    states = [replica.fragment_state(p) for p in range(replica.num_fragments)]
    state: dict[str, Any] = {
        "format": FILE_FORMAT,
        "format_version": FILE_FORMAT_VERSION,
        "fragments": [list(replica.plan.names(p)) for p in range(replica.num_fragments)],
        "versions": [version for version, _, _ in states],
        "checksums": [replica.checksum(p) for p in range(replica.num_fragments)],
        "params": [dict(params) for _, params, _ in states],
        "momentum": [dict(momentum) for _, _, momentum in states],
    }
    with atomic_file(Path(path)) as f:
        torch.save(state, f)


def load_replica(path: str | Path, plan: FragmentPlan) -> GlobalReplica:
    """Read a replica written by `save_replica`; raises `ReplicaFileError` saying what is wrong."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ReplicaFileError(f"replica file {path} does not exist") from exc
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise ReplicaFileError(f"replica file {path} is unreadable: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FILE_FORMAT:
        raise ReplicaFileError(f"{path} is not a p2p_diloco replica file")
    if state.get("format_version") != FILE_FORMAT_VERSION:
        raise ReplicaFileError(
            f"{path} has replica format version {state.get('format_version')}, expected {FILE_FORMAT_VERSION}"
        )
    expected = [list(plan.names(p)) for p in range(plan.num_fragments)]
    if state.get("fragments") != expected:
        raise ReplicaFileError(
            f"{path} was saved with a different fragment plan ({len(state.get('fragments') or [])} fragments); "
            "it belongs to another model or manifest"
        )
    count = plan.num_fragments
    for key, kind in (("versions", int), ("checksums", str), ("params", dict), ("momentum", dict)):
        value = state.get(key)
        if not (isinstance(value, list) and len(value) == count and all(isinstance(v, kind) for v in value)):
            raise ReplicaFileError(f"{path}: '{key}' must be a list of {count} {kind.__name__} values")
    try:
        replica = GlobalReplica(plan, {name: t for params in state["params"] for name, t in params.items()})
    except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise ReplicaFileError(f"{path}: parameters do not fit the plan: {exc}") from exc
    for p in range(count):
        decision = replica.load_fragment(
            p, state["versions"][p], state["params"][p], state["momentum"][p], state["checksums"][p]
        )
        if decision.action != LOAD:
            raise ReplicaFileError(f"{path}: fragment {p} is corrupt: {decision.reason}")
    return replica
