"""Hostile and broken learners, for tests and benchmarks: rewrites of a learner's outgoing delta frames.

The learner itself trains honestly; `HostileTransport` passes every delta it sends through a
`DeltaAttack` first, so the synchronizer receives well-framed but bad contributions:

- "scaled": every tensor x `scale` (default 100);
- "noise": Gaussian noise with each tensor's norm times `scale` (default 1: the same norm);
- "sign_flip": the negated delta;
- "nan": the delta with NaN in every tensor (a diverged learner);
- "stale_replay": the first delta of each fragment, resent verbatim forever (old anchor, old payload);
- "inflated_tokens": the honest delta claiming `scale` (default 100) times the tokens it trained;
- "inflated_claim": the honest delta claiming `scale` (default 10^6) inner steps with the matching tokens
  (so the tokens-per-step check passes): a claim for more merge weight;
- "revert": a delta that looks honest (each tensor at the norm of the honest one) but points from the
  current global weights back toward the initial ones, claiming `scale` (default 10^6) steps with
  matching tokens (issue #12). Needs `toward(fragment) -> (global params, initial params)`.

Deterministic for a seed (noise uses its own `torch.Generator`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import decode_delta, encode_delta
from p2p_diloco.wire.interfaces import Transport
from p2p_diloco.wire.replies import Reply

ATTACKS = (
    "scaled",
    "noise",
    "sign_flip",
    "nan",
    "stale_replay",
    "inflated_tokens",
    "inflated_claim",
    "revert",
)
DEFAULT_SCALE = {
    "scaled": 100.0,
    "noise": 1.0,
    "inflated_tokens": 100.0,
    "inflated_claim": 1e6,
    "revert": 1e6,
}
# (global params, initial params) of one fragment, for "revert"
Toward = Callable[[int], tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]
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
        toward: Toward | None = None,
    ):
        if kind not in ATTACKS:
            raise ValueError(f"unknown attack {kind!r}; expected one of {ATTACKS}")
        if kind == "revert" and toward is None:
            raise ValueError("the revert attack needs toward(fragment) -> (global params, initial params)")
        self.toward = toward
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
        if self.kind in ("inflated_claim", "revert"):
            steps = int(self.scale)
            header = replace(header, steps=steps, tokens=header.tokens * steps // header.steps)
            if self.kind == "inflated_claim":
                return encode_delta(header, payload)
        # chunked frames name no tensors: their shapes come from the replica when `toward` is given
        initial = None if self.toward is None else self.toward(header.fragment)[1]
        shapes = None if initial is None else {name: tuple(t.shape) for name, t in initial.items()}
        tensors = decode_tensors(payload, expected_shapes=shapes, max_bytes=MAX_FRAME_BYTES)
        if self.kind == "revert":
            assert self.toward is not None
            bad = _toward_initial(tensors, *self.toward(header.fragment))
        else:
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


def _toward_initial(
    honest: Mapping[str, torch.Tensor],
    current: Mapping[str, torch.Tensor],
    initial: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Per tensor, current - initial at the honest delta's norm: the outer step (Θ - lr·Δ) then moves the
    global weights back toward their initial values by as much as an honest delta moves them forward."""
    out = {}
    for name, t in honest.items():
        back = current[name].float() - initial[name].float()
        norm = float(back.norm())
        out[name] = back * (float(t.norm()) / norm) if norm > 0 else torch.zeros_like(t)
    return out


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
    inner: Transport,
    kind: str,
    *,
    seed: int = 0,
    codec: str = "int8",
    block_size: int = 4096,
    toward: Toward | None = None,
) -> HostileTransport:
    """`inner` with its deltas rewritten by attack `kind` at its default scale (`toward`: for "revert")."""
    attack = DeltaAttack(kind, seed=seed, codec=codec, block_size=block_size, toward=toward)
    return HostileTransport(inner, attack.rewrite)
