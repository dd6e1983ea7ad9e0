"""Issue #32: a custom factory is checked against its contract (call signature, forward output, vocabulary)
before a peer joins, each breach a `ConfigError` saying what is wrong and how to fix it (exit status 2 on
the command line). The factories are in tests/support/factories.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from p2p_diloco.cli import main
from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.contract import check_model_contract, data_vocab_size
from p2p_diloco.model.gpt import build_model
from p2p_diloco.node.assembly import prepare_training

FACTORIES = "tests.support.factories"
BLOCK = 16


def write_manifest(tmp_path: Path, factory: str, config: dict[str, Any]) -> Path:
    table = "".join(f"{key} = {value}\n" for key, value in config.items())
    path = tmp_path / "run.toml"
    path.write_text(
        f'run_id = "t"\n[model]\nkind = "custom"\nfactory = "{FACTORIES}:{factory}"\nblock_size = {BLOCK}\n'
        f"[model.config]\n{table}[diloco]\nfragments = 1\n"
    )
    return path


def probe(tmp_path: Path, factory: str, data_vocab: int | None = 256, **config: Any) -> None:
    """Build the factory's model from a manifest and probe it against a data vocabulary of `data_vocab`."""
    manifest = RunManifest.load(write_manifest(tmp_path, factory, config))
    check_model_contract(manifest, build_model(manifest.model), data_vocab)


def custom(factory: str, **config: Any) -> ModelConfig:
    return ModelConfig(kind="custom", factory=f"{FACTORIES}:{factory}", block_size=BLOCK, config=config)


def test_a_wrong_keyword_names_the_key_to_rename():
    with pytest.raises(ConfigError) as refused:
        build_model(custom("good", vocab_size=256))
    message = str(refused.value)
    assert f"model.factory '{FACTORIES}:good' takes no keyword 'vocab_size' (it takes: vocab, out)" in message
    assert "rename 'vocab_size' under [model.config]" in message


def test_a_missing_keyword_names_the_key_to_add():
    with pytest.raises(ConfigError) as refused:
        build_model(custom("needs_vocab"))
    message = str(refused.value)
    assert "needs the keyword 'vocab', which [model.config] does not set" in message
    assert "add vocab = ... under [model.config]" in message


def test_a_forward_that_returns_only_logits_is_refused(tmp_path: Path):
    with pytest.raises(
        ConfigError, match=r"returned a Tensor, not the pair \(logits, loss\): return `logits, loss`"
    ):
        probe(tmp_path, "logits_only")


def test_logits_of_the_wrong_shape_are_refused(tmp_path: Path):
    with pytest.raises(
        ConfigError, match=rf"logits have shape \({BLOCK}, 256\) for ids of shape \(1, {BLOCK}\)"
    ):
        probe(tmp_path, "flat_logits")


def test_an_embedding_smaller_than_the_data_vocabulary_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError) as refused:
        probe(tmp_path, "good", data_vocab=256, vocab=100)
    message = str(refused.value)
    assert "forward fails on token id 255 (IndexError" in message
    assert "build a vocabulary of at least that size ([model.config])" in message
    probe(tmp_path, "good", data_vocab=100, vocab=100)  # the same model fits data of its own size


def test_logits_narrower_than_the_data_vocabulary_are_refused(tmp_path: Path):
    with pytest.raises(ConfigError) as refused:
        probe(tmp_path, "good", data_vocab=256, vocab=300, out=200)
    message = str(refused.value)
    assert "the data's tokenizer has 256 tokens but the model embeds only 200" in message
    assert f"make model.factory '{FACTORIES}:good' build a vocabulary of at least 256" in message


def test_a_loss_without_targets_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"forward\(idx, None\) returned a loss \(Tensor\), not None"):
        probe(tmp_path, "always_loss")


def test_a_loss_that_is_not_finite_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="returned the loss nan on freshly built weights"):
        probe(tmp_path, "nan_loss")


def test_a_good_factory_passes_in_training_mode_with_the_global_rng_untouched(tmp_path: Path):
    manifest = RunManifest.load(write_manifest(tmp_path, "good", {"vocab": 256}))
    model = build_model(manifest.model)
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    check_model_contract(manifest, model, 256)
    check_model_contract(manifest, model, None)  # data not readable: shapes and loss only
    assert model.training
    assert torch.equal(torch.rand(1), expected)
    assert data_vocab_size(manifest.data) == 256  # builtin text: bytes


def test_the_join_preparation_probes_the_model_before_anything_starts(tmp_path: Path):
    manifest = RunManifest.load(write_manifest(tmp_path, "flat_logits", {}))
    with pytest.raises(ConfigError, match="return them as \\(batch, block_size, vocab\\)"):
        prepare_training(manifest, "cpu")
    good = RunManifest.load(write_manifest(tmp_path, "good", {}))
    assert prepare_training(good, "cpu").shapes == {"emb.weight": (256, 256)}


@pytest.mark.parametrize(
    ("factory", "config", "fix"),
    [
        ("good", {"vocab_size": 256}, "rename 'vocab_size' under [model.config]"),
        ("logits_only", {}, "return `logits, loss` (loss None when targets is None)"),
        ("good", {"vocab": 100}, "forward fails on token id 255"),
    ],
)
def test_model_digest_refuses_a_broken_factory_with_exit_status_2(tmp_path, capsys, factory, config, fix):
    assert main(["model-digest", str(write_manifest(tmp_path, factory, config))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("p2p-diloco model-digest: model.factory") or "tokenizer" in err
    assert fix in err


def test_model_digest_prints_the_digest_of_a_good_factory(tmp_path, capsys):
    assert main(["model-digest", str(write_manifest(tmp_path, "good", {"vocab": 256}))]) == 0
    assert "weights_digest:" in capsys.readouterr().out
