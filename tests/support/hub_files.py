"""Tiny Hugging Face models and datasets on disk, as a local folder or in a Hugging Face cache layout
(``HF_HOME/hub/models--ORG--NAME``, ``HF_HOME/datasets/ORG___NAME``), so tests of `pretrained` and
`data prepare --dataset` run offline: nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY_GPT2 = {"vocab_size": 256, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 16}


def tiny_gpt2(folder: Path, *, seed: int = 0, **config) -> torch.nn.Module:  # noqa: ANN003
    """A random tiny GPT-2 saved with `save_pretrained` into `folder`; returns the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(**{**TINY_GPT2, **config}))
    model.save_pretrained(str(folder))
    return model


def cache_model(hf_home: Path, repo_id: str, source: Path) -> Path:
    """Put the files of `source` into `hf_home`'s hub cache as the snapshot of model `repo_id`."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(source, snapshot)
    return snapshot


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def cache_dataset(hf_home: Path, repo_id: str, texts: list[str], scratch: Path) -> None:
    """Put a dataset of one `text` column into `hf_home`'s datasets cache as `datasets` leaves a Hub dataset
    it has loaded once (``ORG___NAME/CONFIG/VERSION/HASH``, arrow files named after the dataset)."""
    org, name = repo_id.split("/")
    scratch.mkdir(parents=True, exist_ok=True)
    source = write_jsonl(scratch / f"{name}.jsonl", texts)
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    files = DataFilesDict.from_patterns({"train": [str(source)]})
    builder = Json(cache_dir=str(scratch / "built"), dataset_name=name, data_files=files, hash=COMMIT[:16])
    builder.download_and_prepare()
    target = hf_home / "datasets" / f"{org}___{name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    (config,) = [p for p in (scratch / "built" / name).iterdir() if p.is_dir()]  # "default-<data files hash>"
    shutil.copytree(config, target / "default")  # what a Hub dataset's default configuration is called


def cli_env(hf_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a `p2p-diloco` subprocess using `hf_home` as its Hugging Face home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # this tree's package
    env.update(HF_HOME=str(hf_home), **extra)
    return env
