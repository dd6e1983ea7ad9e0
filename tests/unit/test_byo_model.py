"""Bring-your-own models: `[model] kind = "hf"` / `"custom"`, seeded identical init, weights digest, init files."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.external import HFCausalLM, weights_digest
from p2p_diloco.model.gpt import build_model, embedding_parameter_names, make_inner_optimizer

LLAMA = {
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def hf_cfg(**kw) -> ModelConfig:
    return ModelConfig(kind="hf", block_size=16, config=dict(LLAMA), **kw)


def test_hf_model_is_identical_on_every_build_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(hf_cfg())
    after = torch.rand(1)
    b = build_model(hf_cfg())
    assert torch.equal(before, after)  # the seeded init ran in a forked RNG
    assert isinstance(a, HFCausalLM)
    assert weights_digest(a) == weights_digest(b)
    assert weights_digest(a) != weights_digest(build_model(hf_cfg(seed=1)))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_hf_forward_returns_logits_and_shifted_loss_and_embeddings_are_found():
    model = build_model(hf_cfg())
    x = torch.randint(0, 300, (2, 16))
    y = torch.randint(0, 300, (2, 16))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 300)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), y.reshape(-1))
    assert torch.allclose(loss, expected)
    assert embedding_parameter_names(model) == {"hf.model.embed_tokens.weight"}
    optimizer = make_inner_optimizer(model, 1e-3, 0.1)
    decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert id(dict(model.named_parameters())["hf.model.embed_tokens.weight"]) not in decayed


def test_gpt_embeddings_unchanged():
    assert embedding_parameter_names(build_model(ModelConfig())) == {"tok_emb.weight", "pos_emb.weight"}


def test_config_file_content_is_part_of_the_manifest_hash(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    manifest = tmp_path / "run.toml"
    manifest.write_text('run_id = "r"\n[model]\nkind = "hf"\nblock_size = 16\nconfig = "config.json"\n')
    first = RunManifest.load(manifest)
    assert first.model.resolved_config == LLAMA
    assert isinstance(build_model(first.model), HFCausalLM)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "hidden_size": 64}))
    assert RunManifest.load(manifest).manifest_hash != first.manifest_hash


def test_missing_config_and_init_files_are_refused_naming_them(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"model.config file .*nope.json does not exist"):
        ModelConfig(kind="hf", config="nope.json", base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"model.init .*weights.safetensors does not exist"):
        build_model(hf_cfg(init="weights.safetensors", base_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="needs a transformers config"):
        ModelConfig(kind="hf")
    with pytest.raises(ConfigError, match=r"\[model\] kind = 'jax': must be one of"):
        ModelConfig(kind="jax")


def test_init_weights_load_and_the_digest_is_checked(tmp_path: Path):
    source = build_model(hf_cfg(seed=7))
    tensors = {n.removeprefix("hf."): p.detach().clone() for n, p in source.named_parameters()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = build_model(hf_cfg(init=str(tmp_path), weights_digest=weights_digest(source)))
    assert weights_digest(loaded) == weights_digest(source)
    with pytest.raises(ConfigError, match="initial weights built here have digest"):
        build_model(hf_cfg(weights_digest="0000000000000000"))


def test_custom_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class Bigram(nn.Module):
                def __init__(self, vocab):
                    super().__init__()
                    self.emb = nn.Embedding(vocab, vocab)

                def forward(self, idx, targets=None):
                    logits = self.emb(idx)
                    loss = None if targets is None else nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                    return logits, loss

            def make(vocab=256):
                return Bigram(vocab)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = ModelConfig(kind="custom", factory="my_models:make", config={"vocab": 64})
    a, b = build_model(cfg), build_model(cfg)
    assert weights_digest(a) == weights_digest(b)
    assert embedding_parameter_names(a) == {"emb.weight"}
    with pytest.raises(ConfigError, match="cannot be imported"):
        build_model(ModelConfig(kind="custom", factory="no_such_module_xyz:make"))
    with pytest.raises(ConfigError, match="package.module:function"):
        ModelConfig(kind="custom", factory="nocolon")
    sys.modules.pop("my_models", None)


def test_config_path_is_not_hashed_only_its_content(tmp_path: Path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.json").write_text(json.dumps(LLAMA))
        (tmp_path / name / "run.toml").write_text(
            f'run_id = "r"\n[model]\nkind = "hf"\nblock_size = 16\nconfig = "{name}.json"\n'
        )
    a, b = (RunManifest.load(tmp_path / name / "run.toml") for name in ("a", "b"))
    assert a.manifest_hash == b.manifest_hash


def test_shipped_llama_tiny_manifest_builds_its_pinned_weights():
    manifest = RunManifest.load("peers/llama-tiny.toml")
    assert manifest.model.kind == "hf" and manifest.model.weights_digest
    model = build_model(manifest.model)  # checks weights_digest (this torch build)
    assert 10_000_000 <= sum(p.numel() for p in model.parameters()) <= 30_000_000
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file("peers/llama-tiny/tokenizer.json")
    assert tokenizer.get_vocab_size() == manifest.model.resolved_config["vocab_size"]
    assert tokenizer.token_to_id("<|endoftext|>") == 0
