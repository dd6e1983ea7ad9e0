"""Merge weights, delta validation and the RDA / mean merge rules on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.protocol.merge import (
    ACCEPT,
    REJECT,
    MergeTag,
    merge_deltas,
    merge_weight,
    validate_delta,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_merge_weight_is_tokens_times_tokens_per_step() -> None:
    assert merge_weight(1000, 10) == 1000 * 100
    assert merge_weight(0, 3) == 0.0
    with pytest.raises(ValueError):
        merge_weight(10, 0)
    with pytest.raises(ValueError):
        merge_weight(-1, 1)


SHAPES = {"w": (2, 2), "b": (2,)}


def good() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(2, 2), "b": torch.zeros(2)}


def test_validate_accepts_a_good_delta() -> None:
    assert validate_delta(good(), SHAPES, norm_bound=10.0).action == ACCEPT


@pytest.mark.parametrize(
    ("mutate", "tag"),
    [
        (lambda d: d.pop("b"), MergeTag.MISSING_TENSOR),
        (lambda d: d.update(extra=torch.zeros(1)), MergeTag.UNEXPECTED_TENSOR),
        (lambda d: d.update(b=torch.zeros(3)), MergeTag.WRONG_SHAPE),
        (lambda d: d.update(b=torch.zeros(2, dtype=torch.float64)), MergeTag.WRONG_DTYPE),
        (lambda d: d.update(b=torch.zeros(2, dtype=torch.bfloat16)), MergeTag.WRONG_DTYPE),
        (lambda d: d.update(b=[0.0, 0.0]), MergeTag.WRONG_DTYPE),
        (lambda d: d.update(b=t(0.0, math.nan)), MergeTag.NON_FINITE),
        (lambda d: d.update(b=t(math.inf, 0.0)), MergeTag.NON_FINITE),
        (lambda d: d.update(b=t(6.0, 8.0)), MergeTag.NORM_BOUND),  # norm 10 > 9
    ],
)
def test_validate_rejects_with_tag(mutate, tag: str) -> None:
    delta = good()
    mutate(delta)
    decision = validate_delta(delta, SHAPES, norm_bound=9.0)
    assert decision.action == REJECT
    assert decision.reason.startswith(tag), decision.reason


def test_norm_bound_is_inclusive_and_overflow_safe() -> None:
    assert validate_delta({"b": t(6.0, 8.0)}, {"b": (2,)}, norm_bound=10.0).action == ACCEPT
    # each entry is finite but a float32 sum of squares would overflow; the norm is ~4.2e38 < 1e39
    huge = {"b": t(3e38, 3e38)}
    assert validate_delta(huge, {"b": (2,)}, norm_bound=1e39).action == ACCEPT
    assert validate_delta(huge, {"b": (2,)}, norm_bound=1e38).tag == MergeTag.NORM_BOUND


def test_rda_two_opposite_vectors_cancel_to_zero() -> None:
    out = merge_deltas([{"x": t(1.0, 2.0)}, {"x": t(-1.0, -2.0)}], [1.0, 1.0])
    assert torch.equal(out["x"], t(0.0, 0.0))


def test_rda_equal_vectors_give_that_vector() -> None:
    v = t(3.0, -4.0, 12.0)
    out = merge_deltas([{"x": v}, {"x": v.clone()}, {"x": v.clone()}], [1.0, 5.0, 2.0])
    torch.testing.assert_close(out["x"], v, rtol=1e-6, atol=0)


def test_rda_orthogonal_vectors_hand_computed() -> None:
    # norms 3 and 1, weights 1 and 3: mean norm (1*3 + 3*1)/4 = 1.5;
    # mean unit vector (1*(1,0) + 3*(0,1))/4 = (0.25, 0.75), direction (1, 3)/sqrt(10).
    out = merge_deltas([{"x": t(3.0, 0.0)}, {"x": t(0.0, 1.0)}], [1.0, 3.0])
    expected = t(1.5 / math.sqrt(10), 4.5 / math.sqrt(10))
    torch.testing.assert_close(out["x"], expected, rtol=1e-6, atol=0)
    # the plain mean differs: (3*1 + 0, 0 + 1*3)/4 = (0.75, 0.75)
    mean = merge_deltas([{"x": t(3.0, 0.0)}, {"x": t(0.0, 1.0)}], [1.0, 3.0], rule="mean")
    torch.testing.assert_close(mean["x"], t(0.75, 0.75), rtol=1e-6, atol=0)


def test_rda_zero_vector_shrinks_norm_without_nan() -> None:
    out = merge_deltas([{"x": t(0.0, 0.0)}, {"x": t(2.0, 0.0)}], [1.0, 1.0])
    # mean norm (0 + 2)/2 = 1, direction (1, 0)
    assert torch.equal(out["x"], t(1.0, 0.0))
    zeros = merge_deltas([{"x": t(0.0, 0.0)}, {"x": t(0.0, 0.0)}], [1.0, 2.0])
    assert torch.equal(zeros["x"], t(0.0, 0.0))


def test_zero_weight_contributes_nothing() -> None:
    out = merge_deltas([{"x": t(5.0, 5.0)}, {"x": t(0.0, 2.0)}], [0.0, 4.0])
    torch.testing.assert_close(out["x"], t(0.0, 2.0), rtol=1e-6, atol=0)


def test_embeddings_use_plain_weighted_mean_under_rda() -> None:
    deltas = [{"emb": t(2.0, 0.0), "w": t(2.0, 0.0)}, {"emb": t(0.0, 4.0), "w": t(0.0, 4.0)}]
    out = merge_deltas(deltas, [3.0, 1.0], embedding_names={"emb", "not_in_this_fragment"})
    torch.testing.assert_close(out["emb"], t(1.5, 1.0), rtol=1e-6, atol=0)
    # "w" is merged by RDA: mean norm (3*2 + 1*4)/4 = 2.5, direction (3, 1)/sqrt(10)
    torch.testing.assert_close(out["w"], t(7.5 / math.sqrt(10), 2.5 / math.sqrt(10)), rtol=1e-6, atol=0)


def test_rda_is_per_tensor() -> None:
    # a large "a" must not change the norm of "b"
    deltas = [{"a": t(100.0, 0.0), "b": t(1.0, 0.0)}, {"a": t(100.0, 0.0), "b": t(1.0, 0.0)}]
    out = merge_deltas(deltas, [1.0, 1.0])
    assert torch.equal(out["b"], t(1.0, 0.0))
    assert out["a"].dtype == torch.float32 and out["b"].dtype == torch.float32


def test_merge_is_deterministic() -> None:
    gen = torch.Generator().manual_seed(0)
    deltas = [
        {"x": torch.randn(1000, generator=gen), "y": torch.randn(7, 3, generator=gen)} for _ in range(5)
    ]
    weights = [1.0, 2.5, 0.3, 7.0, 1e-3]
    first = merge_deltas(deltas, weights)
    again = merge_deltas([{k: v.clone() for k, v in d.items()} for d in deltas], list(weights))
    for name in first:
        assert torch.equal(first[name], again[name])


@pytest.mark.parametrize(
    ("deltas", "weights", "kwargs"),
    [
        ([], [], {}),
        ([{"x": t(1.0)}], [1.0, 2.0], {}),
        ([{"x": t(1.0)}, {"y": t(1.0)}], [1.0, 1.0], {}),
        ([{"x": t(1.0)}, {"x": t(1.0, 2.0)}], [1.0, 1.0], {}),
        ([{"x": t(1.0)}], [0.0], {}),
        ([{"x": t(1.0)}, {"x": t(1.0)}], [2.0, -1.0], {}),
        ([{"x": t(1.0)}], [math.nan], {}),
        ([{"x": t(1.0)}], [1.0], {"rule": "median"}),
    ],
)
def test_merge_rejects_bad_input(deltas, weights, kwargs) -> None:
    with pytest.raises(ValueError):
        merge_deltas(deltas, weights, **kwargs)
