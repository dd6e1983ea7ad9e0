"""What one peer lets others cost it on the transport: stream limits, per-op size caps, stream slots.

Any peer may be hostile and may hold streams open, so the inbound side bounds every resource a remote
peer can tie up (`net.serving` enforces these):

* `InboundLimits`: at most `per_peer` concurrent inbound streams per remote peer and `total` in all
  (peers in `priority_peers`, e.g. the run's synchronizers, are not counted against `total`, so a swarm
  of strangers cannot lock them out); a request header must arrive within `header_timeout` seconds of
  the stream opening; then the body must keep up an average of `min_body_rate` bytes/s after a grace of
  `body_grace` seconds; the whole request is bounded by `request_timeout`.
* `FrameCaps`: per operation, the largest request body a receiver reads and the largest reply a caller
  reads (per item and in all). `run_frame_caps` computes them from the run's manifest and fragment
  shapes: a delta or update frame is capped at the exact size of the largest fragment's frame under the
  run's codec, a snapshot reply at the largest fragment's snapshot. A new operation slots in as a key.
* `StreamSlots`: the bookkeeping of who holds which stream slots; it holds an entry only for peers with a
  stream in progress, so its state is bounded by the streams it admitted.
* `OutboundSlots`: the sending side's courtesy: an honest peer opens at most `per_peer` streams to one
  peer at a time (the rest wait their turn), so it never runs into the receiver's own limit.

`run_transport_options` gathers a run's caps, limits and admission rules as `P2PTransport` arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from p2p_diloco.config import RunManifest
from p2p_diloco.net import streams
from p2p_diloco.net.admission import stream_admission
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.swarm.updates import UPDATE_LOG_LENGTH
from p2p_diloco.wire import keys
from p2p_diloco.wire.codecs.codec import frame_size
from p2p_diloco.wire.delta_bundle import bundle_bound
from p2p_diloco.wire.frames import delta_frame_bound, snapshot_frame_bound, update_frame_bound
from p2p_diloco.wire.relay_frames import MAX_OFFER_BYTES, RELAY_HEAD_BYTES
from p2p_diloco.wire.snapshot_chunks import CHUNK_REQUEST_BYTES, MAX_CHUNK_BYTES

# reasons of inbound rejections that the limits cause (sent back to the caller when it can still listen)
REJECT_PEER_BUSY = "peer busy"  # this remote peer already holds `per_peer` streams
REJECT_HEADER_TIMEOUT = "header timeout"  # no request header within `header_timeout`
REJECT_TOO_SLOW = "too slow"  # the body fell below `min_body_rate`
REJECT_BUSY = "busy"  # `total` streams in progress (or the peer's answer did not come in time)

REPLY_BYTES = 8192  # a delta's or an update's answer: one typed `Reply`
DEFAULT_FRAME_BYTES = 256 * 1024 * 1024
DEFAULT_REPLY_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True)
class InboundLimits:
    """Bounds on what inbound streams may hold (module docstring). Times in seconds, rates in bytes/s."""

    per_peer: int = 2
    total: int = 32
    header_timeout: float = 5.0
    min_body_rate: float = 64 * 1024
    body_grace: float = 3.0
    request_timeout: float = 120.0
    priority_peers: frozenset[str] = frozenset()
    max_lingering: int = 16  # rejected streams drained at once (`net.serving.LINGER_SECONDS`); beyond: closed

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority_peers", frozenset(self.priority_peers))
        if self.per_peer < 1 or self.total < 1:
            raise ValueError(f"per_peer and total must be >= 1, got {self.per_peer} and {self.total}")
        if min(self.header_timeout, self.request_timeout) <= 0 or self.min_body_rate <= 0:
            raise ValueError("header_timeout, request_timeout and min_body_rate must be > 0")
        if self.body_grace < 0 or self.max_lingering < 0:
            raise ValueError("body_grace and max_lingering must be >= 0")


@dataclass(frozen=True)
class FrameCaps:
    """Per-op caps in bytes: `requests[op]` on a request body, `replies[op]` = (per item, in all) on a
    reply; an op in neither mapping gets `default_request` / `default_reply`."""

    requests: Mapping[str, int] = field(default_factory=dict)
    replies: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    default_request: int = DEFAULT_FRAME_BYTES
    default_reply: tuple[int, int] = (DEFAULT_FRAME_BYTES, DEFAULT_REPLY_BYTES)

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", MappingProxyType(dict(self.requests)))
        object.__setattr__(self, "replies", MappingProxyType(dict(self.replies)))

    def request(self, op: str) -> int:
        return self.requests.get(op, self.default_request)

    def reply(self, op: str) -> tuple[int, int]:
        return self.replies.get(op, self.default_reply)

    @classmethod
    def uniform(cls, max_frame_bytes: int, max_reply_bytes: int) -> FrameCaps:
        """Caps that know no run: every frame up to `max_frame_bytes`, fetch replies up to
        `max_reply_bytes`."""
        return cls(
            requests={
                keys.OP_DELTA: max_frame_bytes,
                keys.OP_UPDATE: max_frame_bytes,
                keys.OP_RELAY: max_frame_bytes,
                keys.OP_FETCH_UPDATES: streams.FETCH_BODY_BYTES,
                keys.OP_FETCH_SNAPSHOT: streams.FRAGMENT_BODY_BYTES,
                keys.OP_FETCH_CHUNK: CHUNK_REQUEST_BYTES,
            },
            replies={
                keys.OP_DELTA: (REPLY_BYTES, REPLY_BYTES),
                keys.OP_UPDATE: (REPLY_BYTES, REPLY_BYTES),
                keys.OP_RELAY: (REPLY_BYTES, REPLY_BYTES),
                keys.OP_FETCH_UPDATES: (max_frame_bytes, max_reply_bytes),
                keys.OP_FETCH_SNAPSHOT: (max_frame_bytes, max_frame_bytes),
                keys.OP_FETCH_CHUNK: (MAX_CHUNK_BYTES, MAX_CHUNK_BYTES),
            },
            default_request=max_frame_bytes,
            default_reply=(max_frame_bytes, max_reply_bytes),
        )


def run_frame_caps(
    manifest: RunManifest,
    plan: FragmentPlan,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    max_reply_bytes: int = DEFAULT_REPLY_BYTES,
    updates_per_reply: int = UPDATE_LOG_LENGTH,
) -> FrameCaps:
    """The caps of a run with fragments `plan` over tensors of `shapes` (name -> shape).

    Deltas and updates carry one fragment under `[wire] codec` (sparse codecs keep exactly
    `chunk_keep(density)` entries a chunk, so their size is known too); snapshots carry params and
    momentum as fp32 frames. Every cap is the largest fragment's and at most `wire.max_message_bytes`
    (what the decoders accept anyway). A fetch of updates answers at most `updates_per_reply` update
    frames (a peer's log of a fragment), each capped, together at most `max_reply_bytes`.
    """
    wire = manifest.wire
    fragment_shapes = [{n: tuple(shapes[n]) for n in plan.names(p)} for p in range(plan.num_fragments)]
    payload = max(
        frame_size(shapes, codec=wire.codec, block_size=wire.block_size, density=wire.density)
        for shapes in fragment_shapes
    )
    fp32 = max(2 * frame_size(shapes, codec="fp32") for shapes in fragment_shapes)
    limit = wire.max_message_bytes
    sparse = wire.codec.sparse  # signed deltas; an update bundles up to MAX_BUNDLED of them (union rounds)
    delta = min(limit, delta_frame_bound(manifest.run_id, manifest.manifest_hash, payload, signed=sparse))
    update = min(limit, update_frame_bound(bundle_bound(delta) if sparse else payload))
    snapshot = min(limit, snapshot_frame_bound(manifest.run_id, manifest.manifest_hash, fp32))
    uniform = FrameCaps.uniform(limit, max_reply_bytes)
    return FrameCaps(
        requests={
            **uniform.requests,
            keys.OP_DELTA: delta,
            keys.OP_UPDATE: update,
            keys.OP_RELAY: min(limit, max(update + RELAY_HEAD_BYTES, MAX_OFFER_BYTES)),
        },
        replies={
            **uniform.replies,
            keys.OP_FETCH_UPDATES: (update, min(max_reply_bytes, updates_per_reply * update)),
            keys.OP_FETCH_SNAPSHOT: (snapshot, snapshot),
        },
        default_request=limit,
        default_reply=(limit, max_reply_bytes),
    )


class StreamSlots:
    """Who holds inbound stream slots now: `acquire` admits a stream or names why not, `release` frees it."""

    def __init__(self, limits: InboundLimits):
        self.limits = limits
        self.by_peer: dict[str, int] = {}  # only peers with a stream in progress
        self.counted = 0  # streams counted against `limits.total` (priority peers' are not)

    def acquire(self, peer: str) -> tuple[str, str] | None:
        """None if admitted (call `release(peer)` when done); else (rejection tag, detail)."""
        held = self.by_peer.get(peer, 0)
        if held >= self.limits.per_peer:
            return REJECT_PEER_BUSY, f"{held} requests from {peer} already in progress"
        priority = peer in self.limits.priority_peers
        if not priority and self.counted >= self.limits.total:
            return REJECT_BUSY, f"{self.counted} requests already in progress"
        self.by_peer[peer] = held + 1
        self.counted += not priority
        return None

    def release(self, peer: str) -> None:
        held = self.by_peer.pop(peer, 0)
        if held > 1:
            self.by_peer[peer] = held - 1
        if held and peer not in self.limits.priority_peers:
            self.counted -= 1

    def __len__(self) -> int:
        return sum(self.by_peer.values())


class OutboundSlots:
    """At most `per_peer` concurrent outbound streams to one peer; `async with slots.slot(peer)` waits its
    turn. Runs on one event loop; holds an entry only for peers with a stream open or waiting."""

    def __init__(self, per_peer: int):
        self.per_peer = per_peer
        self._slots: dict[str, tuple[asyncio.Semaphore, int]] = {}  # peer -> (semaphore, users)

    @contextlib.asynccontextmanager
    async def slot(self, peer: str) -> AsyncIterator[None]:
        semaphore, users = self._slots.get(peer, (None, 0))
        if semaphore is None:
            semaphore = asyncio.Semaphore(self.per_peer)
        self._slots[peer] = (semaphore, users + 1)
        try:
            async with semaphore:
                yield
        finally:
            semaphore, users = self._slots[peer]
            if users > 1:
                self._slots[peer] = (semaphore, users - 1)
            else:
                del self._slots[peer]

    def __len__(self) -> int:
        return len(self._slots)


def priority_peers_of(manifest: RunManifest, extra: Collection[str] = ()) -> frozenset[str]:
    """Peers whose streams are not counted against `InboundLimits.total`: the run's listed synchronizers
    and its authority (a public run's trusted peers), plus `extra`."""
    trust = manifest.trust
    return frozenset((*trust.synchronizers, *([trust.authority] if trust.authority else ()), *extra))


def run_transport_options(
    manifest: RunManifest, plan: FragmentPlan, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """`P2PTransport` keyword arguments for a peer of `manifest`'s run: its exact frame caps, the default
    stream limits with its named synchronizers and authority as priority peers, its participants as the
    allowlist and its trust rules per op."""
    return {
        "caps": run_frame_caps(manifest, plan, shapes),
        "limits": InboundLimits(priority_peers=priority_peers_of(manifest)),
        "allowed_peers": manifest.participants(),
        "admit": stream_admission(manifest),
    }
