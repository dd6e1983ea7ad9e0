"""Evaluation of the global model a demo run has saved so far, read from its workers' state directories.

`SavedModels` owns the evaluation model and the eval text (loaded once, before the timed run) and
finds the most advanced global model on disk: for the decoupled system the replica (``replica/``) of
the state dir whose ``peer_state.json`` lists the most versions, for the baseline the checkpoint with
the highest epoch. Files being replaced at that moment are skipped until the next evaluation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import RunManifest


class SavedModels:
    """The newest saved global model of a run's state dirs, and its eval loss."""

    def __init__(self, manifest: RunManifest, *, baseline: bool):
        self.manifest = manifest
        self.baseline = baseline
        self.model: Any = None
        self.eval_data: Any = None

    def load(self) -> None:
        """Build the model and read the eval text (once)."""
        if self.model is None:
            from p2p_diloco.model.data import load_corpus
            from p2p_diloco.model.gpt import build_model

            self.model = build_model(self.manifest.model)
            self.eval_data = load_corpus(self.manifest.data).eval

    def evaluate(self, state_dirs: Iterable[Path]) -> float | None:
        """Eval loss of the most advanced global model saved in any of `state_dirs` (None if none)."""
        from p2p_diloco.model.data import evaluate

        self.load()
        assert self.model is not None
        params = self.newest_params(state_dirs)
        if params is None:
            return None
        self.model.load_state_dict(params, strict=False)
        return evaluate(self.model, self.eval_data, block_size=self.manifest.model.block_size, max_batches=4)

    def newest_params(self, state_dirs: Iterable[Path]) -> dict[str, torch.Tensor] | None:
        best: tuple[float, dict[str, torch.Tensor]] | None = None
        for state_dir in state_dirs:
            try:
                if not self.baseline:
                    progress = saved_versions(state_dir)
                    if progress is None:
                        continue
                    params = self._replica_params(state_dir)
                else:
                    from p2p_diloco.baseline.checkpoint import CHECKPOINT_FILE, load_checkpoint

                    ckpt, _ = load_checkpoint(state_dir / CHECKPOINT_FILE, self.manifest, self.model)
                    if ckpt is None:
                        continue
                    progress, params = float(ckpt.epoch), ckpt.parameters
            except Exception:  # noqa: BLE001 - a file being replaced right now: skip it this time
                continue
            if params is not None and (best is None or progress > best[0]):
                best = (progress, params)
        return best[1] if best else None

    def _replica_params(self, state_dir: Path) -> dict[str, torch.Tensor] | None:
        from p2p_diloco.node.replica_store import ReplicaStore
        from p2p_diloco.protocol.fragments import plan_fragments

        assert self.model is not None
        shapes = [(n, tuple(p.shape)) for n, p in self.model.named_parameters()]
        plan = plan_fragments(shapes, self.manifest.diloco.fragments, self.manifest.diloco.fragment_pattern)
        store = ReplicaStore(state_dir / "replica")
        return store.load(plan).export_params() if store.exists() else None


def saved_versions(state_dir: Path) -> float | None:
    """Sum of the fragment versions a decoupled worker last persisted (None if it has not yet)."""
    try:
        state = json.loads((state_dir / "peer_state.json").read_text())
    except (OSError, ValueError):
        return None
    return float(sum(state.get("versions", [])))
