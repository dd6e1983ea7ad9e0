"""A baseline worker's checkpoint in its state directory: parameters, optimizer state and global epoch.

``baseline.pt`` is written atomically (temporary file, fsync, rename) from the training thread between
two steps, when no optimizer step runs. It is a restart's fallback: hivemind itself downloads the
newest state from a live peer when this peer is behind the swarm's epoch; the checkpoint matters when
no peer is ahead (the whole swarm restarted, or this peer is alone). A checkpoint of another run or
manifest, or an unreadable one, is ignored (the worker then starts from the initial weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2p_diloco.config import RunManifest
from p2p_diloco.files import atomic_file

CHECKPOINT_FILE = "baseline.pt"
FORMAT = 1


@dataclass(frozen=True)
class Checkpoint:
    epoch: int
    parameters: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # `hivemind.Optimizer.state_dict()` (holds the epoch as well)


def save_checkpoint(
    path: Path, manifest: RunManifest, model: nn.Module, optimizer_state: dict[str, Any], epoch: int
) -> None:
    """Write `path` atomically; `optimizer_state` is `hivemind.Optimizer.state_dict()`."""
    blob = {
        "format": FORMAT,
        "run_id": manifest.run_id,
        "manifest_hash": manifest.manifest_hash,
        "epoch": epoch,
        "parameters": {name: p.detach().cpu().clone() for name, p in model.named_parameters()},
        "optimizer": optimizer_state,
    }
    with atomic_file(path) as f:
        torch.save(blob, f)


def load_checkpoint(path: Path, manifest: RunManifest, model: nn.Module) -> tuple[Checkpoint | None, str]:
    """(checkpoint, "") if `path` holds a usable one for this manifest and model, else (None, why not)."""
    if not path.exists():
        return None, "no checkpoint"
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: start fresh
        return None, f"unreadable: {type(exc).__name__}: {exc}"
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        return None, "unknown format"
    if (blob.get("run_id"), blob.get("manifest_hash")) != (manifest.run_id, manifest.manifest_hash):
        return None, f"belongs to run {blob.get('run_id')!r} manifest {blob.get('manifest_hash')}"
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    params = blob.get("parameters")
    if not isinstance(params, dict) or {k: tuple(v.shape) for k, v in params.items()} != shapes:
        return None, "parameters do not match the model"
    return Checkpoint(epoch=int(blob["epoch"]), parameters=params, optimizer=blob["optimizer"]), ""
