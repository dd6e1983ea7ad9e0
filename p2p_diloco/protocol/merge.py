"""Validating learners' outer deltas and merging them into one outer gradient per fragment.

Owns the checks every incoming delta must pass before it can reach the global state, and the two merge
rules: RDA (weighted mean of norms times the direction of the weighted mean of unit vectors, per tensor;
plain weighted mean for embeddings) and the plain weighted mean. The merge weight (tokens x
tokens-per-step) and the weighted mean are the core's (`protocol.diloco`: `merge_weight`, `merge`).
Only the synchronizer merges; replicas apply the published (quantized) result, so the merge must be
deterministic for given inputs but need not be bit-reproducible across machines.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from enum import StrEnum

import torch
from torch import Tensor

from p2p_diloco.protocol import diloco
from p2p_diloco.protocol.decisions import Action, Decision
from p2p_diloco.protocol.kernels import CHUNK, Scratch, all_finite, fresh, norm64, scratch

# Actions of `validate_delta`.
ACCEPT = Action.ACCEPT
REJECT = "reject"


# `replica` reuses the shape/dtype/finite tags.
class MergeTag(StrEnum):
    """Why a delta or a replica's tensors passed or failed `check_tensors`."""

    ACCEPTED = "accepted"
    MISSING_TENSOR = "missing tensor"
    UNEXPECTED_TENSOR = "unexpected tensor"
    WRONG_SHAPE = "wrong shape"
    WRONG_DTYPE = "wrong dtype"
    NON_FINITE = "non-finite"
    NORM_BOUND = "norm bound"


MERGE_RULES = ("rda", "mean")
# RDA with at most this many deltas takes the direction's norm from their Gram matrix (one pass over the
# data instead of two; the dot products per chunk grow as M^2, so larger merges sum the direction itself).
GRAM_MAX_DELTAS = 8
GRAM_CHUNK = CHUNK // 2  # elements per Gram pass: 8 float64 work buffers of 1 MiB
# ... unless the deltas nearly cancel (|direction|^2 below this share of (sum of weights)^2), where the
# Gram form would lose relative precision.
_GRAM_CANCELLATION = 1e-8

DELTA_DTYPE = torch.float32

merge_weight = diloco.merge_weight  # tokens x tokens/steps: the core's


