"""`p2p-diloco data prepare --dataset NAME`: the text documents of a dataset read with the `datasets` library.

Owns `DatasetSpec` (what ``--dataset/--subset/--split/--text-field`` name) and `dataset_texts`. The
dataset is one of:

- a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (read with `load_from_disk`;
  a `DatasetDict` gives its `split`);
- a data file (``.jsonl``/``.json``, ``.parquet``, ``.csv``, ``.txt``: one document per line) or a folder of
  them, streamed with `load_dataset` (nothing is copied into a cache; a single file is the split "train");
- a Hub name ``ORG/NAME`` that `datasets` loaded once before, read from its local cache
  (``$HF_HOME/datasets``). Downloads follow model/hub.py's policy: off unless ``HF_HUB_OFFLINE=0``; a name not
  cached is a `ConfigError` saying how to fetch it.

Each row's `text_field` is one document, in the dataset's order (so the shards are deterministic). The
`datasets` package is optional: ``pip install 'p2p_diloco[data]'``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2p_diloco.errors import ConfigError
from p2p_diloco.model.hub import downloads_allowed, is_repo_id, offline_reason, stay_offline

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes


@dataclass(frozen=True)
class DatasetSpec:
    """What ``data prepare --dataset NAME [--subset S] [--split train] [--text-field text]`` names."""

    name: str
    split: str = "train"
    subset: str | None = None
    text_field: str = "text"

    def source(self) -> str:
        """How the index's `sources` lists it."""
        subset = f"/{self.subset}" if self.subset else ""
        return f"dataset:{self.name}{subset}:{self.split}"


def _import_datasets() -> Any:
    stay_offline()  # before the first import: datasets reads HF_HUB_OFFLINE once
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(
            "--dataset reads through the `datasets` library, which is not installed: "
            "pip install 'p2p_diloco[data]' (or pip install datasets)"
        ) from exc
    datasets.disable_progress_bars()
    return datasets


def _pick_split(loaded: Any, spec: DatasetSpec) -> Any:
    if isinstance(loaded, dict):  # a DatasetDict: one dataset per split
        splits = sorted(loaded.keys())
        if spec.split not in splits:
            raise ConfigError(
                f"--dataset {spec.name} has no split {spec.split!r}; give --split one of {splits}"
            )
        return loaded[spec.split]
    return loaded


def _open(datasets: Any, spec: DatasetSpec) -> Iterable[dict[str, Any]]:
    path = Path(spec.name).expanduser()
    if path.is_dir() and any((path / marker).is_file() for marker in SAVED_MARKERS):
        return _pick_split(datasets.load_from_disk(str(path)), spec)
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"--dataset {path}: no reader for {path.suffix!r} files; use one of {sorted(BUILDERS)}"
            )
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    if path.is_dir():
        return datasets.load_dataset(str(path), spec.subset, split=spec.split, streaming=True)
    if not is_repo_id(spec.name):
        raise ConfigError(f"--dataset {spec.name}: no such file or folder, and not a Hub name ORG/NAME")
    return datasets.load_dataset(spec.name, spec.subset, split=spec.split)


def _not_available(spec: DatasetSpec, exc: Exception) -> ConfigError:
    if Path(spec.name).expanduser().exists() or downloads_allowed():
        return ConfigError(f"--dataset {spec.name}: cannot read it ({type(exc).__name__}: {exc})")
    return ConfigError(
        f"--dataset {spec.name!r} is not in the local datasets cache "
        f"and downloads are off ({offline_reason()}). "
        f"Load it once with HF_HUB_OFFLINE=0 (e.g. `HF_HUB_OFFLINE=0 p2p-diloco data prepare --dataset "
        f"{spec.name} ...`), or give a local file or folder (.jsonl, .parquet, .csv, .txt, or save_to_disk)"
    )


def dataset_texts(spec: DatasetSpec) -> Iterator[str]:
    """The documents of `spec` in order (module docstring); `ConfigError` naming the fix when unreadable."""
    datasets = _import_datasets()
    try:
        rows = _open(datasets, spec)
    except ConfigError:
        raise
    except ValueError as exc:  # an unknown split or subset: datasets lists the valid ones
        raise ConfigError(f"--dataset {spec.name}: {exc}") from exc
    except Exception as exc:  # datasets and huggingface_hub raise many types (ConnectionError, FileNotFound)
        raise _not_available(spec, exc) from exc
    for number, row in enumerate(rows):
        if spec.text_field not in row:
            raise ConfigError(
                f"--dataset {spec.name}: row {number} has no field {spec.text_field!r} "
                f"(fields: {sorted(row)}); give --text-field"
            )
        text = row[spec.text_field]
        if text is not None:
            yield str(text)
