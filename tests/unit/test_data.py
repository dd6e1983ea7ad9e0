"""Corpus loading, the train/eval split, sharded batch sampling with resume, and deterministic eval."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import DataConfig, ModelConfig
from p2p_diloco.errors import ConfigError
from p2p_diloco.model import BatchSampler, build_model, evaluate, load_corpus, split_train_eval


def test_builtin_corpus_is_deterministic_and_split_by_fraction():
    a, b = load_corpus(DataConfig()), load_corpus(DataConfig())
    assert a.digest == b.digest and a.name.startswith("builtin:")
    assert torch.equal(a.train, b.train) and torch.equal(a.eval, b.eval)
    assert a.train.dtype == torch.uint8 and a.eval.dtype == torch.uint8
    total = len(a.train) + len(a.eval)
    assert total > 400_000
    assert 0.03 < len(a.eval) / total < 0.07
    assert b"The " in a.train.numpy().tobytes()


def test_split_partitions_positions_and_spreads_eval():
    positions = torch.arange(100_000)
    train, eval_ = split_train_eval(positions, 0.1)
    train_set, eval_set = set(train.tolist()), set(eval_.tolist())
    assert train_set.isdisjoint(eval_set)
    assert train_set | eval_set == set(range(100_000))
    assert 0.08 < len(eval_) / 100_000 < 0.12
    assert min(eval_set) < 50_000 < max(eval_set)  # spread through the corpus, not one tail
    assert torch.all(train[1:] > train[:-1]) and torch.all(eval_[1:] > eval_[:-1])  # order kept


def test_split_of_short_text_still_holds_out_eval_and_rejects_tiny_text():
    train, eval_ = split_train_eval(torch.arange(500), 0.05)
    assert len(eval_) > 0 and len(train) > len(eval_)
    with pytest.raises(ConfigError, match="too small"):
        split_train_eval(torch.arange(10), 0.05)


def test_files_source_reads_in_order_and_replaces_bad_utf8(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_bytes(b"hello world " * 200 + b"\xff\xfe")
    second.write_text("second file " * 200)
    corpus = load_corpus(DataConfig(source="files", paths=(str(first), str(second))))
    whole = torch.cat([corpus.train, corpus.eval]).numpy().tobytes()
    assert "\ufffd".encode() in whole and b"\xff" not in whole
    assert corpus.name == f"files:{first},{second}"
    assert len(corpus.eval) > 0


@pytest.mark.parametrize("kind", ["missing", "empty", "directory"])
def test_files_source_errors_name_the_path(tmp_path, kind):
    path = tmp_path / "corpus.txt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.mkdir()
    with pytest.raises(ConfigError) as err:
        load_corpus(DataConfig(source="files", paths=(str(path),)))
    message = str(err.value)
    assert str(path) in message and "data.paths" in message
    assert {"missing": "does not exist", "empty": "is empty", "directory": "not a regular file"}[
        kind
    ] in message


def _sampler(data, shard=0, num_shards=1, seed=0, block_size=16, batch_size=4):
    return BatchSampler(
        data, block_size=block_size, batch_size=batch_size, shard=shard, num_shards=num_shards, seed=seed
    )


def test_sampler_shapes_and_shifted_targets():
    x, y = _sampler(torch.arange(1000)).next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)


def test_sampler_is_deterministic_per_seed_and_shard():
    data = load_corpus(DataConfig()).train
    a, b = _sampler(data, shard=1, num_shards=3), _sampler(data, shard=1, num_shards=3)
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(_sampler(data, seed=1).next_batch()[0], _sampler(data, seed=2).next_batch()[0])


def test_shards_draw_from_disjoint_contiguous_slices():
    positions = torch.arange(3000)
    for shard in range(3):
        sampler = _sampler(positions, shard=shard, num_shards=3, batch_size=64)
        seen = torch.cat([torch.cat(sampler.next_batch()) for _ in range(20)])
        assert seen.min() >= shard * 1000 and seen.max() < (shard + 1) * 1000
        assert seen.max() - seen.min() > 800  # covers its slice, not a corner of it


def test_sampler_resumes_from_state_dict():
    data = torch.arange(5000)
    original = _sampler(data, shard=2, num_shards=4, seed=5)
    for _ in range(3):
        original.next_batch()
    state = original.state_dict()
    expected = [original.next_batch() for _ in range(2)]
    resumed = _sampler(data, shard=2, num_shards=4, seed=5)
    resumed.load_state_dict(state)
    assert resumed.batches_drawn == 3
    for want in expected:
        got = resumed.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ConfigError, match="sampler state"):
        _sampler(data, shard=1, num_shards=4, seed=5).load_state_dict(state)


def test_sampler_validates_arguments():
    with pytest.raises(ConfigError, match="shard must be"):
        _sampler(torch.arange(1000), shard=3, num_shards=3)
    with pytest.raises(ConfigError, match="bytes per shard"):
        _sampler(torch.arange(100), num_shards=8, block_size=16)


def test_evaluate_is_deterministic_and_restores_mode():
    cfg = ModelConfig(block_size=32)
    model = build_model(cfg)
    eval_data = load_corpus(DataConfig()).eval
    model.train()
    first = evaluate(model, eval_data, block_size=32, batch_size=4, max_batches=2)
    assert model.training
    model.eval()
    second = evaluate(model, eval_data, block_size=32, batch_size=4, max_batches=2)
    assert not model.training
    assert first == second and 5.0 < first < 6.0
    other = evaluate(model, eval_data[1000:], block_size=32, batch_size=4, max_batches=2)
    assert other != first  # windows come from the data given, not a fixed sample
    with pytest.raises(ConfigError, match="eval data"):
        evaluate(model, eval_data[:20], block_size=32)
