"""Union aggregation of sparse deltas (`protocol.union_merge`): overlap averaging, median-norm clipping,
order independence bit for bit, nothing re-sparsified, malformed input refused; and the chunked codec's
`decode_sparse` feeding it."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.protocol.union_merge import (
    SparseContribution,
    SparseTensor,
    lower_median,
    tree_sum,
    union_merge,
)
from p2p_diloco.wire.codecs.codec import decode_sparse, encode_tensors

SHAPES = {"w": (2, 5), "b": (3,)}


def _sparse(shape, entries: dict[int, float]) -> SparseTensor:
    idx = sorted(entries)
    return SparseTensor(
        shape,
        torch.tensor(idx, dtype=torch.int64),
        torch.tensor([entries[i] for i in idx], dtype=torch.float32),
    )


def _contribution(learner, weight, w: dict[int, float], b: dict[int, float], seq=1) -> SparseContribution:
    return SparseContribution(learner, seq, weight, {"w": _sparse((2, 5), w), "b": _sparse((3,), b)})


def _bits(merge) -> dict[str, bytes]:
    return {n: t.numpy().tobytes() for n, t in merge.tensors.items()}


def test_overlaps_are_weighted_means_and_the_rest_is_kept_whole():
    # equal norms (5.0 each), so nothing is clipped
    a = _contribution("a", 1.0, {0: 3.0, 4: 4.0}, {})
    b = _contribution("b", 3.0, {4: 0.0, 9: -5.0}, {})
    merge = union_merge([a, b], SHAPES)
    w = merge.tensors["w"].reshape(-1)
    assert w[0] == 3.0 and w[9] == -5.0  # sent by one learner: its value, not divided by two
    assert float(w[4]) == pytest.approx((1.0 * 4.0 + 3.0 * 0.0) / 4.0)  # overlap: token-weighted mean
    assert int((w != 0).sum()) == 3 and float(merge.tensors["b"].abs().sum()) == 0.0
    assert merge.covered == 3 and merge.median_norm == 5.0
    assert [s for _, _, s in merge.scales] == [1.0, 1.0]


def test_contributions_above_the_median_norm_are_clipped_to_it():
    small = _contribution("a", 1.0, {0: 1.0}, {})  # norm 1
    mid = _contribution("b", 1.0, {1: 2.0}, {})  # norm 2
    big = _contribution("c", 1.0, {2: 30.0}, {0: 40.0})  # norm 50 over both tensors
    merge = union_merge([big, small, mid], SHAPES)
    assert merge.median_norm == 2.0
    assert dict(((who, s) for who, _, s in merge.scales)) == {"a": 1.0, "b": 1.0, "c": 2.0 / 50.0}
    w, b = merge.tensors["w"].reshape(-1), merge.tensors["b"]
    assert w[:3].tolist() == pytest.approx([1.0, 2.0, 30.0 * 2 / 50]) and float(b[0]) == pytest.approx(
        40.0 * 2 / 50
    )
    # of an even count, the lower middle norm; one contribution is never clipped
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    alone = union_merge([big], SHAPES)
    assert alone.scales[0][2] == 1.0 and float(alone.tensors["w"].reshape(-1)[2]) == 30.0


def _random_contributions(seed: int, count: int) -> list[SparseContribution]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tensors = {}
        for name, shape in (("w", (64, 33)), ("b", (50,))):
            numel = math.prod(shape)
            keep = int(torch.randint(0, numel // 4, (1,), generator=gen))
            idx = torch.randperm(numel, generator=gen)[:keep].sort().values
            tensors[name] = SparseTensor(shape, idx, torch.randn(keep, generator=gen) * (1 + i))
        weight = float(torch.randint(1, 5000, (1,), generator=gen))
        out.append(SparseContribution(f"peer{i % 3}", i, weight, tensors))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), count=st.integers(1, 6), order_seed=st.integers(0, 1000))
def test_the_merge_is_bit_identical_in_any_arrival_order(seed, count, order_seed):
    contributions = _random_contributions(seed, count)
    shapes = {"w": (64, 33), "b": (50,)}
    reference = union_merge(contributions, shapes)
    shuffled = list(contributions)
    np.random.default_rng(order_seed).shuffle(shuffled)
    again = union_merge(shuffled, shapes)
    assert _bits(again) == _bits(reference) and again.scales == reference.scales
    # nothing re-sparsified: every index any contribution sent is set (unless its mean is exactly 0)
    for name in shapes:
        union = set().union(*(set(c.tensors[name].indices.tolist()) for c in contributions))
        nonzero = set(reference.tensors[name].reshape(-1).nonzero().reshape(-1).tolist())
        assert nonzero <= union and len(union) - len(nonzero) <= 1
    assert reference.covered == sum(
        len(set().union(*(set(c.tensors[n].indices.tolist()) for c in contributions))) for n in shapes
    )


def test_permutations_of_three_give_the_same_bits():
    contributions = _random_contributions(11, 3)
    shapes = {"w": (64, 33), "b": (50,)}
    results = {
        tuple(sorted(_bits(union_merge(list(p), shapes)).items()))
        for p in itertools.permutations(contributions)
    }
    assert len(results) == 1


def test_tree_sum_is_fixed_order_and_exact_on_small_integers():
    assert tree_sum(np.arange(1001, dtype=np.float64)) == 1000 * 1001 / 2
    assert tree_sum(np.zeros(0)) == 0.0
    x = np.random.default_rng(0).standard_normal(12345)
    assert tree_sum(x) == tree_sum(x.copy()) and tree_sum(x) == pytest.approx(float(x.sum()))


def test_malformed_contributions_are_refused():
    good = _contribution("a", 1.0, {0: 1.0}, {})
    for bad, words in [
        ([], "at least one"),
        ([good, good], "appears twice"),
        ([_contribution("a", 0.0, {0: 1.0}, {})], "weight"),
        ([_contribution("a", float("nan"), {0: 1.0}, {})], "weight"),
        ([SparseContribution("a", 1, 1.0, {"w": good.tensors["w"]})], "differ"),
        ([_contribution("a", 1.0, {0: float("inf")}, {})], "NaN or inf"),
        (
            [
                SparseContribution(
                    "a",
                    1,
                    1.0,
                    {**good.tensors, "w": SparseTensor((2, 5), torch.tensor([3, 1]), torch.ones(2))},
                )
            ],
            "strictly increasing",
        ),
        (
            [
                SparseContribution(
                    "a",
                    1,
                    1.0,
                    {**good.tensors, "w": SparseTensor((2, 5), torch.tensor([10]), torch.ones(1))},
                )
            ],
            "strictly increasing",
        ),
        ([SparseContribution("a", 1, 1.0, {**good.tensors, "w": _sparse((10,), {0: 1.0})})], "shape"),
    ]:
        with pytest.raises(ValueError, match=words):
            union_merge(bad, SHAPES)


def test_decoded_chunked_frames_merge_into_the_union():
    gen = torch.Generator().manual_seed(4)
    shapes = {"w": (100, 90)}
    frames = [
        encode_tensors({"w": torch.randn(100, 90, generator=gen)}, codec="topk4k-int2", density=0.03)
        for _ in range(4)
    ]
    contributions = [
        SparseContribution(f"p{i}", 7, 1000.0, decode_sparse(f, expected_shapes=shapes))
        for i, f in enumerate(frames)
    ]
    merge = union_merge(contributions, shapes)
    union = set().union(*(set(c.tensors["w"].indices.tolist()) for c in contributions))
    assert merge.covered == len(union) > 0.03 * 9000 * 3  # four learners' 3 % each: far more than 3 %
    assert set(merge.tensors["w"].reshape(-1).nonzero().reshape(-1).tolist()) == union
