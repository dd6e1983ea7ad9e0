"""Token shards on disk: the index format, its content digest, checked memory-mapped reading, per-peer
streams.

Owns the layout `p2p-diloco data prepare` writes (model/prepare.py) and everything that reads it:

    DIR/index.json        format, dtype, tokenizer {kind, digest, vocab_size, eos_id}, train shards
                          [{file, tokens, digest}], eval {file, tokens, digest}, sources (not hashed)
    DIR/train-00000.bin   flat little-endian uint16 (vocab <= 65536) or uint32 token ids
    DIR/eval.bin          the held-out split (every k-th chunk of the token stream)
    DIR/tokenizer.json    a copy of the tokenizer (absent for the byte tokenizer)

The dataset digest (`index_digest`) covers everything but `sources`: format, dtype, tokenizer digest and
every shard's digest and length. A manifest names it (``[data] digest``); `open_shards` refuses an index
or a shard file whose content differs, naming it (each file is hashed once; ``.verified.json`` remembers
it by size and modification time). Shards are `numpy.memmap`s: nothing is read whole.

`TokenData` looks enough like a 1-D tensor for `BatchSampler` and `evaluate` (`len`, `dim`, slicing,
and indexing with a LongTensor of positions, which returns int64 token ids).
`stream_seed(seed, peer_id)` seeds a peer's own deterministic stream (`model.data.make_sampler`) and
`check_vocab` refuses data whose tokenizer outgrows the model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from p2p_diloco.config import DataConfig, DataSource, ModelKind, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.external import hf_config

INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
VERIFIED_FILE = ".verified.json"  # digests checked already (`VerifiedCache`); not part of the dataset
FORMAT = "p2p_diloco.tokens.v1"
HASH_CHUNK = 1 << 22
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def file_digest(path: Path) -> str:
    """16 hex digits of blake2b over the file's bytes, read in 4 MiB chunks."""
    h = hashlib.blake2b(digest_size=8)
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def index_digest(index: dict[str, Any]) -> str:
    """The dataset's content digest: everything in the index but `sources` (where the text came from)."""
    hashed = {k: v for k, v in index.items() if k != "sources"}
    blob = json.dumps(hashed, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


class TokenData:
    """A read-only sequence of token ids over one or more memory-mapped arrays (module docstring)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = [a for a in arrays if len(a) > 0]
        self.ends = np.cumsum([len(a) for a in self.arrays], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def dim(self) -> int:
        return 1

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: slice | Tensor) -> TokenData | Tensor:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("TokenData slices must be contiguous")
            return TokenData(self._slice(start, stop))
        positions = key.numpy() if isinstance(key, Tensor) else np.asarray(key)
        flat = positions.reshape(-1).astype(np.int64)
        if len(flat) and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token positions out of range [0, {len(self)})")
        out = np.empty(len(flat), dtype=np.int64)
        which = np.searchsorted(self.ends, flat, side="right")
        starts = np.concatenate([[0], self.ends[:-1]])
        for i in np.unique(which):
            mask = which == i
            out[mask] = self.arrays[i][flat[mask] - starts[i]]
        return torch.from_numpy(out.reshape(positions.shape))

    def _slice(self, start: int, stop: int) -> list[np.ndarray]:
        parts, offset = [], 0
        for array in self.arrays:
            lo, hi = max(start - offset, 0), min(stop - offset, len(array))
            if lo < hi:
                parts.append(array[lo:hi])
            offset += len(array)
        return parts

    def long(self) -> Tensor:
        """All tokens as an int64 tensor (reads everything: small eval splits only)."""
        return self[torch.arange(len(self))]


@dataclass(frozen=True)
class Shards:
    """An opened, checked dataset: train and eval token data and the index they came from."""

    path: Path
    index: dict[str, Any]
    train: TokenData
    eval: TokenData
    digest: str

    @property
    def vocab_size(self) -> int:
        return int(self.index["tokenizer"]["vocab_size"])


def read_index(folder: Path) -> dict[str, Any]:
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        raise ConfigError(
            f"{index_path} does not exist: data.shards must name the folder `p2p-diloco data prepare --out` "
            "wrote (relative paths start at the manifest's folder); download or prepare the run's data"
        )
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{index_path} is not readable JSON ({exc}); re-download the run's data") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"{index_path} is not a {FORMAT} index; prepare it with `p2p-diloco data prepare`")
    return index


class VerifiedCache:
    """Digests already checked, by file name, size, modification time and inode (`VERIFIED_FILE` in the
    shards folder), so a restart does not hash a large dataset again; a file changed since is hashed
    again. A folder that cannot be written just goes without the cache."""

    def __init__(self, folder: Path):
        self.path = folder / VERIFIED_FILE
        try:
            self.entries: dict[str, list] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    @staticmethod
    def _key(path: Path) -> list:
        stat = path.stat()
        return [stat.st_size, stat.st_mtime_ns, stat.st_ino]

    def matches(self, path: Path, digest: str) -> bool:
        if self.entries.get(path.name) == [*self._key(path), digest]:
            return True
        if file_digest(path) != digest:
            return False
        self.entries[path.name] = [*self._key(path), digest]
        self.changed = True
        return True

    def save(self) -> None:
        if self.changed:
            try:
                self.path.write_text(json.dumps(self.entries, sort_keys=True))
            except OSError:
                pass


def _open_shard(
    folder: Path, entry: dict[str, Any], dtype: Any, what: str, cache: VerifiedCache | None
) -> np.ndarray:
    path = folder / entry["file"]
    fix = "re-download it (or prepare the data again with the run's tokenizer and inputs)"
    if not path.is_file():
        raise ConfigError(f"{what} ({path}) is missing: {fix}")
    expected = int(entry["tokens"]) * np.dtype(dtype).itemsize
    if path.stat().st_size != expected:
        raise ConfigError(f"your copy of {what} ({path}) differs from the run's (wrong size): {fix}")
    if cache is not None and not cache.matches(path, entry["digest"]):
        raise ConfigError(f"your copy of {what} ({path}) differs from the run's: {fix}")
    return np.memmap(path, dtype=dtype, mode="r")


def open_shards(folder: str | Path, digest: str | None, *, check_files: bool = True) -> Shards:
    """Open a prepared dataset; with `digest`, refuse an index or shard that is not the run's (module
    docstring). `check_files=False` skips hashing the shard files (their sizes are still checked)."""
    folder = Path(folder)
    index = read_index(folder)
    found = index_digest(index)
    if digest is not None and found != digest:
        raise ConfigError(
            f"your copy of the dataset index {folder / INDEX_FILE} (digest {found}) differs from the run's "
            f"(data.digest = {digest}): re-download the run's data"
        )
    dtype = DTYPES.get(index.get("dtype"))
    if dtype is None:
        raise ConfigError(f"{folder / INDEX_FILE}: dtype must be one of {sorted(DTYPES)}")
    cache = VerifiedCache(folder) if check_files else None
    tokenizer = index["tokenizer"]
    if tokenizer["kind"] == "file":
        tok_path = folder / TOKENIZER_FILE
        if not tok_path.is_file() or (cache is not None and not cache.matches(tok_path, tokenizer["digest"])):
            raise ConfigError(
                f"your copy of the tokenizer ({tok_path}) differs from the run's: re-download it"
            )
    train = [
        _open_shard(folder, e, dtype, f"shard {i} ({e['file']})", cache) for i, e in enumerate(index["train"])
    ]
    eval_ = _open_shard(folder, index["eval"], dtype, "the eval shard", cache)
    if cache is not None:
        cache.save()
    return Shards(folder, index, TokenData(train), TokenData([eval_]), found)


def open_run_shards(cfg: DataConfig, *, check_files: bool = True) -> Shards:
    """The shards a manifest's ``[data]`` names, checked against its digest."""
    if cfg.source != DataSource.SHARDS:
        raise ConfigError(f"data.source is {cfg.source!r}, not 'shards'")
    return open_shards(cfg.path(cfg.shards), cfg.digest, check_files=check_files)


