"""Per-block magnitude levels: the 2- and 4-bit values of `wire.codecs.chunked`'s codecs, encoded and decoded.

A code of `bits` bits is a sign bit (the highest) and a level index (the others); each block of
`block_size` kept values sends its 2 ** (bits - 1) levels as float32, non-negative and non-decreasing.
Kept values are a chunk's largest, so no level is spent on zero and the sign is exact; the levels follow
the block's magnitudes wherever they lie, so a heavy tail costs no precision to the bulk (a fixed table
scaled by the block's absmax puts most values of a heavy-tailed block on its lowest step, far from them).

The encoder picks levels that minimize the squared error of the block's magnitudes: for two levels the
best split of the sorted magnitudes (exact), then one Lloyd step; for more, Lloyd's iterations from the
magnitudes' quantiles. Any levels decode the same way: a copy of the level and an exact negation, so the
decoded values are identical on every machine. `check_levels` is the decoder's side of the contract.
"""

from __future__ import annotations

import numpy as np
import torch

from p2p_diloco.errors import DecodeError
from p2p_diloco.wire.codecs.blockwise import BAD_HEADER, NON_FINITE

LLOYD_ITERATIONS = 12


def level_count(bits: int) -> int:
    return 1 << (bits - 1)


def _lloyd_step(m: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Each magnitude to its nearest level, then each level to the mean of its magnitudes (kept if none)."""
    count = levels.shape[1]
    index = torch.searchsorted((levels[:, 1:] + levels[:, :-1]) / 2, m.contiguous(), right=True)
    sums = torch.zeros_like(levels).scatter_add_(1, index, m)
    sizes = torch.zeros_like(levels).scatter_add_(1, index, torch.ones_like(m))
    out = torch.where(sizes > 0, sums / sizes.clamp(min=1), levels)
    return out if count == 1 else torch.sort(out, dim=1).values


def _two_levels(s: torch.Tensor) -> torch.Tensor:
    """The best split of each sorted row into a low and a high group: their means as (rows, 2)."""
    rows, n = s.shape
    total = s.sum(dim=1)
    if n == 1:
        return torch.stack([s[:, 0], s[:, 0]], dim=1)
    below = torch.cumsum(s, dim=1)[:, :-1]  # sums of the j smallest, j = 1 .. n-1
    j = torch.arange(1, n, dtype=torch.float64)
    best = torch.argmax(below**2 / j + (total[:, None] - below) ** 2 / (n - j), dim=1)
    low_sum = below.gather(1, best[:, None])[:, 0]
    size = (best + 1).to(torch.float64)
    return torch.stack([low_sum / size, (total - low_sum) / (n - size)], dim=1)


def fit_levels(magnitudes: torch.Tensor, count: int) -> torch.Tensor:
    """float64 levels (rows, count), non-decreasing, for each row of non-negative `magnitudes` (rows, n)."""
    m = magnitudes.to(torch.float64)
    s = torch.sort(m, dim=1).values
    if count == 2:
        return _lloyd_step(m, _two_levels(s))
    n = s.shape[1]
    at = ((torch.arange(count, dtype=torch.float64) + 0.5) * n / count).long().clamp(max=n - 1)
    levels = s[:, at]
    for _ in range(LLOYD_ITERATIONS):
        levels = _lloyd_step(m, levels)
    return levels


def quantize_levels(values: torch.Tensor, block_size: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(levels float32 (blocks, 2 ** (bits - 1)), codes uint8) of float32 `values` in blocks."""
    count, k = level_count(bits), values.numel()
    full = k // block_size
    parts = []
    if full:
        parts.append(values[: full * block_size].view(full, block_size))
    if k % block_size:
        parts.append(values[full * block_size :].view(1, -1))
    levels_out, codes_out = [], []
    for part in parts:
        mags = part.abs().to(torch.float64)
        levels32 = fit_levels(mags, count).to(torch.float32)  # rounding keeps them non-decreasing
        bounds = (levels32[:, 1:].double() + levels32[:, :-1].double()) / 2
        index = torch.searchsorted(bounds.contiguous(), mags.contiguous(), right=True).to(torch.uint8)
        negative = (part < 0).to(torch.uint8)
        codes_out.append((index | (negative << (bits - 1))).reshape(-1))
        levels_out.append(levels32)
    if not levels_out:
        return np.zeros((0, count), np.float32), np.zeros(0, np.uint8)
    return torch.cat(levels_out).numpy(), torch.cat(codes_out).numpy()


def check_levels(levels: np.ndarray, name: str) -> None:
    """DecodeError unless every block's levels are finite, non-negative and non-decreasing."""
    if not np.isfinite(levels).all():
        raise DecodeError(NON_FINITE, f"tensor {name!r} has a non-finite block level")
    if bool((levels < 0).any()):
        raise DecodeError(BAD_HEADER, f"tensor {name!r} has a negative block level")
    if levels.shape[1] > 1 and bool((np.diff(levels, axis=1) < 0).any()):
        raise DecodeError(BAD_HEADER, f"tensor {name!r} has block levels not in increasing order")


def dequantize_levels(levels: np.ndarray, codes: np.ndarray, block_size: int, bits: int) -> torch.Tensor:
    """float32 values of `codes` (int64) against checked per-block `levels`: a copy and a negation."""
    magnitude = levels[np.arange(codes.size) // block_size, codes & (level_count(bits) - 1)]
    return torch.from_numpy(np.where(codes >> (bits - 1) == 1, -magnitude, magnitude).astype(np.float32))
