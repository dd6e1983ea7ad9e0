"""Fast kernels behind throughput at model scale: the table-lookup int8 code search must equal
`torch.bucketize` bit for bit (random bit patterns in [-1, 1], every bound and its float neighbours)."""

from __future__ import annotations

import torch

from p2p_diloco.wire.blockwise import _CODE_BOUNDS, _lut, nearest_codes
from p2p_diloco.wire.sparse import _INT4_BOUNDS as SPARSE_BOUNDS


def reference(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(x, bounds, out_int32=True).to(torch.uint8)


def test_lookup_codes_equal_bucketize_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(-(2**31), 2**31 - 1, (2_000_000,), generator=gen, dtype=torch.int64)
    floats = raw.to(torch.int32).view(torch.float32)
    values = floats[torch.isfinite(floats) & (floats.abs() <= 1)]
    normal = torch.clamp(torch.randn(1_000_000, generator=gen) * 0.2, -1, 1)
    for bounds in (_CODE_BOUNDS, SPARSE_BOUNDS):
        b = bounds.to(torch.float32)
        assert _lut(b) is not None  # the table is exact for this code book
        up, down = torch.nextafter(b, torch.full_like(b, 2.0)), torch.nextafter(b, torch.full_like(b, -2.0))
        edges = torch.cat([b, up, down, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30])])
        for x in (values, normal, edges):
            assert torch.equal(nearest_codes(x, b), reference(x, b))
