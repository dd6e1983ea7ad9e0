"""Training text as bytes: loading the corpus, the train/eval split, per-learner batch sampling, eval loss.

Owns: `load_corpus` (Python's bundled pydoc text or the user's local files, no download),
`split_train_eval` (every k-th chunk goes to eval, so eval text is spread through the corpus and never
overlaps train), `BatchSampler` (learner `shard` of `num_shards` draws windows from its own contiguous
slice of the train bytes with its own generator; resumable) and `evaluate` (deterministic eval loss).
With `data.source = "shards"` the corpus is the run's prepared token shards (model/shards.py), memory
mapped and checked against the manifest's digest; `BatchSampler` and `evaluate` read them the same way.
`make_sampler(manifest, peer_id)` is the sampler a peer trains on (its own stream, `shards.stream_seed`)
and `eval_split` the run's held-out tokens.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from p2p_diloco.config import DataConfig, DataSource, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.shards import TokenData, check_vocab, open_run_shards, stream_seed

EVAL_CHUNK_BYTES = 4096
FILE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Corpus:
    """Train and eval bytes (1-D uint8), a human-readable `name` and a `digest` of the full text.

    Peers of one run should see the same `digest`: the builtin text depends on the Python version.
    """

    name: str
    train: Tensor | TokenData
    eval: Tensor | TokenData
    digest: str
    vocab_size: int | None = None  # ids are < vocab_size (256 for bytes)


def _bytes_to_tensor(raw: bytes) -> Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _builtin_text() -> str:
    from pydoc_data.topics import topics

    return FILE_SEPARATOR.join(topics[key] for key in sorted(topics))


def _read_text_file(path: Path) -> str:
    fix = "fix data.paths in the manifest, or set data.source = 'builtin'"
    if not path.exists():
        raise ConfigError(f"data file {path} does not exist (cwd is {Path.cwd()}); {fix}")
    if not path.is_file():
        raise ConfigError(f"data file {path} is not a regular file; {fix}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"data file {path} could not be read ({exc}); check its permissions or {fix}"
        ) from exc
    if not raw:
        raise ConfigError(f"data file {path} is empty; give a non-empty text file or {fix}")
    why = binary_reason(raw)
    if why:
        raise ConfigError(f"data file {path} is not text ({why}); give UTF-8 text files or {fix}")
    return raw.decode("utf-8", errors="replace")


BINARY_SAMPLE = 1 << 16  # bytes looked at
MAX_UNDECODABLE = 0.05  # share of replaced or control characters a text file may have


def binary_reason(raw: bytes) -> str | None:
    """Why `raw` is not text (a NUL byte, or many bytes that are not UTF-8 or are control codes), or None."""
    sample = raw[:BINARY_SAMPLE]
    nul = sample.find(b"\x00")
    if nul >= 0:
        return f"a NUL byte at offset {nul}: a binary file such as an executable or archive"
    text = sample.decode("utf-8", errors="replace")
    bad = sum(1 for c in text if c == "\ufffd" or (ord(c) < 32 and c not in "\t\n\r\f"))
    if text and bad / len(text) > MAX_UNDECODABLE:
        return f"{bad / len(text):.0%} of its first {len(sample):,} bytes are not UTF-8 text"
    return None


def split_train_eval(data: Tensor, eval_fraction: float) -> tuple[Tensor, Tensor]:
    """Hold out every k-th chunk (k = round(1 / eval_fraction)) as eval; the rest, in order, is train.

    Chunks are 4 KB, or smaller for short texts so that at least two chunks go to eval. The two parts
    partition `data`: no position is in both.
    """
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    every = max(2, round(1.0 / eval_fraction))
    if len(data) < 2 * every:
        raise ConfigError(
            f"corpus of {len(data)} bytes is too small to hold out eval_fraction={eval_fraction}; "
            "use more text in data.paths"
        )
    chunk = min(EVAL_CHUNK_BYTES, len(data) // (2 * every))
    chunk_index = torch.arange(len(data)) // chunk
    is_eval = chunk_index % every == every - 1
    return data[~is_eval], data[is_eval]


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load the text named by `cfg` as bytes and split it; deterministic, no network access.

    "builtin": Python's bundled `pydoc_data.topics` (~465 KB of English), joined in sorted key order.
    "files": `cfg.paths` in the given order (relative ones from the manifest's folder, `DataConfig.path`),
    decoded as UTF-8 with errors replaced, joined by a blank line; a binary file is refused.
    "shards": the prepared token shards `cfg.shards` (memory-mapped, checked against `cfg.digest`).
    Raises `ConfigError` naming the path for a missing, unreadable or empty file.
    """
    if cfg.source == DataSource.SHARDS:
        shards = open_run_shards(cfg)
        return Corpus(
            name=f"shards:{shards.path}",
            train=shards.train,
            eval=shards.eval,
            digest=shards.digest,
            vocab_size=shards.vocab_size,
        )
    if cfg.source == "builtin":
        text = _builtin_text()
        name = f"builtin:pydoc_data.topics@python{sys.version_info.major}.{sys.version_info.minor}"
    elif cfg.source == "files":
        if not cfg.paths:
            raise ConfigError("data.source = 'files' needs data.paths = ['corpus.txt', ...]")
        text = FILE_SEPARATOR.join(_read_text_file(cfg.path(p)) for p in cfg.paths)
        name = "files:" + ",".join(cfg.paths)
    else:
        raise ConfigError(f"data.source must be 'builtin' or 'files', got {cfg.source!r}")
    raw = text.encode("utf-8")
    data = _bytes_to_tensor(raw)
    train, eval_ = split_train_eval(data, cfg.eval_fraction)
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    return Corpus(name=name, train=train, eval=eval_, digest=digest, vocab_size=256)


