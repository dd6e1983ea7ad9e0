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

"generic" (`GENERIC`, issue #41) is the hostile learner of the earned-weight rule: it sends every delta
under a **fresh key** (`FreshKeyTransport`: a new sender ID per delta, so no history, no replay memory and no
cool-down ever follows it) and draws, per delta and seeded, what it sends (`GENERIC_MODES`): its honest
delta, the revert above at 1x or 3x the honest norm, the delta scaled 3x, its sign flip, noise at its norm,
or a copy of the latest delta another learner sent (read off the network: `tap_deltas`); and its claim:
the honest steps, 4 x H or 10^6 steps with matching tokens, or 100x the tokens.

Deterministic for a seed (noise and draws use their own `torch.Generator`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from p2p_diloco.protocol.messages import DeltaHeader
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.delta_signature import SignedDelta, payload_digest, sign_delta
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
GENERIC = "generic"
KINDS = (*ATTACKS, GENERIC)  # every kind a swarm's hostile learner may play
GENERIC_MODES = ("honest", "revert", "revert_x3", "scaled_x3", "sign_flip", "noise", "copy")
GENERIC_CLAIMS = ("honest", "four_h", "million", "tokens_x100")
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


class GenericAttack:
    """The generic hostile learner's rewrite (see the module docstring): per delta a seeded draw of what it
    sends (`GENERIC_MODES`) and what it claims (`GENERIC_CLAIMS`); `copies()` gives the latest delta frames
    other learners sent. `drawn` counts (mode, claim) pairs."""

    def __init__(
        self,
        *,
        inner_steps: int,
        toward: Toward,
        copies: Callable[[], list[bytes]],
        seed: int = 0,
        codec: str = "int8",
        block_size: int = 4096,
        density: float | None = None,
    ):
        self.inner_steps = inner_steps
        self.toward = toward
        self.copies = copies
        self.codec = codec
        self.block_size = block_size
        self.density = density  # sparse codecs: the fraction kept
        self.generator = torch.Generator().manual_seed(seed)
        self.drawn: Counter[tuple[str, str]] = Counter()

    def _draw(self, options: tuple[str, ...]) -> str:
        return options[int(torch.randint(len(options), (1,), generator=self.generator))]

    def rewrite(self, frame: bytes) -> bytes:
        mode, claim = self._draw(GENERIC_MODES), self._draw(GENERIC_CLAIMS)
        copies = self.copies()
        if mode == "copy" and not copies:
            mode = "honest"
        self.drawn[(mode, claim)] += 1
        if mode == "copy":
            frame = copies[int(torch.randint(len(copies), (1,), generator=self.generator))]
        header, payload = decode_delta(frame, max_bytes=MAX_FRAME_BYTES)
        if mode not in ("honest", "copy"):
            current, initial = self.toward(header.fragment)
            shapes = {name: tuple(t.shape) for name, t in initial.items()}
            honest = decode_tensors(payload, expected_shapes=shapes, max_bytes=MAX_FRAME_BYTES)
            bad = self._tensors(mode, honest, current, initial)
            extra = {} if self.density is None else {"density": self.density}
            payload = encode_tensors(bad, codec=self.codec, block_size=self.block_size, **extra)
        return encode_delta(self._claim(header, claim), payload)

    def _tensors(
        self,
        mode: str,
        honest: Mapping[str, torch.Tensor],
        current: Mapping[str, torch.Tensor],
        initial: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        if mode.startswith("revert"):
            back = _toward_initial(honest, current, initial)
            return {n: t * 3.0 for n, t in back.items()} if mode == "revert_x3" else back
        if mode == "scaled_x3":
            return {n: t * 3.0 for n, t in honest.items()}
        if mode == "sign_flip":
            return {n: -t for n, t in honest.items()}
        out = {}
        for name, t in honest.items():  # noise at the honest norm
            noise = torch.randn(t.shape, generator=self.generator, dtype=torch.float32)
            norm = float(noise.norm())
            out[name] = noise * (float(t.norm()) / norm) if norm > 0 else noise
        return out

    def _claim(self, header: DeltaHeader, claim: str) -> DeltaHeader:
        if claim == "tokens_x100":
            return replace(header, tokens=header.tokens * 100)
        if claim == "honest" or header.steps <= 0:
            return header
        steps = 4 * self.inner_steps if claim == "four_h" else 10**6
        return replace(header, steps=steps, tokens=header.tokens * steps // header.steps)


class DeltaTap:
    """The latest delta frame each sender sent on a `SimNetwork`, read by wrapping its `deliver` (a test and
    benchmark harness: what any learner that copies others' work could obtain)."""

    def __init__(self, network, *, ignore: Callable[[str], bool]):
        self.latest: dict[str, bytes] = {}
        self.count = 0  # delta frames sent by senders not ignored
        self.ignore = ignore
        deliver = network.deliver

        def tapped(src: str, dst: str, frame: bytes, kind: str, *args, **kwargs) -> None:
            if kind == "delta" and not ignore(src):
                self.latest[src] = frame
                self.count += 1
            deliver(src, dst, frame, kind, *args, **kwargs)

        network.deliver = tapped

    def frames(self) -> list[bytes]:
        return [self.latest[s] for s in sorted(self.latest)]


def tap_deltas(network, *, ignore: Callable[[str], bool]) -> DeltaTap:
    """The network's `DeltaTap` (one per network, created on first use)."""
    tap = getattr(network, "_delta_tap", None)
    if tap is None:
        tap = DeltaTap(network, ignore=ignore)
        network._delta_tap = tap
    return tap


class FreshKeyTransport:
    """A `Transport` over an in-memory network that sends every delta, rewritten by `rewrite`, from a new
    sender ID (`<prefix>-<n>`): a learner with a fresh key per delta. The ID answers like its peer while
    the reply is on its way, then leaves the network. Everything else goes to `inner`."""

    def __init__(self, inner, rewrite: Callable[[bytes], bytes], prefix: str):
        self.inner = inner
        self.rewrite = rewrite
        self.prefix = prefix
        self.sent = 0
        self.handlers = None

    def bind(self, handlers) -> None:
        self.handlers = handlers
        self.inner.bind(handlers)

    def send_delta(self, to_peer: str, frame: bytes, on_reply: Callable[[Reply], None] | None = None) -> None:
        self.sent += 1
        fresh = f"{self.prefix}-{self.sent}"
        network = self.inner.network
        network.register(fresh, self.handlers)

        def answered(reply: Reply) -> None:
            network.unregister(fresh)
            if on_reply is not None:
                on_reply(reply)

        network.deliver(fresh, to_peer, self.rewrite(frame), "delta", answered)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class FreshKeyAdversary:
    """Generic hostile learners outside an in-process swarm (`swarm.inprocess.InProcessSwarm`): they train
    nothing, and send `share` of all the deltas the holder receives, each drawn by a `GenericAttack` from the
    honest deltas on the network (`DeltaTap`), anchored at the holder's current version of its fragment, under
    a new key (`fresh-<n>`). They act once the holder's standing has history (some key has `new_peer_rounds`
    merged rounds): before that every merged key is one of the run's founders. The honest run to compare
    with is the same seeded swarm without them: nothing else of theirs reaches an honest peer."""

    PREFIX = "fresh-"

    def __init__(self, swarm, *, share: float, seed: int, tick: float = 0.1):
        if not 0 < share < 1:
            raise ValueError(f"share must be in (0, 1), got {share}")
        self.swarm, self.share, self.tick = swarm, share, tick
        self.tap = tap_deltas(swarm.network, ignore=lambda sender: sender.startswith(self.PREFIX))
        wire, cfg = swarm.manifest.wire, swarm.manifest.diloco
        self.attack = GenericAttack(
            inner_steps=cfg.inner_steps,
            toward=self._toward,
            copies=self.tap.frames,
            seed=seed,
            codec=wire.codec,
            block_size=wire.block_size,
            density=wire.density if wire.codec.sparse else None,
        )
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.sent = 0

    def install(self) -> None:
        self.swarm.loop.call_at(self.tick, self._act)

    def _holder(self):
        return next((p for p in self.swarm.peers.values() if p.sync is not None), None)

    def _toward(self, fragment: int):
        holder = self._holder()
        names = self.swarm.plan.names(fragment)
        return holder.replica.params_view(fragment), {n: self.swarm.initial[n] for n in names}

    def _act(self) -> None:
        holder, frames = self._holder(), self.tap.frames()
        if holder is not None and frames and self._history(holder):
            while self.sent < self.share / (1 - self.share) * self.tap.count:
                self._send(holder, frames)
        self.swarm.loop.call_later(self.tick, self._act)

    @staticmethod
    def _history(holder) -> bool:
        standing = holder.robust.standing
        return any(n >= standing.new_peer_rounds for n in standing.rounds.values())

    def _send(self, holder, frames: list[bytes]) -> None:
        base = frames[int(torch.randint(len(frames), (1,), generator=self.generator))]
        header, payload = decode_delta(self.attack.rewrite(base), max_bytes=MAX_FRAME_BYTES)
        self.sent += 1
        header = replace(header, anchor_version=holder.replica.version(header.fragment), seq=self.sent)
        sender = f"{self.PREFIX}{self.sent}"
        if self.swarm.manifest.wire.codec.sparse:  # union rounds list signed deltas: signed by the fresh key
            h = header
            signed = SignedDelta(
                h.run_id,
                h.manifest_hash,
                sender,
                h.fragment,
                h.anchor_version,
                h.seq,
                h.tokens,
                payload_digest(payload),
            )
            header = replace(header, signature=sign_delta(self.swarm.keys.signer(sender), signed))
        self.swarm.network.deliver(sender, holder.peer_id, encode_delta(header, payload), "delta", None)


def generic_transport(
    inner,
    *,
    inner_steps: int,
    toward: Toward,
    seed: int = 0,
    codec: str = "int8",
    block_size: int = 4096,
) -> FreshKeyTransport:
    """`inner` (an `InMemoryTransport`) as the generic hostile learner: fresh keys, seeded draws."""
    prefix = f"fresh-{inner.peer_id}"
    tap = tap_deltas(inner.network, ignore=lambda sender: sender.startswith("fresh-"))
    copies = lambda: [f for s, f in sorted(tap.latest.items()) if s != inner.peer_id]  # noqa: E731
    attack = GenericAttack(
        inner_steps=inner_steps, toward=toward, copies=copies, seed=seed, codec=codec, block_size=block_size
    )
    return FreshKeyTransport(inner, attack.rewrite, prefix)


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
