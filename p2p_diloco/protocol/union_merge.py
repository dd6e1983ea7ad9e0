"""Union aggregation of a round's sparse deltas, as SparseLoCo merges them: pure, no I/O.

A sparse round's outer gradient is exactly the merge of the accepted sparse contributions, nothing of it
re-sparsified or left in a residual:

1. Each contribution's L2 norm (over all its tensors' sent values) is computed, and every contribution
   whose norm exceeds the round's median norm is scaled down to it (the lower median: of an even count,
   the smaller middle norm, as `torch.median`; one contribution is never clipped).
2. At every index some contribution sent, the merged value is the weighted mean of the (clipped) values
   sent there, weights the contributions' token counts; everywhere else it is zero. That is the core's
   token-weighted mean (`protocol.diloco.merge`) taken index by index over the deltas that sent the index;
   it is computed here on the union of the sent indices (a dense copy of each delta would cost memory).

Every replica computes this itself from the same deltas, so the result must be bit-identical whatever the
machine and whatever order the contributions arrive in: contributions are taken in the order of
(learner, seq); norms are sums of exact float64 squares of float32 values added in a fixed pairwise tree
(`tree_sum`: element-wise IEEE additions only, no BLAS reduction whose order depends on the CPU); numerators
and weights accumulate in float64 element-wise, in that order, and the quotient is rounded once to float32.

`SparseTensor` is how decoders hand a sparse tensor over (`wire.codecs.codec.decode_sparse`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SparseTensor:
    """The entries a sparse frame sent of one tensor: flat `indices` (int64, strictly increasing, each
    below the tensor's element count) and their float32 `values` (same length)."""

    shape: tuple[int, ...]
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dense(self) -> torch.Tensor:
        dense = torch.zeros(self.numel, dtype=torch.float32)
        dense[self.indices] = self.values
        return dense.reshape(self.shape)


@dataclass(frozen=True)
class SparseContribution:
    """One accepted sparse delta of a round: whose (`learner`, `seq`), its weight (tokens) and entries."""

    learner: str
    seq: int
    weight: float
    tensors: Mapping[str, SparseTensor]

    @property
    def key(self) -> tuple[str, int]:
        return (self.learner, self.seq)


@dataclass(frozen=True)
class UnionMerge:
    """The merged dense outer gradient, and what the merge did: the round's median norm, each
    contribution's norm and scale (1.0 when not clipped) in merge order, and the entries covered."""

    tensors: dict[str, torch.Tensor]
    median_norm: float
    norms: tuple[tuple[str, int, float], ...]
    scales: tuple[tuple[str, int, float], ...]
    covered: int


def tree_sum(values: np.ndarray) -> float:
    """The float64 sum of `values` added in a fixed pairwise tree (halves added element-wise), identical on
    every machine and numpy build."""
    x = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return 0.0
    while x.size > 1:
        if x.size % 2:
            x = np.append(x, 0.0)
        half = x.size // 2
        x = x[:half] + x[half:]
    return float(x[0])


def contribution_norm(contribution: SparseContribution, names: Sequence[str]) -> float:
    """L2 norm over the values of `names` (in that order), deterministic bit for bit (`tree_sum`)."""
    parts = [contribution.tensors[n].values.numpy().astype(np.float64) for n in names]
    squares = np.concatenate(parts) ** 2 if parts else np.zeros(0)  # exact: float32 squared fits float64
    return math.sqrt(tree_sum(squares))


def lower_median(values: Sequence[float]) -> float:
    """The ceil(n/2)-th smallest of `values` (of an even count, the smaller middle one)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _check(contribution: SparseContribution, shapes: Mapping[str, tuple[int, ...]]) -> None:
    who = f"contribution {contribution.key}"
    if set(contribution.tensors) != set(shapes):
        raise ValueError(f"{who}: tensors {sorted(contribution.tensors)} differ from {sorted(shapes)}")
    if not (math.isfinite(contribution.weight) and contribution.weight > 0):
        raise ValueError(f"{who}: weight must be finite and > 0, got {contribution.weight!r}")
    for name, shape in shapes.items():
        t = contribution.tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{who}: {name!r} has shape {t.shape}, expected {tuple(shape)}")
        idx, val = t.indices, t.values
        if idx.dtype != torch.int64 or val.dtype != torch.float32 or idx.dim() != 1 or idx.shape != val.shape:
            raise ValueError(f"{who}: {name!r} needs 1-D int64 indices and float32 values of one length")
        if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= t.numel or bool((idx[1:] <= idx[:-1]).any())):
            raise ValueError(f"{who}: {name!r} indices must be strictly increasing in [0, {t.numel})")
        if not bool(torch.isfinite(val).all()):
            raise ValueError(f"{who}: {name!r} holds NaN or inf")


def union_merge(
    contributions: Sequence[SparseContribution], shapes: Mapping[str, tuple[int, ...]]
) -> UnionMerge:
    """The merged dense float32 outer gradient of `contributions` (see the module docstring); ValueError on
    malformed input (no contributions, two with one (learner, seq), tensors or shapes not `shapes`)."""
    if not contributions:
        raise ValueError("a union merge needs at least one contribution")
    ordered = sorted(contributions, key=lambda c: c.key)
    keys = [c.key for c in ordered]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a contribution appears twice: {sorted(k for k in keys if keys.count(k) > 1)[0]}")
    for c in ordered:
        _check(c, shapes)
    names = sorted(shapes)
    norms = [contribution_norm(c, names) for c in ordered]
    median = lower_median(norms)
    scales = [median / n if n > median else 1.0 for n in norms]
    merged: dict[str, torch.Tensor] = {}
    covered = 0
    for name in shapes:  # the caller's order, as frames list their tensors
        numel = math.prod(shapes[name])
        index_sets = [c.tensors[name].indices.numpy() for c in ordered]
        sent = np.zeros(numel, dtype=bool)  # 1 B/param: far faster than np.unique of the concatenation
        for indices in index_sets:
            sent[indices] = True
        union = np.flatnonzero(sent)
        del sent
        numerator = np.zeros(union.size, dtype=np.float64)
        weight = np.zeros(union.size, dtype=np.float64)
        for c, scale, indices in zip(ordered, scales, index_sets):
            at = np.searchsorted(union, indices)  # distinct within one contribution: plain fancy indexing
            values = c.tensors[name].values.numpy().astype(np.float64)
            if scale != 1.0:
                values = values * scale
            numerator[at] += c.weight * values
            weight[at] += c.weight
        dense = torch.zeros(numel, dtype=torch.float32)
        dense[torch.from_numpy(union)] = torch.from_numpy((numerator / weight).astype(np.float32))
        merged[name] = dense.reshape(shapes[name])
        covered += int(union.size)
    return UnionMerge(
        tensors=merged,
        median_norm=median,
        norms=tuple((c.learner, c.seq, n) for c, n in zip(ordered, norms)),
        scales=tuple((c.learner, c.seq, s) for c, s in zip(ordered, scales)),
        covered=covered,
    )
