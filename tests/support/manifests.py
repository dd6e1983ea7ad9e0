"""The tiny model and manifests the tests share.

Unit tests: `tiny_manifest` (one layer, 8 wide: a step takes milliseconds) and `tiny_training`.
Real processes (integration and WAN tiers): `tiny_swarm_toml`, the manifest file of a small run (one
layer, 32 wide, 2 fragments) with the fast timing those tests use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from p2p_diloco.config import DilocoConfig, ModelConfig, RunManifest
from p2p_diloco.model.data import BatchSampler, load_corpus
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.protocol.fragments import FragmentPlan, plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica

TINY_MODEL = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)
TINY_DILOCO = DilocoConfig(inner_steps=4, fragments=2, batch_size=2)
TINY_SWARM: dict[str, dict[str, object]] = {
    "diloco": {"inner_steps": 8, "fragments": 2, "max_in_flight": 2, "min_quorum": 1},
    "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
    "timing": {
        "heartbeat_period": 0.5,
        "heartbeat_ttl": 2.0,
        "lease_ttl": 3.0,
        "claim_grace": 1.0,
        "lease_margin": 0.5,
        "term_rounds": 1000,
        "rejoin_grace": 30.0,
    },
}


def tiny_manifest(run_id: str, **fields) -> RunManifest:  # noqa: ANN003
    """A manifest of the tiny model, H = 4, P = 2, batch 2; `fields` replace any other section."""
    return RunManifest(run_id=run_id, **{"model": TINY_MODEL, "diloco": TINY_DILOCO, **fields})


def tiny_swarm_toml(run_id: str, **sections: dict[str, object]) -> str:
    """The TOML of a small real-swarm run (`TINY_SWARM`); each of `sections` updates that section key by
    key (a None value drops the key) or adds it (e.g. ``trust={"authority": ..., "synchronizers": [...]}``)."""
    merged = {name: dict(values) for name, values in TINY_SWARM.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    lines = [f"run_id = {json.dumps(run_id)}"]
    for name, values in merged.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"


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
