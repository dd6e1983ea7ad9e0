"""`p2p-diloco export`: write the current global model of a peer's state directory as safetensors.

The global model is the persisted replica (``replica/``, written by a running or stopped `join`),
not the peer's local training weights. The fragment plan comes from the manifest's model shapes (built
on the meta device: no weights are initialized), exactly as `join` builds it, so a replica from another
model or fragment layout is refused. ``peer_state.json``, when present, must name the manifest's run
and hash. Reading is safe while the peer runs (the replica is replaced atomically); the output is
written to a temporary file and renamed, and an existing file is kept unless `force`.

The safetensors metadata (all strings) holds: format, run_id, manifest_hash, versions and checksums
(JSON lists, one per fragment), digest (of the whole replica, as `status` shows it), peer_id and
saved_at (from ``peer_state.json``, empty if absent) and model (the manifest's model section, JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from p2p_diloco.config import ModelKind, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.external import build_skeleton
from p2p_diloco.model.gpt import GPT
from p2p_diloco.net.manifest_signature import load_run_manifest
from p2p_diloco.node.replica_store import ReplicaFileError, ReplicaStore
from p2p_diloco.node.state import PEER_STATE_FILE, REPLICA_DIR
from p2p_diloco.protocol.fragments import FragmentPlan, plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica

EXPORT_FORMAT = "p2p_diloco.global_model.v1"


class ExportError(ConfigError):
    """The state directory, manifest or output path does not allow an export; the message says why."""


def model_plan(manifest: RunManifest) -> FragmentPlan:
    """The fragment plan `join` uses for this manifest, from parameter shapes only."""
    if manifest.model.kind == ModelKind.GPT:
        with torch.device("meta"):
            model = GPT(manifest.model)
    else:
        model = build_skeleton(manifest.model)
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    return plan_fragments(shapes, manifest.diloco.fragments, manifest.diloco.fragment_pattern)


def load_global_replica(
    manifest: RunManifest, state_dir: str | os.PathLike[str]
) -> tuple[GlobalReplica, dict]:
    """The persisted replica of `state_dir` and its peer state (``{}`` if absent); `ExportError` if unusable."""
    directory = Path(state_dir)
    if not directory.is_dir():
        raise ExportError(f"--state-dir {directory} does not exist or is not a directory")
    peer_state: dict[str, Any] = {}
    state_file = directory / PEER_STATE_FILE
    if state_file.exists():
        try:
            peer_state = json.loads(state_file.read_text())
            run_id, manifest_hash = peer_state["run_id"], peer_state["manifest_hash"]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ExportError(f"{state_file} is unreadable ({exc})") from exc
        if (run_id, manifest_hash) != (manifest.run_id, manifest.manifest_hash):
            raise ExportError(
                f"--state-dir {directory} belongs to run {run_id!r} with manifest {manifest_hash}, not run "
                f"{manifest.run_id!r} with manifest {manifest.manifest_hash}: pass the manifest that peer joined with"
            )
    store = ReplicaStore(directory / REPLICA_DIR)
    if not store.exists():
        raise ExportError(
            f"--state-dir {directory} holds no replica ({REPLICA_DIR}/): a peer writes it every --persist-every "
            "seconds and when it stops"
        )
    try:
        replica = store.load(model_plan(manifest))
    except ReplicaFileError as exc:
        raise ExportError(f"cannot export: {exc}") from exc
    return replica, peer_state


def export_model(
    manifest: RunManifest,
    state_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: bool = False,
) -> dict[str, str]:
    """Write the global model of `state_dir` to `out` (safetensors); returns the metadata written."""
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to overwrite it")
    if out.exists() and out.is_dir():
        raise ExportError(f"{out} is a directory; --out takes a file name")
    if not out.parent.is_dir():
        raise ExportError(f"the folder of --out {out} does not exist")
    replica, peer_state = load_global_replica(manifest, state_dir)
    tensors = {name: t.contiguous() for name, t in replica.export_params().items()}
    metadata = {
        "format": EXPORT_FORMAT,
        "run_id": manifest.run_id,
        "manifest_hash": manifest.manifest_hash,
        "versions": json.dumps(list(replica.versions())),
        "checksums": json.dumps([replica.checksum(p) for p in range(replica.num_fragments)]),
        "digest": replica.digest(),
        "peer_id": str(peer_state.get("peer_id", "")),
        "saved_at": str(peer_state.get("saved_at", "")),
        "model": json.dumps(dataclasses.asdict(manifest.model), sort_keys=True),
    }
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, out)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return metadata


def cli_export(args: argparse.Namespace) -> int:
    """`p2p-diloco export MANIFEST --state-dir DIR --out FILE [--force]`."""
    manifest = load_run_manifest(args.manifest)
    if getattr(args, "format", "safetensors") == "hf":
        from p2p_diloco.node.export_hf import export_hf

        export_hf(manifest, args.state_dir, args.out, force=args.force)
        print(f"wrote {args.out}: transformers model and tokenizer of run {manifest.run_id}", flush=True)
        return 0
    metadata = export_model(manifest, args.state_dir, args.out, force=args.force)
    print(
        f"wrote {args.out}: global model of run {metadata['run_id']} (manifest {metadata['manifest_hash']}), "
        f"versions {json.loads(metadata['versions'])}, digest {metadata['digest'][:16]}",
        flush=True,
    )
    return 0
