"""Token shards: `data prepare` output, digests refusing altered copies, memory-mapped per-peer streams."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_diloco.cli import main
from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.data import eval_split, evaluate, load_corpus, make_sampler
from p2p_diloco.model.prepare import prepare, train_tokenizer
from p2p_diloco.model.shards import (
    INDEX_FILE,
    VERIFIED_FILE,
    TokenData,
    index_digest,
)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "peer", "swarm", "delta", "model", "token", "shard"]
    jsonl = folder / "docs.jsonl"
    with jsonl.open("w") as f:
        for _ in range(1000):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 60))}) + "\n")
    txt = folder / "extra.txt"
    txt.write_text(" ".join(rng.choice(words, 3000)))
    return [str(jsonl), str(txt)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory, text_files: list[str]) -> str:
    return str(train_tokenizer(text_files, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=320))


def manifest_for(folder: Path, digest: str, tmp: Path) -> RunManifest:
    path = tmp / "run.toml"
    path.write_text(
        'run_id = "shards-test"\n[diloco]\nbatch_size = 4\n[model]\nkind = "hf"\nblock_size = 16\n'
        '[model.config]\nmodel_type = "llama"\nvocab_size = 320\nhidden_size = 32\nintermediate_size = 64\n'
        "num_hidden_layers = 1\nnum_attention_heads = 2\nmax_position_embeddings = 16\n"
        f'[data]\nsource = "shards"\nshards = "{folder}"\ndigest = "{digest}"\n'
    )
    return RunManifest.load(path)


def test_prepare_is_deterministic_and_holds_out_eval(tmp_path: Path, text_files, tokenizer):
    a = prepare(text_files, tmp_path / "a", tokenizer=tokenizer, eval_fraction=0.1, shard_tokens=4096)
    b = prepare(text_files, tmp_path / "b", tokenizer=tokenizer, eval_fraction=0.1, shard_tokens=4096)
    assert index_digest(a) == index_digest(b)
    assert len(a["train"]) > 1 and all(e["tokens"] <= 4096 for e in a["train"])
    assert a["eval"]["tokens"] > 0 and a["tokenizer"]["eos_id"] == 0 and a["dtype"] == "uint16"
    bytes_index = prepare(text_files, tmp_path / "c", tokenizer="bytes")
    assert bytes_index["tokenizer"]["kind"] == "bytes" and index_digest(bytes_index) != index_digest(a)
    with pytest.raises(ConfigError, match="not empty"):
        prepare(text_files, tmp_path / "a", tokenizer=tokenizer)


def test_streams_are_deterministic_per_peer_and_differ_between_peers(tmp_path: Path, text_files, tokenizer):
    index = prepare(text_files, tmp_path / "d", tokenizer=tokenizer, shard_tokens=4096)
    manifest = manifest_for(tmp_path / "d", index_digest(index), tmp_path)
    corpus = load_corpus(manifest.data)
    assert isinstance(corpus.train, TokenData) and len(corpus.train.arrays) > 1
    assert all(isinstance(a, np.memmap) for a in corpus.train.arrays)  # never read whole into RAM
    first = [make_sampler(manifest, "QmPeerA", corpus).next_batch()[0] for _ in range(2)]
    assert torch.equal(first[0], first[1])
    a, b = make_sampler(manifest, "QmPeerA", corpus), make_sampler(manifest, "QmPeerB", corpus)
    batches_a = [a.next_batch() for _ in range(3)]
    batches_b = [b.next_batch() for _ in range(3)]
    assert not any(torch.equal(x, y) for (x, _), (y, _) in zip(batches_a, batches_b))
    x, y = batches_a[0]
    assert x.shape == (4, 16) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 320
    # the eval split is held out and readable by `evaluate`
    from p2p_diloco.model.gpt import build_model

    loss = evaluate(build_model(manifest.model), eval_split(manifest, corpus), block_size=16, max_batches=2)
    assert 4.0 < loss < 7.0


def test_altered_shard_or_index_is_refused(tmp_path: Path, text_files, tokenizer):
    index = prepare(text_files, tmp_path / "e", tokenizer=tokenizer, shard_tokens=4096)
    manifest = manifest_for(tmp_path / "e", index_digest(index), tmp_path)
    load_corpus(manifest.data)  # checked once: remembered in .verified.json
    assert (tmp_path / "e" / VERIFIED_FILE).is_file()
    load_corpus(manifest.data)
    shard = tmp_path / "e" / index["train"][1]["file"]
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(
        ConfigError,
        match=r"your copy of shard 1 \(train-00001.bin\) .*differs from the run's: re-download it",
    ):
        load_corpus(manifest.data)
    wrong = manifest_for(tmp_path / "e", "0123456789abcdef", tmp_path)
    with pytest.raises(
        ConfigError, match="differs from the run's .data.digest = 0123456789abcdef.: re-download"
    ):
        load_corpus(wrong.data)
    (tmp_path / "e" / INDEX_FILE).unlink()
    with pytest.raises(ConfigError, match="index.json does not exist"):
        load_corpus(manifest.data)


def test_cli_prepare_prints_the_digest(tmp_path: Path, text_files, tokenizer, capsys):
    assert main(["data", "prepare", *text_files, "--tokenizer", tokenizer, "--out", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    index = json.loads((tmp_path / "f" / INDEX_FILE).read_text())
    assert f"digest: {index_digest(index)}" in out
    assert main(["data", "prepare", "missing.txt", "--out", str(tmp_path / "g")]) == 2
    assert "missing.txt does not exist" in capsys.readouterr().err


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path: Path, text_files, tokenizer):
    index = prepare(text_files, tmp_path / "h", tokenizer=tokenizer)
    manifest = manifest_for(tmp_path / "h", index_digest(index), tmp_path)
    small = RunManifest.from_dict(
        {
            **{k: v for k, v in manifest.to_dict().items() if k in ("run_id",)},
            "model": {
                "kind": "hf",
                "block_size": 16,
                "config": {**manifest.model.resolved_config, "vocab_size": 100},
            },
            "data": {"source": "shards", "shards": str(tmp_path / "h"), "digest": index_digest(index)},
        }
    )
    with pytest.raises(ConfigError, match=r"tokenizer has \d+ tokens but the model embeds only 100"):
        make_sampler(small, "QmPeer")


def test_parquet_and_jsonl_inputs_give_the_same_tokens(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"document {i}: " + "word " * (i % 50) for i in range(3000)]
    pq.write_table(pa.table({"text": texts, "id": list(range(3000))}), tmp_path / "docs.parquet")
    with (tmp_path / "docs.jsonl").open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    a = prepare([str(tmp_path / "docs.parquet")], tmp_path / "a", eval_fraction=0.2)
    b = prepare([str(tmp_path / "docs.jsonl")], tmp_path / "b", eval_fraction=0.2)
    assert index_digest(a) == index_digest(b)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(ConfigError, match="no 'text' column"):
        prepare([str(tmp_path / "nocol.parquet")], tmp_path / "c")
