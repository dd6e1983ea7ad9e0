"""The in-process swarm on a bring-your-own run: a small Llama (`kind = "hf"`) on prepared token shards,
bf16 autocast, clipping and warmup + cosine from ``[train]``, learners sampling disjoint slices of the
memory-mapped shards. The global model's held-out loss must fall and every replica must agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import evaluate, load_corpus
from p2p_diloco.model.gpt import build_model
from p2p_diloco.model.prepare import prepare
from p2p_diloco.model.shards import TokenData, index_digest
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec

pytestmark = pytest.mark.sim

MANIFEST = """
run_id = "sim-llama"
[diloco]
inner_steps = 8
fragments = 2
batch_size = 8
inner_lr = 3e-3
outer_lr = 1.0
outer_momentum = 0.0
[model]
kind = "hf"
block_size = 32
[model.config]
model_type = "llama"
vocab_size = 256
hidden_size = 48
intermediate_size = 96
num_hidden_layers = 2
num_attention_heads = 4
max_position_embeddings = 32
[data]
source = "shards"
shards = "{shards}"
digest = "{digest}"
[train]
precision = "bf16"
grad_clip = 1.0
lr_schedule = "cosine"
warmup_steps = 5
decay_steps = 400
loss_every = 4
"""


@pytest.fixture(scope="module")
def llama_manifest(tmp_path_factory: pytest.TempPathFactory) -> RunManifest:
    folder = tmp_path_factory.mktemp("sim-llama")
    index = prepare([], folder / "shards", tokenizer="bytes", builtin=True, shard_tokens=100_000)
    path = folder / "run.toml"
    path.write_text(MANIFEST.format(shards=folder / "shards", digest=index_digest(index)))
    return RunManifest.load(path)


def test_llama_on_shards_learns_in_the_in_process_swarm(llama_manifest: RunManifest):
    corpus = load_corpus(llama_manifest.data)
    assert isinstance(corpus.train, TokenData) and len(corpus.train.arrays) > 1
    initial = evaluate(build_model(llama_manifest.model), corpus.eval, block_size=32, max_batches=4)
    spec = SwarmSpec(
        llama_manifest, learners=2, total_tokens=2 * 120 * 8 * 32, eval_every=1e9, eval_batches=4
    )
    report = InProcessSwarm(spec, corpus=corpus).run()
    print(
        f"measured: sim llama eval loss {initial:.3f} -> {report.final_eval_loss:.3f}, versions {report.versions}"
    )
    assert sum(report.versions) >= 10
    assert report.final_eval_loss < initial - 1.0
    assert report.digests_equal


def test_shards_path_is_resolved_beside_the_manifest_and_not_hashed(
    tmp_path: Path, llama_manifest: RunManifest
):
    shards = Path(llama_manifest.data.shards)
    (tmp_path / "data").symlink_to(shards)
    path = tmp_path / "run.toml"
    path.write_text(MANIFEST.format(shards="data", digest=llama_manifest.data.digest))
    manifest = RunManifest.load(path)
    assert manifest.manifest_hash == llama_manifest.manifest_hash  # the digest pins the data, not its path
    assert manifest.data.path(manifest.data.shards) == tmp_path / "data"
    assert len(load_corpus(manifest.data).train) == len(load_corpus(llama_manifest.data).train)
