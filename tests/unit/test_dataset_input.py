"""`data prepare --dataset`: text read through the `datasets` library (data files, folders, save_to_disk
folders, a Hub name from the local cache) gives the shards the same text gives as files; `--tokenizer`
takes a folder or a cached Hub name. Everything is built on disk: nothing is downloaded."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.cli import main
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.dataset_input import DatasetSpec
from p2p_diloco.model.prepare import prepare, train_tokenizer
from p2p_diloco.model.shards import index_digest
from tests.support.hub_files import cache_dataset, cache_model, cli_env, write_jsonl

datasets = pytest.importorskip("datasets")

TEXTS = [f"document {i}: the quick brown fox {i * 7} jumps over the lazy dog number {i}." for i in range(160)]


def digest_of(tmp_path: Path, name: str, inputs=(), **kw) -> str:  # noqa: ANN001, ANN003
    return index_digest(prepare(list(inputs), tmp_path / name, eval_fraction=0.25, **kw))


@pytest.fixture
def reference(tmp_path: Path) -> str:
    """The dataset digest of TEXTS given as a .jsonl input file."""
    return digest_of(tmp_path, "ref", [write_jsonl(tmp_path / "ref.jsonl", TEXTS)])


def test_a_data_file_and_a_folder_of_them_give_the_shards_of_the_same_text_as_files(tmp_path, reference):
    path = write_jsonl(tmp_path / "corpus.jsonl", TEXTS)
    assert digest_of(tmp_path, "file", dataset=DatasetSpec(str(path))) == reference
    (tmp_path / "folder").mkdir()
    datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(str(tmp_path / "folder" / "train.parquet"))
    index = prepare(
        [], tmp_path / "from-folder", eval_fraction=0.25, dataset=DatasetSpec(str(tmp_path / "folder"))
    )
    assert index_digest(index) == reference
    assert index["sources"] == [f"dataset:{tmp_path / 'folder'}:train"]


def test_a_saved_dataset_dict_gives_its_split_and_text_field(tmp_path, reference):
    splits = {"train": {"body": TEXTS}, "test": {"body": ["held out"]}}
    datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "saved")
    )
    spec = DatasetSpec(str(tmp_path / "saved"), text_field="body")
    assert digest_of(tmp_path, "saved-out", dataset=spec) == reference
    with pytest.raises(
        ConfigError, match=r"has no split 'validation'; give --split one of \['test', 'train'\]"
    ):
        prepare([], tmp_path / "x", dataset=DatasetSpec(str(tmp_path / "saved"), split="validation"))
    with pytest.raises(
        ConfigError, match=r"row 0 has no field 'text' \(fields: \['body'\]\); give --text-field"
    ):
        prepare([], tmp_path / "y", dataset=DatasetSpec(str(tmp_path / "saved")))


def test_the_cli_prepares_a_dataset_with_a_tokenizer_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "")  # restored afterwards: `data prepare` sets it for its process
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "")
    corpus = write_jsonl(tmp_path / "corpus.jsonl", TEXTS)
    train_tokenizer([str(corpus)], tmp_path / "tok" / "tokenizer.json", vocab_size=300)
    argv = ["data", "prepare", "--dataset", str(corpus), "--tokenizer", str(tmp_path / "tok")]
    assert main([*argv, "--out", str(tmp_path / "out"), "--eval-fraction", "0.25"]) == 0
    assert "digest: " in capsys.readouterr().out and (tmp_path / "out" / "tokenizer.json").is_file()
    assert (
        main(["data", "prepare", "--dataset", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")])
        == 2
    )
    assert "no such file or folder, and not a Hub name ORG/NAME" in capsys.readouterr().err
    assert (
        main(["data", "prepare", "--builtin", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "p")])
        == 2
    )
    assert f"{tmp_path} has no tokenizer.json" in capsys.readouterr().err


def run_cli(hf_home: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2p_diloco", *argv],
        env=cli_env(hf_home),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_hub_names_come_from_the_local_cache_offline_or_are_refused_with_the_fix(tmp_path, reference):
    hf_home = tmp_path / "hf"
    cache_dataset(hf_home, "tiny-org/tiny-text", TEXTS, tmp_path / "scratch")
    (tmp_path / "tok").mkdir()
    train_tokenizer([str(tmp_path / "ref.jsonl")], tmp_path / "tok" / "tokenizer.json", vocab_size=300)
    cache_model(hf_home, "tiny-org/tiny-tok", tmp_path / "tok")
    out = tmp_path / "hub-out"
    prepare_args = [
        "data",
        "prepare",
        "--dataset",
        "tiny-org/tiny-text",
        "--out",
        str(out),
        "--eval-fraction",
    ]
    result = run_cli(hf_home, *prepare_args, "0.25")
    assert result.returncode == 0, result.stderr
    assert f"digest: {reference}" in result.stdout
    shutil.rmtree(out)
    with_tok = run_cli(hf_home, *prepare_args, "0.45", "--tokenizer", "tiny-org/tiny-tok")
    assert with_tok.returncode == 0, with_tok.stderr
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    missing = run_cli(
        hf_home, "data", "prepare", "--dataset", "tiny-org/absent", "--out", str(tmp_path / "m")
    )
    assert missing.returncode == 2
    assert "'tiny-org/absent' is not in the local datasets cache and downloads are off" in missing.stderr
    assert "HF_HUB_OFFLINE=0 p2p-diloco data prepare --dataset tiny-org/absent" in missing.stderr
