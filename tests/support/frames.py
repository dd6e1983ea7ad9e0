"""Valid tensor frames of every codec, the seeds that decoder fuzz tests mutate."""

from __future__ import annotations

import torch

from p2p_diloco.wire.codecs.codec import encode_tensors

_TENSORS = {"a": torch.randn(3, 40, generator=torch.Generator().manual_seed(0)), "b.bias": torch.randn(7)}

VALID_FRAMES = [
    encode_tensors(_TENSORS, codec="int8", block_size=64),
    encode_tensors({"a": torch.randn(3, 4), "b": torch.randn(2)}, codec="fp32"),
    *(
        encode_tensors(_TENSORS, codec=codec, block_size=64, density=density)
        for codec in ("topk-int8", "topk-int4")
        for density in (0.1, 0.5)
    ),
]