def _shard_seed(seed: int, shard: int) -> int:
    blob = f"p2p_diloco.batch_sampler:{seed}:{shard}".encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") >> 1


class BatchSampler:
    """Random (x, y) windows from learner `shard`'s contiguous slice of `data`, deterministic given (seed,
    shard).

    The slice is `data[shard * L:(shard + 1) * L]` with `L = len(data) // num_shards`, so shards never
    share a byte. `x` and `y` are int64 of shape (batch_size, block_size), `y` shifted by one.
    """

    def __init__(
        self,
        data: Tensor | TokenData,
        *,
        block_size: int,
        batch_size: int,
        shard: int,
        num_shards: int,
        seed: int,
    ):
        if data.dim() != 1:
            raise ConfigError(f"BatchSampler data must be 1-D bytes, got shape {tuple(data.shape)}")
        if block_size < 1 or batch_size < 1:
            raise ConfigError(f"block_size and batch_size must be >= 1, got {block_size} and {batch_size}")
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ConfigError(f"shard must be in [0, num_shards), got shard={shard}, num_shards={num_shards}")
        shard_len = len(data) // num_shards
        if shard_len < block_size + 1:
            raise ConfigError(
                f"train data of {len(data)} bytes split into {num_shards} shards gives {shard_len} bytes per "
                f"shard, fewer than block_size + 1 = {block_size + 1}; use more text (data.paths), fewer "
                "learners or a smaller model.block_size"
            )
        self.block_size = block_size
        self.batch_size = batch_size
        self.shard = shard
        self.num_shards = num_shards
        self.seed = seed
        self.shard_data = data[shard * shard_len : (shard + 1) * shard_len]
        self.batches_drawn = 0
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(_shard_seed(seed, shard))
        self._window = torch.arange(block_size + 1)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        high = len(self.shard_data) - self.block_size  # exclusive: the last start leaves room for y
        starts = torch.randint(0, high, (self.batch_size,), generator=self._generator)
        windows = self.shard_data[starts[:, None] + self._window].long()
        self.batches_drawn += 1
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self._generator.get_state(),
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "shard": self.shard,
            "num_shards": self.num_shards,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = (self.seed, self.shard, self.num_shards)
        theirs = (state["seed"], state["shard"], state["num_shards"])
        if mine != theirs:
            raise ConfigError(
                f"sampler state is for (seed, shard, num_shards)={theirs}, this sampler is {mine}; "
                "build the sampler with the saved arguments or start it fresh"
            )
        self._generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])


@torch.no_grad()
def evaluate(
    model: nn.Module,
    eval_data: Tensor | TokenData,
    *,
    block_size: int,
    batch_size: int = 16,
    max_batches: int = 8,
) -> float:
    """Mean next-byte loss over up to `batch_size * max_batches` evenly spaced windows of `eval_data`.

    Deterministic for given weights and data; runs in eval mode under no_grad and restores the model's
    train/eval mode afterwards.
    """
    if len(eval_data) < block_size + 1:
        raise ConfigError(
            f"eval data has {len(eval_data)} bytes, fewer than block_size + 1 = {block_size + 1}; "
            "raise data.eval_fraction or use more text"
        )
    last_start = len(eval_data) - block_size - 1
    n_windows = min(batch_size * max_batches, last_start + 1)
    starts = torch.linspace(0, last_start, n_windows, dtype=torch.float64).round().long()
    offsets = torch.arange(block_size + 1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for begin in range(0, n_windows, batch_size):
            batch_starts = starts[begin : begin + batch_size]
            windows = eval_data[batch_starts[:, None] + offsets].long().to(device)
            _, loss = model(windows[:, :-1], windows[:, 1:])
            total += float(loss) * len(batch_starts)
    finally:
        model.train(was_training)
    return total / n_windows


def make_sampler(
    manifest: RunManifest, peer_id: str, corpus: Corpus | None = None, *, salt: int = 0
) -> BatchSampler:
    """The `BatchSampler` a peer trains on: `diloco.batch_size` windows of `model.block_size` tokens from
    the run's train split, drawn by a generator seeded from (`data.seed`, `peer_id`, `salt`): the same
    stream every time for one peer, a different one for every other peer. `corpus`: an already loaded
    `load_corpus(manifest.data)` (loaded here otherwise). Resumable with `state_dict`."""
    corpus = corpus if corpus is not None else load_corpus(manifest.data)
    if corpus.vocab_size is not None:
        check_vocab(manifest, corpus.vocab_size)
    return BatchSampler(
        corpus.train,
        block_size=manifest.model.block_size,
        batch_size=manifest.diloco.batch_size,
        shard=0,
        num_shards=1,
        seed=stream_seed(manifest.data.seed, peer_id, salt),
    )


def eval_split(manifest: RunManifest, corpus: Corpus | None = None) -> Tensor | TokenData:
    """The held-out tokens of the run (for `evaluate`)."""
    return (corpus if corpus is not None else load_corpus(manifest.data)).eval
