"""Direction references: per fragment, a running average of the directions of the updates a peer applied,
which the robust screen compares each delta with (`RobustGuard`, rule 5 of `protocol.robust`).

Owns `DirectionReferences` (the bfloat16 references, how many updates each holds, the fragments that ever
had one) and the two measures the screen uses, `fragment_norm` and `cosine`. An update's gradient may
still be in int8 form (`kernels.QuantizedTensor`, from `decode_tensors(lazy=True)`): it is read a chunk
at a time, never decoded whole, and folded into the reference in place. Pure: no clock, no randomness.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from p2p_diloco.protocol import kernels


def fragment_norm(tensors: Mapping[str, Tensor | kernels.QuantizedTensor]) -> float:
    """The L2 norm of a fragment's tensors seen as one vector (float64 sums, a chunk at a time)."""
    return math.sqrt(sum(kernels.sum_squares64(t) for t in tensors.values()))


def cosine(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float | None:
    """Cosine of two fragments seen as one vector (tensors of `a`'s names); None if either is zero."""
    dot = _dot(a, b)
    na, nb = fragment_norm(a), fragment_norm({n: b[n] for n in a})
    return dot / (na * nb) if na > 0 and nb > 0 else None


def _dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    """The dot product of two fragments seen as one vector, over `a`'s tensor names (float64)."""
    return sum(float((a[n].double() * b[n].double()).sum()) for n in a)


def cosine_matrix(deltas: Sequence[Mapping[str, Tensor]]) -> list[list[float | None]]:
    """`cosine(deltas[i], deltas[j])` for every i != j (None on the diagonal). Deltas of one fragment hold
    the same tensor names in the same order: each norm is then taken once and each pair's dot once
    (`cosine` is symmetric there, bit for bit), not n x n times each: a holder at 256 learners screens
    rounds of ~70 deltas. Otherwise pair by pair."""
    n = len(deltas)
    names = {tuple(d) for d in deltas}
    if len(names) > 1:
        pairs = enumerate(deltas)
        return [[None if i == j else cosine(a, b) for j, b in enumerate(deltas)] for i, a in pairs]
    norms = [fragment_norm(d) for d in deltas]
    out: list[list[float | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            a, b = deltas[i], deltas[j]
            dot = _dot(a, b)
            value = dot / (norms[i] * norms[j]) if norms[i] > 0 and norms[j] > 0 else None
            out[i][j] = out[j][i] = value
    return out


class DirectionReferences:
    """reference = decay x reference + (1 - decay) x unit(update), per fragment, kept in bfloat16; usable
    once it holds `min_updates` updates."""

    def __init__(self, decay: float, min_updates: int):
        self.decay = decay
        self.min_updates = min_updates
        self._references: dict[int, dict[str, Tensor]] = {}
        self._updates: Counter[int] = Counter()
        self._warmed: set[int] = set()  # fragments that have had a usable reference

    def usable(self, fragment: int) -> Mapping[str, Tensor] | None:
        """The fragment's reference once it holds `min_updates` updates, else None."""
        reference = self._references.get(fragment)
        return reference if reference is not None and self._updates[fragment] >= self.min_updates else None

    def get(self, fragment: int) -> Mapping[str, Tensor] | None:
        """The fragment's reference however young (read it, never change it), or None."""
        return self._references.get(fragment)

    def warmed(self, fragment: int) -> bool:
        """Whether the fragment ever had a usable reference (a reset does not undo it)."""
        return fragment in self._warmed

    def reset(self, fragment: int) -> None:
        self._references.pop(fragment, None)
        self._updates[fragment] = 0

    def observe(
        self,
        fragment: int,
        outer_grad: Mapping[str, Tensor | kernels.QuantizedTensor],
        norm: float | None = None,
    ) -> None:
        """Fold the direction of an applied update into the fragment's reference (a zero one is skipped);
        `norm`, the update's L2 norm, if the caller has it (else computed here)."""
        norm = fragment_norm(outer_grad) if norm is None else norm
        if norm == 0.0:
            return
        decay = self.decay
        old = self._references.get(fragment)
        fresh = {}
        with kernels.scratch() as buffers:
            for name, g in outer_grad.items():  # a chunk at a time, in reused buffers; updated in place
                previous = old.get(name) if old is not None else None
                target = (
                    previous if previous is not None else torch.empty(tuple(g.shape), dtype=torch.bfloat16)
                )
                flat = target.view(-1)
                for start, values in kernels.float_chunks(g):
                    n = values.numel()
                    unit = torch.mul(values, (1 - decay) / norm, out=buffers.get("reference.unit", n))
                    if previous is not None:  # starting from zero keeps the first update from dominating
                        kept = buffers.get("reference.kept", n).copy_(flat[start : start + n]).mul_(decay)
                        unit = kept.add_(unit)  # old * decay + unit, the same sum either way round
                    flat[start : start + n].copy_(unit)
                fresh[name] = target
        self._references[fragment] = fresh
        self._updates[fragment] += 1
        if self._updates[fragment] >= self.min_updates:
            self._warmed.add(fragment)
