"""Error feedback: what a sender's quantized or sparse frame left out of a delta, carried into its next
delta of the same fragment (learners' deltas in `swarm.outbox`, the synchronizer's sparse outer gradients
in `swarm.merging.outer_feedback_for`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from p2p_diloco.config import default_feedback_decay
from p2p_diloco.protocol import kernels
from p2p_diloco.wire.codecs.blockwise import all_finite
from p2p_diloco.wire.codecs.codec import check_codec, decode_tensors, encode_tensors
from p2p_diloco.wire.codecs.sparse import DEFAULT_DENSITY


class ErrorFeedback:
    """Sender-side quantization residuals, one set per fragment.

    `compress` quantizes delta + stored residual and keeps (delta + old residual - decoded) for the next
    delta of that fragment, so the sum of what receivers decode tracks the sum of the true deltas. With a
    sparse codec the residual also holds every entry that was not among the chunk's top `density`.
    The synchronizer keeps one for its outer gradients when the codec is sparse (`outer_feedback`).
    `decay` < 1 scales the stored residual by it before adding the next delta (old residuals fade); None
    takes the codec's default (`config.default_feedback_decay`: 0.95 sparse, 1.0 dense), as `[wire]` does.

    A dense codec's residual is one rounding error per value (at most half a quantization step), so it
    is kept in bfloat16: 2 B/param instead of 4 (issue #14's memory budget), and what bfloat16 rounds off
    it is about 1/256 of that step. A sparse codec's residual accumulates the unsent values over many
    deltas, where bfloat16 would swamp small additions to large values: it stays float32.
    """

    def __init__(
        self,
        codec: str = "int8",
        block_size: int = 4096,
        enabled: bool = True,
        density: float = DEFAULT_DENSITY,
        decay: float | None = 1.0,
    ):
        self.codec = check_codec(codec, block_size, density)
        decay = default_feedback_decay(self.codec) if decay is None else decay
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.block_size = block_size
        self.density = density
        self.enabled = enabled
        self.residual_dtype = torch.float32 if self.codec.sparse else torch.bfloat16
        self._residuals: dict[int, dict[str, torch.Tensor]] = {}

    def compress(
        self, fragment: int, delta: Mapping[str, torch.Tensor]
    ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """(frame, tensors exactly as a receiver decodes them). Non-finite deltas raise ValueError and
        leave the residual untouched, so one bad step cannot poison later deltas."""
        residual = self._residuals.get(fragment) if self.enabled else None
        if residual is not None and set(residual) != set(delta):
            raise ValueError(f"fragment {fragment}: tensor names changed since the last delta; call reset()")
        corrected: dict[str, torch.Tensor] = {}
        for name, tensor in delta.items():
            value = tensor.detach().to(torch.float32)
            if residual is not None:
                if residual[name].shape != value.shape:
                    raise ValueError(f"fragment {fragment}: {name!r} changed shape; call reset()")
                kept = residual[name].to(value.device, torch.float32)
                value = value + (kept if self.decay == 1.0 else kept * self.decay)
                del kept
            if not all_finite(value):
                raise ValueError(f"fragment {fragment}: delta {name!r} holds NaN or inf; not sent")
            corrected[name] = value
        frame = encode_tensors(corrected, codec=self.codec, block_size=self.block_size, density=self.density)
        shapes = {name: tuple(value.shape) for name, value in corrected.items()}
        decoded = decode_tensors(frame, expected_shapes=shapes, max_bytes=len(frame))
        if self.enabled:
            self._residuals[fragment] = {
                name: (value - decoded[name].to(value.device)).to(self.residual_dtype)
                for name, value in corrected.items()
            }
        return frame, decoded

    def reset(self, fragment: int) -> None:
        self._residuals.pop(fragment, None)

    def residual_norm(self, fragment: int) -> float:
        """L2 norm over all tensors of the fragment's stored residual (0.0 when none)."""
        residual = self._residuals.get(fragment, {})
        return math.sqrt(sum(kernels.sum_squares64(r) for r in residual.values()))
