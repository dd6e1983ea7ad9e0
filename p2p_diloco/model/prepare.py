"""`p2p-diloco data prepare` and `data tokenizer`: local text in, token shards (model/shards.py) out.

Owns reading the inputs (``.txt``/``.md`` files whole, ``.jsonl`` lines' `text` field, ``.parquet``
files' `text` column, Python's bundled pydoc text with `--builtin`, or a `datasets` dataset with
`--dataset`: model/dataset_input.py), the tokenizers (a Hugging Face `tokenizers` JSON file, a folder or
Hub name holding one, found offline by model/hub.py, or `bytes`: ids 0..255 of the UTF-8 bytes), the streaming
writer and the offline training of a byte-level BPE tokenizer. Documents are separated by the tokenizer's
end-of-text token when it has one (``<|endoftext|>``, ``</s>``, ``<eos>``), else by a blank line.

The token stream is cut into chunks of `EVAL_CHUNK_TOKENS`; every k-th chunk (k = round(1/eval_fraction))
goes to ``eval.bin``, the rest to train shards of at most `shard_tokens` tokens. Memory stays bounded by
one batch of documents plus one chunk. Output is deterministic for the same inputs, tokenizer and options.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from p2p_diloco.errors import ConfigError
from p2p_diloco.model.dataset_input import DatasetSpec, dataset_texts
from p2p_diloco.model.hub import is_repo_id, local_folder
from p2p_diloco.model.shards import (
    FORMAT,
    INDEX_FILE,
    TOKENIZER_FILE,
    file_digest,
    index_digest,
)

EVAL_CHUNK_TOKENS = 1024
ENCODE_BATCH = 256  # documents tokenized together
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BUILTIN = "builtin:pydoc_data.topics"


def iter_documents(
    inputs: Sequence[str], *, builtin: bool = False, dataset: DatasetSpec | None = None
) -> Iterator[str]:
    """The text documents of `inputs` in order (module docstring); `ConfigError` naming a bad file."""
    if builtin:
        from p2p_diloco.model.data import _builtin_text

        yield _builtin_text()
    if dataset is not None:
        yield from dataset_texts(dataset)
    for name in inputs:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"input {path} does not exist or is not a file")
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            with path.open(encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ConfigError(
                            f"{path}:{lineno}: each jsonl line must be an object with a 'text' field ({exc})"
                        ) from exc
                    yield str(text)
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as exc:
                raise ConfigError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from exc
            parquet = pq.ParquetFile(path)
            if "text" not in parquet.schema_arrow.names:
                raise ConfigError(f"{path}: no 'text' column (columns: {parquet.schema_arrow.names})")
            for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
                yield from (str(t) for t in batch.column(0).to_pylist() if t is not None)
        else:
            yield read_text(path)


def read_text(path: Path) -> str:
    """A whole text file; `ConfigError` for a binary one (an executable would tokenize into noise)."""
    from p2p_diloco.model.data import binary_reason

    raw = path.read_bytes()
    why = binary_reason(raw)
    if why:
        raise ConfigError(
            f"input {path} is not text ({why}): give UTF-8 text (.txt/.md), .jsonl or .parquet files"
        )
    return raw.decode("utf-8", errors="replace")


def tokenizer_file(spec: str) -> Path:
    """The tokenizers JSON file `spec` names: the file, ``tokenizer.json`` in a folder, or that of a Hub
    model ``ORG/NAME`` in the local cache (model/hub.py: never downloaded unless HF_HUB_OFFLINE=0)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if not path.exists() and (path.suffix == ".json" or not is_repo_id(spec)):
        raise ConfigError(
            f"--tokenizer {path} does not exist: give a tokenizer.json file, a folder or Hub name ORG/NAME "
            "holding one, or 'bytes'"
        )
    fetch = f"HF_HUB_OFFLINE=0 p2p-diloco data prepare --tokenizer {spec} ..."
    folder = local_folder(spec, path, what="--tokenizer", fetch_hint=fetch)
    if not (folder / TOKENIZER_FILE).is_file():
        raise ConfigError(
            f"--tokenizer {spec}: {folder} has no {TOKENIZER_FILE} (a fast tokenizer's file); write one with "
            "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(folder)"
        )
    return folder / TOKENIZER_FILE


