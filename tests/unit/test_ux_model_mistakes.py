"""Issue #43 item 4: model and data mistakes refused with exit 2 and a message naming the key and value."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from p2p_diloco.cli import main
from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.data import load_corpus

HF = '[model]\nkind = "hf"\nblock_size = 32\n[model.config]\n'
SMALL = "vocab_size = 256\nhidden_size = 32\nintermediate_size = 64\nnum_attention_heads = 4\n"


def digest_error(tmp_path: Path, table: str, capsys) -> str:
    path = tmp_path / "run.toml"
    path.write_text(f'run_id = "t"\n{HF}{table}')
    assert main(["model-digest", str(path)]) == 2
    err = capsys.readouterr().err
    # one message, last, and no exception of ours (transformers' own warnings may come before it)
    assert err.splitlines()[-1].startswith("p2p-diloco model-digest: model.config."), err
    assert "AssertionError" not in err and "StrictDataclass" not in err
    return err


def test_phi3_default_pad_token_outside_the_vocabulary(tmp_path, capsys):
    err = digest_error(tmp_path, f'model_type = "phi3"\n{SMALL}num_hidden_layers = 1\n', capsys)
    assert "model.config.pad_token_id = 32000 (the phi3 default)" in err
    assert "vocab_size = 256" in err and "below 256" in err


@pytest.mark.parametrize(
    ("line", "shown"),
    [("num_hidden_layers = 2.5", "model.config.num_hidden_layers = 2.5"),
     ('num_attention_heads = "four"', "model.config.num_attention_heads = 'four'")],
)  # fmt: skip
def test_a_non_integer_config_value_names_the_key_and_value(tmp_path, capsys, line, shown):
    table = 'model_type = "llama"\nvocab_size = 256\nhidden_size = 32\n'
    if "num_hidden_layers" not in line:
        table += "num_hidden_layers = 1\n"
    err = digest_error(tmp_path, f"{table}{line}\n", capsys)
    assert shown in err and "wrong type" in err


def test_an_unknown_model_type_lists_the_closest_few(tmp_path, capsys):
    err = digest_error(tmp_path, 'model_type = "lama"\nvocab_size = 256\n', capsys)
    assert "model.config.model_type = 'lama'" in err and "llama" in err
    assert len(err) < 400, err  # not ~400 types


def test_data_prepare_refuses_a_binary_file(tmp_path, capsys):
    binary = tmp_path / "tool.txt"
    shutil.copy(sys.executable, binary)  # an executable, named like text
    assert main(["data", "prepare", str(binary), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"input {binary} is not text (a NUL byte" in err
    assert not (tmp_path / "out" / "index.json").exists()


def files_manifest(folder: Path, name: str) -> RunManifest:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.toml"
    path.write_text(f'run_id = "t"\n[data]\nsource = "files"\npaths = ["{name}"]\n')
    return RunManifest.load(path)


def test_files_source_refuses_a_binary_file(tmp_path):
    shutil.copy(sys.executable, tmp_path / "corpus.txt")
    with pytest.raises(ConfigError, match="corpus.txt is not text"):
        load_corpus(files_manifest(tmp_path, "corpus.txt").data)


def test_relative_data_paths_start_at_the_manifests_folder(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    manifest = files_manifest(run_dir, "corpus.txt")
    (run_dir / "corpus.txt").write_text("the text beside the manifest. " * 400)
    (tmp_path / "corpus.txt").write_text("another text where the command runs. " * 400)
    monkeypatch.chdir(tmp_path)
    corpus = load_corpus(manifest.data)
    assert bytes(corpus.train[:30].tolist()) == b"the text beside the manifest. "
