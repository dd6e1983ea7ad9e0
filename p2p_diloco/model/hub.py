"""Hugging Face files by name, from a local folder or the local cache, and the download policy.

Owns `downloads_allowed` / `stay_offline` (p2p-diloco never downloads unless the user opts in), and
`local_folder`: the folder behind a ``[model] pretrained`` value or a ``data prepare --tokenizer`` name.

The policy: an unset ``HF_HUB_OFFLINE`` counts as ``1``, so a Hub name (``"ORG/NAME"``) must already be in
the local cache (``$HF_HOME/hub``, by default ``~/.cache/huggingface/hub``); ``HF_HUB_OFFLINE=0`` lets the
command download what is missing (only ``*.json``, ``*.safetensors``, ``*.txt`` and ``*.model`` files: the
config, weights and tokenizer). A name that is not cached while downloads are off is a `ConfigError` that
says how to fetch it once (``HF_HUB_OFFLINE=0 p2p-diloco model-digest RUN.toml`` or ``hf download``) or
to name a local folder instead. A value that exists as a folder (relative to the manifest's folder for
``pretrained``) is always used as it is.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from p2p_diloco.errors import ConfigError

OFF_VALUES = ("0", "false", "no", "off")
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model"]  # config, weights, tokenizer files
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def downloads_allowed() -> bool:
    """True only when the user set ``HF_HUB_OFFLINE`` to 0 (or false/no/off): no surprise downloads."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in OFF_VALUES


def stay_offline() -> None:
    """Unless the user opted in, set ``HF_HUB_OFFLINE=1`` (and ``HF_DATASETS_OFFLINE=1``) for this process,
    so libraries imported after this call (huggingface_hub, datasets) stay offline."""
    if not downloads_allowed():
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"


def offline_reason() -> str:
    """Why downloads are off, as a message says it."""
    return "p2p-diloco downloads only when HF_HUB_OFFLINE=0 is set"


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def is_repo_id(name: str) -> bool:
    """`name` reads as a Hub repository ("NAME" or "ORG/NAME"), not as a path."""
    return bool(REPO_ID.fullmatch(name)) and ".." not in name


def snapshot(repo_id: str, *, what: str, fetch_hint: str) -> Path:
    """The local snapshot folder of model repository `repo_id`: from the cache, or downloaded when allowed."""
    from huggingface_hub import snapshot_download

    allowed = downloads_allowed()
    try:
        return Path(snapshot_download(repo_id, local_files_only=not allowed, allow_patterns=HUB_FILES))
    except Exception as exc:  # huggingface_hub raises its own error types (LocalEntryNotFoundError, HTTP)
        if not allowed:
            raise ConfigError(
                f"{what} {repo_id!r} is not in the local Hugging Face cache ({hub_cache()}), and downloads "
                f"are off ({offline_reason()}). Fetch it once with `{fetch_hint}` (or `hf download "
                f"{repo_id}`), or name a local folder holding its config.json and *.safetensors files"
            ) from exc
        raise ConfigError(
            f"{what} {repo_id!r} could not be downloaded ({type(exc).__name__}: {exc})"
        ) from exc


def local_folder(value: str, resolved: Path, *, what: str, fetch_hint: str) -> Path:
    """The folder `value` names: `resolved` (its path form) when that is a folder, else the Hub snapshot of
    `value` as a repository name; `ConfigError` naming the fix otherwise."""
    if resolved.is_dir():
        return resolved
    if resolved.exists():
        raise ConfigError(f"{what} {value!r} ({resolved}) is a file; give a folder or a Hub name ORG/NAME")
    if not is_repo_id(value):
        raise ConfigError(
            f"{what} {value!r}: no folder {resolved} and not a Hub name (ORG/NAME); fix the path "
            "(relative paths start at the manifest's folder)"
        )
    return snapshot(value, what=what, fetch_hint=fetch_hint)