def check_tensors(
    tensors: Mapping[str, object],
    expected_shapes: Mapping[str, tuple[int, ...]],
    *,
    norm_bound: float | None,
    finite: bool = True,
) -> Decision:
    """Names, shapes, dtype (float32), finite values (unless `finite=False`: a caller whose next step
    proves finiteness anyway) and, if `norm_bound` is given, per-tensor L2 norms.

    Shared by `validate_delta` and the replica's checks on outer gradients and snapshots.
    Checks run in a fixed order (names first, then each tensor in `expected_shapes` order) so the
    same input always gets the same reason.
    """
    missing = [name for name in expected_shapes if name not in tensors]
    if missing:
        return Decision(REJECT, MergeTag.MISSING_TENSOR, f"{_preview(missing)}")
    unexpected = [name for name in tensors if name not in expected_shapes]
    if unexpected:
        return Decision(REJECT, MergeTag.UNEXPECTED_TENSOR, f"{_preview(unexpected)}")
    for name, shape in expected_shapes.items():
        tensor = tensors[name]
        if not isinstance(tensor, Tensor):
            return Decision(
                REJECT, MergeTag.WRONG_DTYPE, f"{name} is a {type(tensor).__name__}, not a tensor"
            )
        if tuple(tensor.shape) != tuple(shape):
            return Decision(
                REJECT, MergeTag.WRONG_SHAPE, f"{name} is {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        if tensor.dtype != DELTA_DTYPE or tensor.layout != torch.strided:
            return Decision(
                REJECT,
                MergeTag.WRONG_DTYPE,
                f"{name} is {tensor.dtype} ({tensor.layout}), expected dense float32",
            )
        if finite and not all_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            return Decision(REJECT, MergeTag.NON_FINITE, f"{name} has {bad} NaN/inf values")
        if norm_bound is not None:
            # float64 accumulation: a float32 sum of squares can overflow for finite, in-bound entries.
            norm = norm64(tensor)
            if not norm <= norm_bound:
                return Decision(
                    REJECT, MergeTag.NORM_BOUND, f"{name} has L2 norm {norm:.6g} > {norm_bound:.6g}"
                )
    return Decision(ACCEPT, MergeTag.ACCEPTED, f"{len(expected_shapes)} tensors")


def validate_delta(
    tensors: Mapping[str, Tensor],
    expected_shapes: Mapping[str, tuple[int, ...]],
    *,
    norm_bound: float,
) -> Decision:
    """Accept a decoded delta only if it has exactly the expected tensors, shapes, float32, finite, in
    bound."""
    if not norm_bound > 0:
        raise ValueError(f"norm_bound must be > 0, got {norm_bound}")
    return check_tensors(tensors, expected_shapes, norm_bound=norm_bound)


def merge_deltas(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    *,
    rule: str = "rda",
    embedding_names: Collection[str] = (),
) -> dict[str, Tensor]:
    """Merge validated deltas of one fragment into one float32 outer gradient.

    rule "rda", per tensor: (sum w*|v| / sum w) * unit(sum w*unit(v) / sum w); a zero vector has a zero
    unit vector, and a zero combined direction gives a zero result (never NaN). Tensors named in
    `embedding_names` (names absent from the deltas are ignored) and every tensor under rule "mean" use
    the plain weighted mean sum w*v / sum w. Sums run in float64, in the order given (callers sort by
    sender), a fixed-size chunk at a time (`kernels.CHUNK`), so equal inputs give equal outputs. For RDA
    the norms (and, up to GRAM_MAX_DELTAS deltas, the combined direction's norm) come from one pass of
    float64 dot products; a second pass writes the result. Weights must be finite and >= 0 with a positive
    total.
    """
    if rule not in MERGE_RULES:
        raise ValueError(f"unknown merge rule {rule!r}; expected one of {MERGE_RULES}")
    if not deltas:
        raise ValueError("nothing to merge: no deltas given")
    if len(weights) != len(deltas):
        raise ValueError(f"{len(deltas)} deltas but {len(weights)} weights")
    ws = [float(w) for w in weights]
    if any(not math.isfinite(w) or w < 0 for w in ws):
        raise ValueError(f"merge weights must be finite and >= 0, got {ws}")
    total = math.fsum(ws)
    if not total > 0:
        raise ValueError(f"total merge weight must be > 0, got {total}")
    names = list(deltas[0])
    for index, delta in enumerate(deltas[1:], start=1):
        if set(delta) != set(names):
            diff = sorted(set(delta).symmetric_difference(names))
            raise ValueError(f"delta {index} has different tensor names than delta 0: {_preview(diff)}")
    embeddings = set(embedding_names)
    merged: dict[str, Tensor] = {}
    for name in names:
        parts = [delta[name] for delta in deltas]
        shape = parts[0].shape
        for index, part in enumerate(parts):
            if part.shape != shape:
                raise ValueError(
                    f"{name}: delta {index} has shape {tuple(part.shape)}, delta 0 {tuple(shape)}"
                )
        if rule == "mean" or name in embeddings:
            merged[name] = diloco.merge(parts, ws)  # sum w*v / fsum(w), float64
        else:
            merged[name] = _rda(parts, ws, total)
    return merged


def _rda(parts: Sequence[Tensor], weights: Sequence[float], total: float) -> Tensor:
    flats = [part.detach().cpu().reshape(-1) for part in parts]
    with scratch() as buffers:
        return _rda_with(flats, weights, total, buffers).view(parts[0].shape)


def _rda_with(flats: Sequence[Tensor], weights: Sequence[float], total: float, buffers: Scratch) -> Tensor:
    n = flats[0].numel()
    gram = _gram(flats, buffers) if len(flats) <= GRAM_MAX_DELTAS else None
    terms: list[tuple[Tensor, float]] = []
    kept: list[int] = []
    norm_sum = 0.0
    for i, (flat, w) in enumerate(zip(flats, weights)):
        norm = math.sqrt(gram[i][i]) if gram is not None else norm64(flat)
        if norm > 0:  # a zero vector adds its zero norm to the mean but no direction
            terms.append((flat, w / norm))
            kept.append(i)
            norm_sum += w * norm
    mean_norm = norm_sum / total
    if not terms or mean_norm == 0.0:  # all zero
        return torch.zeros(n, dtype=torch.float32)
    direction, term = (buffers.get(name, min(n, CHUNK), torch.float64) for name in ("rda.dir", "rda.term"))

    def direction_of(start: int, stop: int) -> Tensor:
        """sum w/|v| * v over one chunk, in float64: the same operations each time it is computed."""
        d, t = direction[: stop - start], term[: stop - start]
        (first, first_coef), *rest = terms
        d.copy_(first[start:stop]).mul_(first_coef)
        for flat, coef in rest:
            t.copy_(flat[start:stop]).mul_(coef)
            d.add_(t)
        return d

    square_sum = 0.0
    if gram is not None:  # |sum c_a v_a|^2 = sum c_a c_b <v_a, v_b>, no pass over the data
        coefs = [coef for _, coef in terms]
        for a, i in enumerate(kept):
            for b, j in enumerate(kept):
                square_sum += coefs[a] * coefs[b] * gram[i][j]
    scale_of_terms = math.fsum(weights[i] for i in kept) ** 2  # (sum |c_a v_a|)^2
    if not square_sum > _GRAM_CANCELLATION * scale_of_terms:  # large cancellation: sum the direction itself
        square_sum = 0.0
        for start in range(0, n, CHUNK):
            d = direction_of(start, min(start + CHUNK, n))
            square_sum += float(torch.dot(d, d))
    direction_norm = math.sqrt(square_sum) / total
    if direction_norm == 0.0:  # directions cancel exactly
        return torch.zeros(n, dtype=torch.float32)
    scale = mean_norm / (direction_norm * total)
    out = fresh((n,))
    for start in range(0, n, CHUNK):  # pass 2: recomputed (cheaper than a fragment-sized float64 buffer)
        stop = min(start + CHUNK, n)
        out[start:stop].copy_(direction_of(start, stop).mul_(scale))
    return out


def _gram(flats: Sequence[Tensor], buffers: Scratch) -> list[list[float]]:
    """<v_i, v_j> for every pair, float64, accumulated chunk by chunk in a fixed order (one pass)."""
    n = flats[0].numel()
    step = GRAM_CHUNK
    chunks = [buffers.get(f"gram.{i}", min(n, step), torch.float64) for i in range(len(flats))]
    gram = [[0.0] * len(flats) for _ in flats]
    for start in range(0, n, step):
        chunk = [b[: min(n - start, step)].copy_(f[start : start + step]) for b, f in zip(chunks, flats)]
        for i, x in enumerate(chunk):
            for j in range(i, len(chunk)):
                gram[i][j] += float(torch.dot(x, chunk[j]))
    for i in range(len(flats)):
        for j in range(i):
            gram[i][j] = gram[j][i]
    return gram


def _preview(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (+{len(names) - limit} more)"
