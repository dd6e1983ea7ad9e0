"""The byte-level GPT: deterministic init, shapes, parameter naming, optimizer groups, and that it learns."""

from __future__ import annotations

import math
import re

import pytest
import torch

from p2p_diloco.config import DataConfig, ModelConfig
from p2p_diloco.model import (
    BatchSampler,
    build_model,
    embedding_parameter_names,
    evaluate,
    load_corpus,
    make_inner_optimizer,
)


def test_two_builds_are_bit_identical_and_leave_global_rng_alone():
    cfg = ModelConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, seed=7)
    rng_before = torch.get_rng_state()
    a, b = build_model(cfg).state_dict(), build_model(cfg).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_seed_changes_the_weights():
    a = build_model(ModelConfig(seed=0)).state_dict()
    b = build_model(ModelConfig(seed=1)).state_dict()
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], b["blocks.0.attn.qkv.weight"])


def test_init_values_are_sane():
    model = build_model(ModelConfig())
    params = dict(model.named_parameters())
    assert torch.all(params["blocks.0.ln1.weight"] == 1) and torch.all(params["ln_f.bias"] == 0)
    assert torch.all(params["blocks.1.mlp.fc.bias"] == 0)
    assert 0.015 < params["tok_emb.weight"].std().item() < 0.025
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_forward_shapes_and_initial_loss():
    cfg = ModelConfig()
    model = build_model(cfg)
    idx = torch.randint(0, 256, (3, cfg.block_size), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx)
    assert logits.shape == (3, cfg.block_size, 256) and loss is None
    logits, loss = model(idx[:, :10], idx[:, 1:11])
    assert logits.shape == (3, 10, 256)
    assert loss is not None and loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.3


def test_forward_rejects_sequences_longer_than_block_size():
    model = build_model(ModelConfig(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_attention_is_causal():
    model = build_model(ModelConfig(block_size=16))
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.allclose(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_parameter_names_carry_layer_index():
    cfg = ModelConfig(n_layer=3)
    names = [name for name, _ in build_model(cfg).named_parameters()]
    top_level = {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias", "head.weight"}
    layers_seen = set()
    for name in names:
        if name in top_level:
            continue
        match = re.match(r"blocks\.(\d+)\.", name)
        assert match, name
        layers_seen.add(int(match.group(1)))
    assert layers_seen == {0, 1, 2}
    assert top_level <= set(names)
    assert len(names) == len(top_level) + 3 * 12


def test_embedding_names_and_untied_head():
    model = build_model(ModelConfig())
    assert embedding_parameter_names(model) == {"tok_emb.weight", "pos_emb.weight"}
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()


def test_optimizer_decays_only_matrices_outside_embeddings():
    model = build_model(ModelConfig())
    optimizer = make_inner_optimizer(model, lr=1e-3, weight_decay=0.1)
    by_id = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {by_id[id(p)] for p in decay["params"]}
    plain = {by_id[id(p)] for p in no_decay["params"]}
    assert decayed.isdisjoint(plain) and decayed | plain == set(by_id.values())
    assert "head.weight" in decayed and "blocks.0.attn.qkv.weight" in decayed
    assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "blocks.0.attn.qkv.bias"} <= plain


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_loss_drops_over_50_steps_on_builtin_corpus(one_thread):
    cfg = ModelConfig()
    corpus = load_corpus(DataConfig())
    model = build_model(cfg)
    optimizer = make_inner_optimizer(model, lr=3e-3, weight_decay=0.1)
    sampler = BatchSampler(
        corpus.train, block_size=cfg.block_size, batch_size=8, shard=0, num_shards=1, seed=0
    )
    before = evaluate(model, corpus.eval, block_size=cfg.block_size, max_batches=2)
    for _ in range(50):
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    after = evaluate(model, corpus.eval, block_size=cfg.block_size, max_batches=2)
    assert before > 5.0
    assert after < before - 1.5, (before, after)
