"""`[model] pretrained`: an hf run starts from the weights of a local folder or of a Hub model in the local
cache (never downloaded unless HF_HUB_OFFLINE=0), pinned by the weights digest; `[model] dropout` reaches
every dropout probability of an hf config. Everything is built on disk here: nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2p_diloco.cli import main
from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.external import HFCausalLM, weights_digest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.model.shards import check_vocab
from p2p_diloco.net.manifest_signature import sign_manifest
from tests.support.authority import key_file, public_manifest_text
from tests.support.hub_files import cache_model, cli_env, tiny_gpt2

GPT2_DROPOUTS = ("attn_pdrop", "embd_pdrop", "resid_pdrop")


def pretrained_cfg(folder: Path, **kw) -> ModelConfig:  # noqa: ANN003
    return ModelConfig(kind="hf", block_size=16, pretrained=str(folder), **kw)


def write_manifest(folder: Path, model: str) -> Path:
    path = folder / "run.toml"
    path.write_text(f'run_id = "pre"\n[model]\nkind = "hf"\nblock_size = 16\n{model}')
    return path


def test_a_local_folder_starts_the_run_from_its_weights_with_the_manifest_dropout(tmp_path):
    saved = tiny_gpt2(tmp_path / "tiny", seed=3)
    model = build_model(pretrained_cfg(tmp_path / "tiny"))
    assert isinstance(model, HFCausalLM)
    params = dict(model.named_parameters())
    for name, value in saved.named_parameters():
        assert torch.equal(params[f"hf.{name}"], value), name
    assert all(getattr(model.config, key) == 0.0 for key in GPT2_DROPOUTS)  # GPT-2's 0.1 does not apply
    dropped = build_model(pretrained_cfg(tmp_path / "tiny", dropout=0.2))
    assert all(getattr(dropped.config, key) == 0.2 for key in GPT2_DROPOUTS)
    assert weights_digest(model) == weights_digest(build_model(pretrained_cfg(tmp_path / "tiny")))


def test_the_digest_pins_the_pretrained_weights_and_config(tmp_path):
    tiny_gpt2(tmp_path / "a", seed=0)
    tiny_gpt2(tmp_path / "b", seed=1)
    digest = weights_digest(build_model(pretrained_cfg(tmp_path / "a")))
    other = weights_digest(build_model(pretrained_cfg(tmp_path / "b")))
    assert other != digest
    build_model(pretrained_cfg(tmp_path / "a", weights_digest=digest))
    with pytest.raises(ConfigError, match=f"have digest {digest}, the run's manifest says {other}"):
        build_model(pretrained_cfg(tmp_path / "a", weights_digest=other))
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-6}))
    with pytest.raises(ConfigError, match=f"the initial weights built here have digest .* says {digest}"):
        build_model(pretrained_cfg(tmp_path / "a", weights_digest=digest))


def test_a_relative_folder_starts_at_the_manifest_and_the_pinned_name_leaves_the_hash(tmp_path):
    tiny_gpt2(tmp_path / "tiny")
    manifest = RunManifest.load(write_manifest(tmp_path, 'pretrained = "tiny"\n'))
    digest = weights_digest(build_model(manifest.model))
    pinned = RunManifest.load(write_manifest(tmp_path, f'pretrained = "tiny"\nweights_digest = "{digest}"\n'))
    moved = RunManifest.load(
        write_manifest(tmp_path, f'pretrained = "{tmp_path / "tiny"}"\nweights_digest = "{digest}"\n')
    )
    assert pinned.manifest_hash == moved.manifest_hash  # where a peer keeps the pinned folder is its own
    assert RunManifest.load(write_manifest(tmp_path, 'pretrained = "other/name"\n')).manifest_hash != (
        manifest.manifest_hash
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "hf", "pretrained": "a/b", "config": {"model_type": "gpt2"}}, "not both"),
        ({"kind": "hf", "pretrained": "a/b", "init": "w.safetensors"}, "keep one"),
        ({"kind": "gpt", "pretrained": "a/b"}, r"\[model\] pretrained = 'a/b': is for kind"),
        ({"kind": "hf"}, "needs a transformers config .* or pretrained"),
    ],
)
def test_pretrained_with_the_wrong_company_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**fields)


def test_a_hub_name_not_in_the_cache_names_the_fix_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    path = write_manifest(tmp_path, 'pretrained = "p2p-diloco-tests/not-cached"\n')
    assert main(["model-digest", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.pretrained 'p2p-diloco-tests/not-cached' is not in the local Hugging Face cache" in err
    assert "downloads are off (p2p-diloco downloads only when HF_HUB_OFFLINE=0 is set)" in err
    assert "HF_HUB_OFFLINE=0 p2p-diloco model-digest RUN.toml" in err and "hf download" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["model-digest", str(path)]) == 2
    assert "is not in the local Hugging Face cache" in capsys.readouterr().err
    missing = write_manifest(tmp_path, 'pretrained = "./no/such/folder"\n')
    assert main(["model-digest", str(missing)]) == 2
    assert "not a Hub name (ORG/NAME); fix the path" in capsys.readouterr().err


def test_a_hub_name_in_the_local_cache_builds_offline_with_the_folder_digest(tmp_path):
    tiny_gpt2(tmp_path / "tiny", seed=5)
    cache_model(tmp_path / "hf", "tiny-org/tiny-gpt2", tmp_path / "tiny")
    folder_digest = weights_digest(build_model(pretrained_cfg(tmp_path / "tiny")))
    path = write_manifest(
        tmp_path, f'pretrained = "tiny-org/tiny-gpt2"\nweights_digest = "{folder_digest}"\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "p2p_diloco", "model-digest", str(path)],
        env=cli_env(tmp_path / "hf"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert f"weights_digest: {folder_digest}" in result.stdout


def test_a_tokenizer_larger_than_the_pretrained_vocabulary_is_refused(tmp_path):
    tiny_gpt2(tmp_path / "tiny")  # vocab_size 256
    manifest = RunManifest.load(write_manifest(tmp_path, 'pretrained = "tiny"\n'))
    check_vocab(manifest, 256)
    with pytest.raises(ConfigError, match="tokenizer has 300 tokens but the model embeds only 256"):
        check_vocab(manifest, 300)


def test_signing_a_pretrained_manifest_needs_its_weights_digest(tmp_path):
    key = key_file(tmp_path)
    tiny_gpt2(tmp_path / "tiny")
    text = public_manifest_text(key.peer_id).replace(
        "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nblock_size = 8\n",
        '[model]\nkind = "hf"\nblock_size = 16\npretrained = "tiny"\n',
    )
    assert 'pretrained = "tiny"' in text
    path = tmp_path / "public.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"loads weights from 'tiny' \(\[model\]\) without weights_digest"):
        sign_manifest(path, key.path)
