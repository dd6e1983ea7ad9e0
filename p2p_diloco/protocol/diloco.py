"""Decoupled DiLoCo (arXiv 2604.21428) in one page: the formulas every other module applies.

Each fragment p of the model has a global state: parameters Θ_p and outer momentum m_p. A learner trains
its own copy θ with AdamW and, every H steps per fragment, sends

    Δ = anchor_p − θ_p                                  `outer_delta` (anchor: the Θ_p it last adopted)

weighted by w = tokens · tokens/steps (`merge_weight`). A synchronizer merges a round's deltas into the
outer gradient g — the token-weighted mean (`merge`; by default `merge.merge_deltas` uses RDA, the weighted
mean of norms times the direction of the weighted mean of unit vectors, and the weighted mean for
embeddings; sparse deltas merge by union, `union_merge`: the weighted mean at each index over the deltas
that sent it) — scaled by contributors/live (`scale_to_live`), and takes one outer Nesterov step

    m' = μ·m + g;   Θ' = Θ − lr·(g + μ·m')                `outer_step`

which every replica recomputes bit for bit. A learner adopts Θ' and keeps its local progress (`adopt`):
if its own delta was merged, θ ← Θ' + (θ − θ_at_send) (carry); otherwise θ ← θ + (Θ' − Θ) (`follow`).
Synchronous DiLoCo (`baseline.diloco`) is the case where all M learners send at once and θ ← Θ'.

Speed lives below this page, not beside it: the outer step runs in `kernels` (chunked torch, or the fused
C kernel of `fused`: the same float32 operations, no FMA), the merges a cache-sized chunk at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from p2p_diloco.protocol import kernels


def outer_delta(anchor: Tensor, theta: Tensor) -> Tensor:
    """Δ = anchor − θ: points against the local progress, like a gradient."""
    return anchor - theta


def merge_weight(tokens: int, steps: int) -> float:
    """A learner's merge weight: tokens x (tokens / steps), both counted since it last adopted the fragment.

    Favours learners that trained on more data and with larger batches (more tokens per step). Integer
    counts: tokens² is exact and the quotient rounded once.
    """
    if steps <= 0:
        raise ValueError(f"steps must be > 0 to weigh a delta, got {steps}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return float(tokens * tokens / steps)


def merge(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """The weighted mean Σ w_i Δ_i / Σ w_i of equal-shape tensors, as a fresh float32 tensor.

    Sums in float64 in the order given (callers sort by sender), a chunk at a time (`kernels.CHUNK`), the
    total by `math.fsum`, rounded once to float32: equal inputs give equal outputs."""
    ws = [float(w) for w in weights]
    total = math.fsum(ws)
    flats = [delta.detach().cpu().reshape(-1) for delta in deltas]
    out = kernels.fresh(deltas[0].shape)
    flat_out, n = out.view(-1), flats[0].numel()
    with kernels.scratch() as buffers:
        acc, term = (
            buffers.get(name, min(n, kernels.CHUNK), torch.float64) for name in ("mean.acc", "mean.term")
        )
        for start in range(0, n, kernels.CHUNK):  # one cache-sized chunk at a time, accumulated in float64
            stop = min(start + kernels.CHUNK, n)
            a, t = acc[: stop - start], term[: stop - start]
            a.copy_(flats[0][start:stop]).mul_(ws[0])
            for flat, w in zip(flats[1:], ws[1:]):
                t.copy_(flat[start:stop]).mul_(w)
                a.add_(t)
            flat_out[start:stop].copy_(a.div_(total))
    return out


def scale_to_live(merged: Sequence[Tensor], contributors: int, live: int) -> None:
    """Scale the merged outer gradient in place by contributors/live when fewer than `live` learners
    contributed (`outer_scaling = "contributors"`): the model moves per unit of time as synchronous
    DiLoCo would, not once per learner."""
    if contributors < live:
        scale = torch.tensor(contributors / live, dtype=torch.float32)
        for t in merged:
            t.mul_(scale)


def outer_step(theta: Tensor, m: Tensor, g: Tensor, *, lr: float, momentum: float) -> tuple[Tensor, Tensor]:
    """One outer Nesterov SGD step, returning fresh (Θ', m'); no mutation.

    m' = μ·m + g;  Θ' = Θ − lr·(g + μ·m').  Every operation is a separate element-wise float32 kernel with
    its own rounding, because replicas on different CPUs must agree bit for bit: a fused multiply-add
    (torch's `add(alpha=)`, `addcmul`, `lerp`, or one expression compiled into an FMA) rounds once instead
    of twice, and whether a kernel uses FMA depends on the CPU and build. Plain `+`/`-` are safe: torch may
    run them as fma(b, ±1, a), but multiplying by ±1 is exact. lr and μ are rounded to float32 once, the
    same on every peer. Per element: m' = m*μ; m' = m' + g; d = m'*μ; d = d + g; d = d*lr; Θ' = Θ − d.
    """
    new_theta, new_m = torch.empty(theta.shape), torch.empty(theta.shape)
    mu, rate = kernels.float32_scalar(momentum), kernels.float32_scalar(lr)
    outer_step_into(theta, m, g, new_theta, new_m, mu=mu, rate=rate)
    return new_theta, new_m


def outer_step_into(
    theta: Tensor,
    m: Tensor,
    g: Tensor | kernels.QuantizedTensor,
    new_theta: Tensor,
    new_m: Tensor,
    *,
    mu: Tensor,
    rate: Tensor,
    on_theta: Callable[[memoryview], object] | None = None,
) -> bool:
    """`outer_step` written into given outputs, with float32 `mu` and `rate`; whether Θ' is all finite.
    The arithmetic is `kernels.nesterov_into` (chunked torch, or the fused C kernel); a gradient still
    in int8 form is decoded on the fly. `on_theta` gets Θ' piece by piece, in order (a hasher)."""
    if isinstance(g, kernels.QuantizedTensor):
        return kernels.nesterov_quantized_into(
            theta, m, g, new_theta, new_m, mu=mu, rate=rate, on_theta=on_theta
        )
    return kernels.nesterov_into(theta, m, g, new_theta, new_m, mu=mu, rate=rate, on_theta=on_theta)


def adopt(
    theta: Tensor,
    new_global: Tensor,
    *,
    at_send: Tensor | None = None,
    mode: str = "carry",
    alpha: float = 0.5,
) -> Tensor:
    """θ after an update that merged this learner's own delta, sent when θ was `at_send`: "carry" keeps the
    progress made since (Θ' + (θ − θ_at_send)), "overwrite" drops it (Θ'), "blend" is (1−α)·θ + α·Θ'."""
    if mode == "overwrite":
        return new_global
    if mode == "blend":
        return theta * (1 - alpha) + new_global * alpha
    if mode != "carry" or at_send is None:
        raise ValueError(f"adoption {mode!r} needs one of carry, overwrite, blend (carry: θ at send)")
    return new_global + (theta - at_send)


def follow(theta: Tensor, old_global: Tensor, new_global: Tensor) -> tuple[Tensor, Tensor]:
    """θ after an update that merged only others' deltas, and the global change: θ moves by Θ' − Θ, so no
    local work is lost and the next delta (anchor Θ') still carries it. Returns (θ + shift, shift)."""
    shift = new_global - old_global
    return theta + shift, shift
