"""The tiny model and manifests unit tests share (one layer, 8 wide: a step takes milliseconds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2p_diloco.config import DilocoConfig, ModelConfig, RunManifest
from p2p_diloco.model.data import BatchSampler, load_corpus
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.protocol.fragments import FragmentPlan, plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica

TINY_MODEL = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)
TINY_DILOCO = DilocoConfig(inner_steps=4, fragments=2, batch_size=2)


def tiny_manifest(run_id: str, **fields) -> RunManifest:  # noqa: ANN003
    """A manifest of the tiny model, H = 4, P = 2, batch 2; `fields` replace any other section."""
    return RunManifest(run_id=run_id, **{"model": TINY_MODEL, "diloco": TINY_DILOCO, **fields})


@dataclass
class TinyTraining:
    model: torch.nn.Module
    plan: FragmentPlan
    replica: GlobalReplica
    sampler: BatchSampler
    optimizer: torch.optim.Optimizer

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.model.named_parameters()}


def tiny_training(manifest: RunManifest, *, num_shards: int = 1, corpus=None) -> TinyTraining:  # noqa: ANN001
    """A freshly built model (seeded), its 2-fragment plan and replica, a sampler and AdamW."""
    model = build_model(manifest.model)
    plan = plan_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], 2)
    replica = GlobalReplica(plan, dict(model.named_parameters()))
    corpus = corpus if corpus is not None else load_corpus(manifest.data)
    sampler = BatchSampler(
        corpus.train,
        block_size=manifest.model.block_size,
        batch_size=manifest.diloco.batch_size,
        shard=0,
        num_shards=num_shards,
        seed=0,
    )
    return TinyTraining(model, plan, replica, sampler, make_inner_optimizer(model, 1e-2, 0.0))
