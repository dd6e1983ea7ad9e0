"""Hostile and broken learners, for tests and benchmarks: rewrites of a learner's outgoing delta frames.

The learner itself trains honestly; `HostileTransport` passes every delta it sends through a
`DeltaAttack` first, so the synchronizer receives well-framed but bad contributions:

- "scaled": every tensor x `scale` (default 100);
- "noise": Gaussian noise with each tensor's norm times `scale` (default 1: the same norm);
- "sign_flip": the negated delta;
- "nan": the delta with NaN in every tensor (a diverged learner);
- "stale_replay": the first delta of each fragment, resent verbatim forever (old anchor, old payload);
- "inflated_tokens": the honest delta claiming `scale` (default 100) times the tokens it trained.

Deterministic for a seed (noise uses its own `torch.Generator`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from p2p_diloco.wire.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import decode_delta, encode_delta
from p2p_diloco.wire.interfaces import Transport
from p2p_diloco.wire.replies import Reply

ATTACKS = ("scaled", "noise", "sign_flip", "nan", "stale_replay", "inflated_tokens")
DEFAULT_SCALE = {"scaled": 100.0, "noise": 1.0, "inflated_tokens": 100.0}
MAX_FRAME_BYTES = 1 << 31


class DeltaAttack:
    """Rewrites delta frames as attack `kind` does (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        *,
        scale: float | None = None,
        seed: int = 0,
        codec: str = "int8",
        block_size: int = 4096,
    ):
        if kind not in ATTACKS:
            raise ValueError(f"unknown attack {kind!r}; expected one of {ATTACKS}")
        self.kind = kind
        self.scale = DEFAULT_SCALE.get(kind, 1.0) if scale is None else scale
        self.codec = codec
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)
        self.first_frames: dict[int, bytes] = {}
        self.rewritten = 0

    def rewrite(self, frame: bytes) -> bytes:
        header, payload = decode_delta(frame, max_bytes=MAX_FRAME_BYTES)
        self.rewritten += 1
        if self.kind == "stale_replay":
            return self.first_frames.setdefault(header.fragment, frame)
        if self.kind == "inflated_tokens":
            return encode_delta(replace(header, tokens=int(header.tokens * self.scale)), payload)
        tensors = decode_tensors(payload, max_bytes=MAX_FRAME_BYTES)
        bad = {name: self._tensor(t) for name, t in tensors.items()}
        return encode_delta(header, encode_tensors(bad, codec=self.codec, block_size=self.block_size))

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.kind == "scaled":
            return t * self.scale
        if self.kind == "sign_flip":
            return -t
        if self.kind == "nan":
            return torch.full_like(t, float("nan"))
        noise = torch.randn(t.shape, generator=self.generator, dtype=torch.float32)
        norm = float(noise.norm())
        return noise * (float(t.norm()) * self.scale / norm) if norm > 0 else noise


class HostileTransport:
    """A `Transport` that rewrites outgoing deltas with `rewrite`; everything else goes to `inner`."""

    def __init__(self, inner: Transport, rewrite: Callable[[bytes], bytes]):
        self.inner = inner
        self.rewrite = rewrite

    def send_delta(self, to_peer: str, frame: bytes, on_reply: Callable[[Reply], None] | None = None) -> None:
        self.inner.send_delta(to_peer, self.rewrite(frame), on_reply)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def hostile_transport(
    inner: Transport, kind: str, *, seed: int = 0, codec: str = "int8", block_size: int = 4096
) -> HostileTransport:
    """`inner` with its deltas rewritten by attack `kind` at its default scale."""
    attack = DeltaAttack(kind, seed=seed, codec=codec, block_size=block_size)
    return HostileTransport(inner, attack.rewrite)