def stream_seed(run_seed: int, peer_id: str, salt: int = 0) -> int:
    """The seed of a peer's data stream: a hash of the run's data seed, its peer ID and `salt`."""
    blob = f"p2p_diloco.stream:{run_seed}:{peer_id}:{salt}".encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") >> 1


def check_vocab(manifest: RunManifest, vocab_size: int, model_vocab: int | None = None) -> None:
    """Refuse a tokenizer whose ids the model cannot embed. `model_vocab`: the width of the model's logits
    where known (a custom model's, from `model.contract`); else it comes from the model's config."""
    model = manifest.model
    fix = "raise the model's vocab_size"
    if model_vocab is not None:
        fix = (
            f"make model.factory {model.factory!r} build a vocabulary of at least {vocab_size} "
            "([model.config])"
        )
    elif model.kind == ModelKind.GPT:
        model_vocab = 256
    elif model.kind == ModelKind.HF and model.pretrained:  # the pretrained folder's config.json
        model_vocab = int(getattr(hf_config(model), "vocab_size", 0) or vocab_size)
    elif model.kind == ModelKind.HF:
        model_vocab = int(model.resolved_config.get("vocab_size", 0)) or vocab_size
    else:
        return
    if vocab_size > model_vocab:
        raise ConfigError(
            f"the data's tokenizer has {vocab_size} tokens but the model embeds only {model_vocab}: {fix} "
            "or prepare the data with a smaller tokenizer"
        )