class TextTokenizer:
    """`bytes` or a `tokenizers` JSON file: `encode(text) -> ids`, the document separator, index entry."""

    def __init__(self, spec: str):
        self.spec = spec
        if spec == "bytes":
            self.tokenizer = None
            self.vocab_size = 256
            self.separator = list(b"\n\n")
            self.eos_id: int | None = None
            self.digest = "bytes"
            return
        path = tokenizer_file(spec)
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own exception type
            raise ConfigError(f"--tokenizer {path} is not a tokenizers JSON file ({exc})") from exc
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = next(
            (i for t in EOS_CANDIDATES if (i := self.tokenizer.token_to_id(t)) is not None), None
        )
        self.separator = [self.eos_id] if self.eos_id is not None else self.encode("\n\n")
        self.digest = file_digest(path)
        self.path = path

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (the `tokenizers` library spreads a batch over its threads)."""
        if self.tokenizer is None:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def entry(self) -> dict[str, Any]:
        kind = "bytes" if self.tokenizer is None else "file"
        return {"kind": kind, "digest": self.digest, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class _ShardWriter:
    """Streams tokens into train shards and the eval file (module docstring)."""

    def __init__(self, out: Path, dtype: Any, eval_every: int, shard_tokens: int):
        self.out, self.dtype, self.eval_every, self.shard_tokens = out, dtype, eval_every, shard_tokens
        self.pending: list[int] = []
        self.chunks = 0
        self.train: list[dict[str, Any]] = []
        self.eval_file = (out / "eval.bin").open("wb")
        self.eval_tokens = 0
        self.shard_file = None
        self.shard_count = 0

    def add(self, ids: Iterable[int]) -> None:
        self.pending.extend(ids)
        full = len(self.pending) // EVAL_CHUNK_TOKENS * EVAL_CHUNK_TOKENS
        for start in range(0, full, EVAL_CHUNK_TOKENS):
            self._chunk(self.pending[start : start + EVAL_CHUNK_TOKENS])
        if full:
            self.pending = self.pending[full:]

    def _chunk(self, ids: list[int]) -> None:
        self.chunks += 1
        data = np.asarray(ids, dtype=self.dtype)
        if self.chunks % self.eval_every == 0:
            self.eval_file.write(data.tobytes())
            self.eval_tokens += len(data)
            return
        while len(data):
            if self.shard_file is None or self.train[-1]["tokens"] >= self.shard_tokens:
                self._new_shard()
            take = self.shard_tokens - self.train[-1]["tokens"]
            self.shard_file.write(data[:take].tobytes())
            self.train[-1]["tokens"] += len(data[:take])
            data = data[take:]

    def _new_shard(self) -> None:
        if self.shard_file is not None:
            self.shard_file.close()
        name = f"train-{self.shard_count:05d}.bin"
        self.shard_count += 1
        self.shard_file = (self.out / name).open("wb")
        self.train.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self.pending:
            self._chunk(self.pending)
            self.pending = []
        self.eval_file.close()
        if self.shard_file is not None:
            self.shard_file.close()


def prepare(
    inputs: Sequence[str],
    out: str | Path,
    *,
    tokenizer: str = "bytes",
    builtin: bool = False,
    dataset: DatasetSpec | None = None,
    eval_fraction: float = 0.05,
    shard_tokens: int = 50_000_000,
) -> dict[str, Any]:
    """Tokenize `inputs` (and `dataset`) into `out` (a new or empty folder); returns the index, whose
    digest the manifest must name (`shards.index_digest`)."""
    if not inputs and not builtin and dataset is None:
        raise ConfigError("give input files (.txt, .jsonl, .parquet), --dataset NAME or --builtin")
    if not 0.0 < eval_fraction < 0.5:
        raise ConfigError(f"--eval-fraction must be in (0, 0.5), got {eval_fraction}")
    if shard_tokens < EVAL_CHUNK_TOKENS:
        raise ConfigError(f"--shard-tokens must be >= {EVAL_CHUNK_TOKENS}, got {shard_tokens}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; give a new folder")
    tok = TextTokenizer(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    writer = _ShardWriter(out, dtype, max(2, round(1.0 / eval_fraction)), shard_tokens)
    try:
        first = True
        for batch in _batches(iter_documents(inputs, builtin=builtin, dataset=dataset), ENCODE_BATCH):
            for ids in tok.encode_batch(batch):
                if not first:
                    writer.add(tok.separator)
                writer.add(ids)
                first = False
    finally:
        writer.close()
    if not writer.train or writer.eval_tokens == 0:
        raise ConfigError(
            f"the inputs gave {sum(e['tokens'] for e in writer.train)} train and {writer.eval_tokens} eval "
            f"tokens: give more text (at least {2 * writer.eval_every * EVAL_CHUNK_TOKENS} tokens) or raise "
            "--eval-fraction"
        )
    for entry in writer.train:
        entry["digest"] = file_digest(out / entry["file"])
    if tok.tokenizer is not None:
        shutil.copyfile(tok.path, out / TOKENIZER_FILE)
    index = {
        "format": FORMAT,
        "dtype": np.dtype(dtype).name,
        "tokenizer": tok.entry(),
        "train": writer.train,
        "eval": {"file": "eval.bin", "tokens": writer.eval_tokens, "digest": file_digest(out / "eval.bin")},
        "sources": ([BUILTIN] if builtin else [])
        + ([dataset.source()] if dataset else [])
        + [os.path.basename(p) for p in inputs],
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def train_tokenizer(
    inputs: Sequence[str], out: str | Path, *, vocab_size: int = 4096, builtin: bool = False
) -> Path:
    """Train a byte-level BPE tokenizer offline (seconds on a few MB) and save it as a JSON file.

    Its specials are ``<|endoftext|>`` (id 0, the document separator) and ``<pad>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ConfigError(f"--vocab-size must be >= 300 (256 bytes + merges), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_documents(inputs, builtin=builtin), trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return out


def cli_data(args: argparse.Namespace) -> int:
    """`p2p-diloco data prepare ...` / `p2p-diloco data tokenizer ...`."""
    if args.data_command == "tokenizer":
        path = train_tokenizer(args.inputs, args.out, vocab_size=args.vocab_size, builtin=args.builtin)
        print(f"wrote {path} (byte-level BPE, {args.vocab_size} tokens, digest {file_digest(path)})")
        return 0
    dataset = None
    if getattr(args, "dataset", None):
        dataset = DatasetSpec(args.dataset, split=args.split, subset=args.subset, text_field=args.text_field)
    index = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        builtin=args.builtin,
        dataset=dataset,
        eval_fraction=args.eval_fraction,
        shard_tokens=args.shard_tokens,
    )
    train_tokens = sum(e["tokens"] for e in index["train"])
    print(
        f"wrote {args.out}: {len(index['train'])} train shards, {train_tokens} train tokens, "
        f"{index['eval']['tokens']} eval tokens ({index['dtype']})"
    )
    print(f"digest: {index_digest(index)}")
    print(
        'put in the manifest:\n[data]\nsource = "shards"\n'
        f'shards = "{args.out}"\ndigest = "{index_digest(index)}"'
    )
    return 0
