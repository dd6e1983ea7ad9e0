"""Element-wise kernels at model scale: fresh huge-page tensors, the chunked outer Nesterov step, finiteness.

On one core, what costs most on fragment-sized (tens of millions of float32) tensors is not arithmetic but
memory: a fresh tensor's first touch takes one page fault per 4 KiB (~50 ms per 128 MB), and every
element-wise kernel over a whole tensor streams it through DRAM. So:

- `fresh` allocates float32 tensors of 2 MiB and more in an anonymous memory map advised for transparent
  huge pages (`mmap.madvise(MADV_HUGEPAGE)`), which the kernel fills 2 MiB per fault. Where huge pages are
  off (`/sys/kernel/mm/transparent_hugepage/enabled` = never) the map falls back to ordinary pages: the
  values are the same either way. The map lives as long as the tensor (torch keeps the buffer alive).
- `nesterov_into` runs the outer step over CHUNK elements at a time, every kernel of a chunk while the
  chunk is in cache, writing straight into the output tensors. The operations and their order are those
  documented in `outer_step.nesterov_step`, each a separate float32 kernel with its own rounding (no fused
  multiply-add), so the result is the same bit for bit as running each kernel over the whole tensor:
  every element goes through exactly the same float32 operations (tests/unit/test_scale_kernels.py).
- `all_finite`: a finite float32 sum proves every element finite; only an overflowing sum needs the scan.
- `norm64`, `sum_squares64`: an L2 norm (its square) accumulated in float64, chunk by chunk (for norm
  bounds, the RDA merge and the robust checks); they take a `QuantizedTensor` as well.
- `float_chunks`: a dense or quantized tensor's values a chunk at a time, so that a check or a running
  average over an update's gradient never decodes the whole fragment at once.
- `QuantizedTensor`: a tensor still in int8 blockwise form (codes, block absmax, code table), as an update's
  frame carries its outer gradient; `dequantize_into` decodes it (one float32 multiply per value) and
  `nesterov_quantized_into` runs the outer step on it, decoding on the fly with the C kernels.
- `scratch`: the chunk-sized work buffers of these loops (and of the int8 codec's) are borrowed from a
  small pool and kept from call to call: a peer maps every block of 1 MiB or more afresh
  (`node.heap`), so a new 1 MiB buffer per call would cost 256 page faults.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from p2p_diloco.protocol import fused

CHUNK = 1 << 18  # elements per pass (1 MiB of float32): the temporaries of a chunk stay in cache
HUGE_PAGE = 2 << 20  # tensors at least this large get a huge-page backed map


POOL_SIZE = 2  # scratch sets kept for reuse (one per thread running these kernels at the same time)


class Scratch:
    """Named work buffers of at most a chunk each, reused by whoever borrows this set (see `scratch`)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """A 1-D buffer of `n` elements, uninitialised; the same memory each time for the same name."""
        buffer = self._buffers.get((name, dtype))
        if buffer is None or buffer.numel() < n:
            buffer = self._buffers[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buffer[:n]


_POOL: list[Scratch] = []  # list.pop and list.append are atomic: threads never share a set


@contextmanager
def scratch() -> Iterator[Scratch]:
    """Borrow a set of work buffers for one call (a new set when every kept one is in use)."""
    try:
        borrowed = _POOL.pop()
    except IndexError:
        borrowed = Scratch()
    try:
        yield borrowed
    finally:
        if len(_POOL) < POOL_SIZE:  # two threads may both append: the pool then holds one set more
            _POOL.append(borrowed)


def fresh(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised contiguous CPU tensor; from 2 MiB on, in its own huge-page advised map."""
    numel = math.prod(int(dim) for dim in shape)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(tuple(shape), dtype=dtype)
    # Reserve one huge page more than needed (address space only), start the tensor on a huge-page
    # boundary and advise only the whole huge pages it covers: its tail stays on ordinary pages, so no
    # page is filled beyond the tensor's own bytes.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, same values
        pass
    return raw[offset : offset + nbytes].view(dtype).view(tuple(shape))


def all_finite(t: Tensor) -> bool:
    """Every element finite: a finite sum proves it (NaN and inf propagate); only an overflowing sum needs
    the element-wise scan."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def norm64(t: Tensor | QuantizedTensor) -> float:
    """The L2 norm of `t` accumulated in float64 (a float32 sum of squares can overflow for finite values),
    a cache-sized chunk at a time: ~10x faster on one core than `vector_norm(t, dtype=torch.float64)`,
    which converts element by element inside its reduction. Deterministic; it may differ from
    `vector_norm` in the last bits (another summation order)."""
    return math.sqrt(sum_squares64(t))


def sum_squares64(t: Tensor | QuantizedTensor) -> float:
    """The sum of the squares of `t`'s values, accumulated in float64 a chunk at a time (`norm64`)."""
    total = 0.0
    with scratch() as buffers:
        for _, values in float_chunks(t):
            part = buffers.get("norm64", values.numel(), torch.float64).copy_(values)
            total += float(torch.dot(part, part))
    return total


def float_chunks(t: Tensor | QuantizedTensor) -> Iterator[tuple[int, Tensor]]:
    """(offset, values) for `t` flattened, at most CHUNK values at a time: views of a dense tensor; a
    quantized tensor's values decoded into one reused buffer, so each chunk is valid until the next."""
    if not isinstance(t, QuantizedTensor):
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            yield start, flat[start : start + CHUNK]
        return
    n, block = t.numel(), t.block_size
    with scratch() as buffers:
        work = buffers.get("chunks", min(n, CHUNK))
        for start in range(0, n, CHUNK):  # CHUNK is a multiple of every block size: chunks hold whole blocks
            stop = min(start + CHUNK, n)
            piece = QuantizedTensor(
                (stop - start,),
                t.codes[start:stop],
                t.absmax[start // block : -(-stop // block)],
                block,
                t.table,
            )
            yield start, dequantize_into(piece, work[: stop - start])


def float32_scalar(value: float) -> Tensor:
    """`value` rounded to float32 once, as a 0-dim tensor: the same on every peer."""
    return torch.tensor(value, dtype=torch.float32)


def nesterov_into(
    param: Tensor,
    momentum_buf: Tensor,
    grad: Tensor,
    out_param: Tensor,
    out_momentum: Tensor,
    *,
    mu: Tensor,
    rate: Tensor,
    on_theta: Callable[[memoryview], object] | None = None,
) -> bool:
    """Write m' = mu*m + g and Θ' = Θ - rate*(g + mu*m') into the contiguous outputs, chunk by chunk;
    returns whether every element of both outputs is finite. Inputs of equal shape, float32, CPU.
    `on_theta` (e.g. a hasher's update) gets the bytes of Θ' piece by piece, in order, each right after it
    is computed, while it is in cache.

    Per element, in this order, each a float32 operation rounded on its own: m' = m*mu; m' = m' + g;
    d = m'*mu; d = d + g; d = d*rate; Θ' = Θ - d (see `outer_step.nesterov_step` for why no FMA).
    With the compiled kernels (`protocol.fused`) the same operations run in one pass per element.
    """
    flat = [t.contiguous().view(-1) for t in (param, momentum_buf, grad)]
    theta, m, g = flat
    new_theta, new_m = out_param.view(-1), out_momentum.view(-1)
    if fused.active() and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in flat):
        return fused.nesterov(theta, m, g, new_theta, new_m, mu, rate, on_theta)
    n = theta.numel()
    raw = memoryview(new_theta.detach().numpy()).cast("B") if on_theta is not None else None
    total = 0.0
    with scratch() as buffers:
        work = buffers.get("nesterov", min(n, CHUNK))
        for start in range(0, n, CHUNK):
            stop = min(start + CHUNK, n)
            m_out, g_in, d = new_m[start:stop], g[start:stop], work[: stop - start]
            torch.mul(m[start:stop], mu, out=m_out)  # decayed
            m_out.add_(g_in)
            torch.mul(m_out, mu, out=d)  # lookahead
            d.add_(g_in)
            d.mul_(rate)  # step
            theta_out = new_theta[start:stop]
            torch.sub(theta[start:stop], d, out=theta_out)
            total += float(theta_out.sum())  # while the chunk is in cache
            if raw is not None:
                on_theta(raw[4 * start : 4 * stop])
    # Θ' alone settles it: a non-finite m' makes the lookahead, the step and so Θ' non-finite too (Θ and g
    # are finite; inf*0 is NaN), so a finite Θ' proves m' finite.
    if math.isfinite(total):
        return True
    return bool(torch.isfinite(new_theta).all())


def scale_blocks(values: Tensor, absmax: Tensor, block_size: int) -> Tensor:
    """Multiply flat `values` in place by their block's absmax: exactly one float32 multiply each."""
    n = values.numel()
    full = n // block_size
    cut = full * block_size
    if full:
        values[:cut].view(full, block_size).mul_(absmax[:full, None])
    if cut < n:
        values[cut:].mul_(absmax[full])
    return values


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A float32 tensor still in int8 blockwise form: value i is `table[codes[i]] * absmax[i // block_size]`,
    one float32 multiply (the decoding of `wire.codecs.codec`).
    `wire.codecs.codec.decode_tensors(..., lazy=True)` returns these for int8 frames after the same checks as
    decoding (block absmax finite and >= 0), so every value is finite. `codes` may be a view of the frame: the
    frame must not change while this is in use."""

    shape: tuple[int, ...]
    codes: np.ndarray  # uint8, one per value
    absmax: Tensor  # float32, one per block (the last block may be short)
    block_size: int
    table: Tensor  # float32, 256 entries

    dtype = torch.float32

    def numel(self) -> int:
        return math.prod(self.shape)

    def decode(self) -> Tensor:
        """The values as a fresh float32 tensor of `shape`."""
        return dequantize_into(self, fresh((self.numel(),))).view(self.shape)


def dequantize_into(q: QuantizedTensor, out: Tensor) -> Tensor:
    """Decode `q` into the flat contiguous float32 `out` (C kernel, or a chunk of table lookups at a time)."""
    n = q.numel()
    if fused.active():
        return fused.dequantize(q.codes, q.absmax, q.block_size, q.table, out)
    with scratch() as buffers:
        index = buffers.get("decode.index", min(n, CHUNK), torch.int32)  # CHUNK: whole blocks
        index_np = index.numpy()
        for start in range(0, n, CHUNK):  # a cache-sized chunk at a time
            stop = min(start + CHUNK, n)
            np.copyto(index_np[: stop - start], q.codes[start:stop])
            part = torch.index_select(q.table, 0, index[: stop - start], out=out[start:stop])
            scale_blocks(part, q.absmax[start // q.block_size :], q.block_size)
    return out


def nesterov_quantized_into(
    param: Tensor,
    momentum_buf: Tensor,
    grad: QuantizedTensor,
    out_param: Tensor,
    out_momentum: Tensor,
    *,
    mu: Tensor,
    rate: Tensor,
    on_theta: Callable[[memoryview], object] | None = None,
) -> bool:
    """`nesterov_into` on a gradient still in int8 form: with the C kernels in one pass that decodes each
    value as it goes (the gradient is never written out), else decode first. The same Θ' and m' bit for
    bit."""
    if grad.shape != tuple(param.shape):
        raise ValueError(f"gradient of shape {grad.shape} for a tensor of shape {tuple(param.shape)}")
    if fused.active() and param.dtype == momentum_buf.dtype == torch.float32:
        theta, m = param.contiguous().view(-1), momentum_buf.contiguous().view(-1)
        new_theta, new_m = out_param.view(-1), out_momentum.view(-1)
        return fused.dequantize_nesterov(
            grad.codes,
            grad.absmax,
            grad.block_size,
            grad.table,
            theta,
            m,
            new_theta,
            new_m,
            mu,
            rate,
            on_theta,
        )
    return nesterov_into(
        param, momentum_buf, grad.decode(), out_param, out_momentum, mu=mu, rate=rate, on_theta=on_theta
    )
