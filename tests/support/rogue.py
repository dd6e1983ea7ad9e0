"""A rogue peer for hostile-peer tests: a real DHT peer and libp2p transport of a run, with one method
per attack of issue #12 ("Public runs that survive strangers").

It is built only from the project's public pieces (`write_identity`, `DhtKeyValueStore`, `P2PTransport`,
`RsaRecordSigner`, `wire.keys`, `wire.records`, `wire.frames`, `wire.codecs.codec`, `net.streams`), so it can do
exactly what a stranger on the internet can: write records under its *own* peer ID (DHT records are
owner-signed; it cannot write under an honest peer's ID), sign update records with its own key, open
streams to honest peers, answer their requests with whatever it likes, and read everything that is
public (snapshots, update logs, heartbeats).

A rogue that is *listed* in the manifest's `[trust] synchronizers` (an insider whose key leaked, or a
synchronizer gone bad) is the same class started with that key: `forge_lease` then tests the lease rules
that apply to listed holders (term jump, expiry, claimed early) instead of "may not synchronize".

    rogue = Rogue.start(manifest, dht_peer)        # dht_peer: a `DhtPeer` of the run (its own key)
    rogue.forge_lease(term=t + 1000, expires_at=rogue.now() + 3600)
    reply = rogue.push_update(target, rogue.forge_update(target, fragment=0, term=t + 1000))
    with rogue.sustain(lambda: rogue.forge_heartbeat(...), period=0.5): ...
    rogue.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.net import streams
from p2p_diloco.net.dht_store import DhtKeyValueStore, DhtPeer
from p2p_diloco.net.record_signing import RsaRecordSigner
from p2p_diloco.net.transport import P2PTransport
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.fragments import FragmentPlan, plan_fragments
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica, fragment_checksum
from p2p_diloco.wire import keys
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import decode_update, encode_delta, encode_update, update_signing_bytes
from p2p_diloco.wire.records import HeartbeatInfo, RecordError, decode_heartbeat, encode_lease
from p2p_diloco.wire.replies import Reply
from p2p_diloco.wire.snapshot_chunks import THETA, SnapshotIndex, chunk_digest, chunk_layout, encode_index
from tests.support.snapshots import fetch_fragment_state

MAX_TENSOR_BYTES = 1 << 28
# The outer gradient of a forged update, on every entry: it shifts every weight of the fragment by about
# lr x (1 + momentum) x 0.2 (destructive), yet its RMS stays under the update screen of public runs (10 x
# the median RMS of recent updates, about 0.4 on the tests' tiny model), so only the lease stops it.
STEALTHY_FILL = 0.2
_U64 = struct.Struct(">Q")


async def _daemon_listen_maddr(_dht: Any, node: Any) -> Any:
    return node.p2p.daemon_listen_maddr


class _RogueHandlers:
    """What the rogue answers on its transport: deltas and updates refused, no update log, and the
    snapshots it was told to serve (`Rogue.serve_poisoned_snapshot`); b"" for any other fragment."""

    def __init__(self) -> None:
        self.snapshots: dict[int, tuple[bytes, list[bytes]]] = {}  # fragment -> (index frame, chunks)
        self.served: list[tuple[str, int]] = []  # (requester, fragment) of every poisoned snapshot served

    def handle_delta(self, sender: str, frame: bytes) -> Reply:
        return Reply.refused("not synchronizing", "the rogue merges nothing")

    def handle_update(self, sender: str, frame: bytes) -> Reply:
        return Reply.refused("ignored", "the rogue keeps no replica")

    def handle_relay(self, sender: str, frame: bytes) -> Reply:
        return Reply.refused("ignored", "the rogue keeps no replica")

    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
        return []

    def serve_snapshot(self, requester: str, fragment: int) -> bytes:
        index, _ = self.snapshots.get(fragment, (b"", []))
        if index:
            self.served.append((requester, fragment))
        return index

    def serve_chunk(self, requester: str, fragment: int, chunk: int, checksum: str) -> bytes:
        _, chunks = self.snapshots.get(fragment, (b"", []))
        if not 0 <= chunk < len(chunks):
            raise LookupError(f"no chunk {chunk} of fragment {fragment}")
        return chunks[chunk]


@dataclasses.dataclass(frozen=True)
class StateId:
    """Which state of a fragment a peer served: its version and checksum."""

    version: int
    checksum: str


@dataclasses.dataclass
class Fetched:
    """One honest peer's fragment as served to anyone: its snapshot and decoded tensors."""

    snapshot: StateId
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]


class Rogue:
    """A hostile peer of `manifest`'s run on `dht_peer` (module docstring). Close it before the DHT peer."""

    def __init__(
        self,
        manifest: RunManifest,
        dht_peer: DhtPeer,
        *,
        key_path: str | os.PathLike[str] | None = None,
        timeout: float = 20.0,
    ):
        """`key_path`: the rogue's identity file; with it, its updates carry its own valid signature (as a
        synchronizer's do), so they are refused for the lease they lack, not for a missing signature."""
        self.manifest = manifest
        self.signer = RsaRecordSigner(key_path) if key_path is not None else None
        self.dht_peer = dht_peer
        self.peer_id = dht_peer.peer_id
        self.kv = DhtKeyValueStore(dht_peer, timeout=5.0)
        self.handlers = _RogueHandlers()
        self.transport = P2PTransport(
            dht_peer.dht,
            run_id=manifest.run_id,
            manifest_hash=manifest.manifest_hash,
            handlers=self.handlers,
            send_timeout=timeout,
            fetch_timeout=timeout,
        )
        model = build_model(manifest.model)
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        self.plan: FragmentPlan = plan_fragments(
            shapes, manifest.diloco.fragments, manifest.diloco.fragment_pattern
        )
        self._seq = 0
        # the rogue's own libp2p client for raw streams (idle-stream attack), on its own event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._p2p: Any = None
        self._held: list[Any] = []  # writers of the idle streams it holds

    # ---- reading what is public ------------------------------------------------------------------

    @staticmethod
    def now() -> float:
        return get_dht_time()

    def heartbeats(self) -> dict[str, HeartbeatInfo]:
        """Every live, well-formed heartbeat of the run, by peer ID."""
        found = {}
        key = keys.heartbeat_key(self.manifest.run_id, self.manifest.manifest_hash)
        for peer, stored in self.kv.get(key, self.now()).items():
            try:
                found[peer] = decode_heartbeat(stored.value, self.manifest.diloco.fragments)
            except RecordError:
                continue
        return found

    def fetch(self, from_peer: str, fragment: int) -> Fetched:
        """`from_peer`'s snapshot of `fragment` (every peer serves them to anyone of the run)."""
        version, checksum, params, momentum = fetch_fragment_state(
            self.transport, from_peer, fragment, self.shapes(fragment)
        )
        return Fetched(StateId(version, checksum), params, momentum)

    def shapes(self, fragment: int) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self.initial[n].shape) for n in self.plan.names(fragment)}

    def latest_outer_gradient(self, from_peer: str, fragment: int) -> dict[str, torch.Tensor] | None:
        """The payload of the newest update in `from_peer`'s log for `fragment` (what honest deltas merge
        to: the scale an honest-looking delta should have), None if its log is empty."""
        frames = self.transport.fetch_updates(from_peer, fragment, 0)
        if not frames:
            return None
        record = decode_update(frames[-1], max_bytes=self.manifest.wire.max_message_bytes)
        return decode_tensors(
            record.payload, expected_shapes=self.shapes(fragment), max_bytes=MAX_TENSOR_BYTES
        )

    # ---- DHT records under its own ID --------------------------------------------------------------

    def forge_lease(
        self,
        term: int,
        expires_at: float,
        *,
        rounds_done: int = 0,
        released: bool = False,
        visible_for: float | None = None,
        shard: int = 0,
    ) -> LeaseRecord:
        """A lease record of synchronizer `shard`'s `term` held by the rogue, logically expiring at
        `expires_at`; stored so it stays visible in the DHT for `visible_for` seconds (default: a lease TTL)
        past both now and `expires_at`."""
        lease = LeaseRecord(self.peer_id, term, expires_at, rounds_done, released)
        ttl = self.manifest.timing.lease_ttl if visible_for is None else visible_for
        key = keys.lease_key(self.manifest.run_id, self.manifest.manifest_hash, shard)
        self.kv.store(key, self.peer_id, encode_lease(lease), max(expires_at, self.now()) + ttl)
        return lease

    def lease_visible(self, shard: int = 0) -> bool:
        """Whether the DHT returns a lease record of the rogue for `shard` (what every reader then sees)."""
        key = keys.lease_key(self.manifest.run_id, self.manifest.manifest_hash, shard)
        try:
            return self.peer_id in self.kv.get(key, self.now())
        except TimeoutError:
            return False

    def forge_expired_lease(self, term: int, *, ago: float = 1.0) -> LeaseRecord:
        """A lease of `term` that lapsed `ago` seconds ago (still readable in the DHT for a while)."""
        return self.forge_lease(term, self.now() - ago, visible_for=4 * self.manifest.timing.lease_ttl)

    def forge_heartbeat(
        self,
        versions: tuple[int, ...],
        term_seen: int,
        *,
        tips: tuple[tuple[int, str], ...] = (),
        may_sync: bool = True,
        role: str = "learner",
        digest: str = "",
        ttl: float | None = None,
    ) -> HeartbeatInfo:
        """A heartbeat of the rogue claiming `versions`, `term_seen` and branch `tips` (empty or one
        (term, 16-hex checksum) per fragment); expires after `ttl` (default: the manifest's heartbeat TTL)."""
        info = HeartbeatInfo(
            role=role,
            may_sync=may_sync,
            reachable=True,
            versions=tuple(versions),
            term_seen=term_seen,
            digest=digest,
            tips=tuple(tips),
            addresses=tuple(self.dht_peer.visible_addresses()[:4]),
        )
        key = keys.heartbeat_key(self.manifest.run_id, self.manifest.manifest_hash)
        ttl = self.manifest.timing.heartbeat_ttl if ttl is None else ttl
        self.kv.store(key, self.peer_id, info.to_bytes(), self.now() + ttl)
        return info

    @contextlib.contextmanager
    def sustain(self, attack: Callable[[], object], period: float) -> Iterator[list[int]]:
        """Repeat `attack` every `period` seconds on a background thread while the block runs (an attack
        that keeps its records fresh, like a peer's heartbeat); yields a one-item list counting the repeats.
        The first repetition runs before the block starts."""
        stop = threading.Event()
        count = [0]
        attack()
        count[0] += 1

        def loop() -> None:
            while not stop.wait(period):
                try:
                    attack()
                    count[0] += 1
                except Exception:  # a DHT hiccup: the next period tries again
                    pass

        thread = threading.Thread(target=loop, name="rogue-sustain", daemon=True)
        thread.start()
        try:
            yield count
        finally:
            stop.set()
            thread.join(timeout=10)

    # ---- updates ----------------------------------------------------------------------------------

    def forge_update(
        self, source: str, fragment: int, term: int, *, fill: float = STEALTHY_FILL, signature: Any = None
    ) -> UpdateRecord:
        """A destructive update of `fragment` (outer gradient `fill` everywhere) by the rogue as leader of
        `term`, built on `source`'s current state so its checksum is right: were its lease believed, the
        update would apply. Signed with the rogue's own key when it has one; `signature` replaces that
        (e.g. garbage, or another record's)."""
        fetched = self.fetch(source, fragment)
        snap = fetched.snapshot
        shapes = self.shapes(fragment)
        payload = encode_tensors({n: torch.full(s, fill) for n, s in shapes.items()}, codec="int8")
        replica = GlobalReplica(self.plan, {**self.initial, **fetched.params})
        replica.load_fragment(fragment, snap.version, fetched.params, fetched.momentum, snap.checksum)
        grad = decode_tensors(payload, expected_shapes=shapes, max_bytes=MAX_TENSOR_BYTES)
        cfg = self.manifest.diloco
        pending = replica.compute_update(fragment, grad, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        fields: dict[str, Any] = dict(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=fragment,
            from_version=snap.version,
            term=term,
            leader=self.peer_id,
            contributors=((self.peer_id, 1.0),),
            checksum=pending.checksum,
            payload=payload,
        )
        record = UpdateRecord(**fields)
        if signature is not None:
            return dataclasses.replace(record, signature=signature)
        if self.signer is not None:
            return dataclasses.replace(record, signature=self.signer.sign(update_signing_bytes(record)))
        return record

    def push_update(self, to: str, record: UpdateRecord, timeout: float = 20.0) -> Reply:
        """Push `record` to `to` as a synchronizer would; the receiver's typed reply."""
        return self.transport.send_and_wait(keys.OP_UPDATE, to, encode_update(record), timeout=timeout)

    def push_destructive_update(
        self, to: str, term: int, fragment: int = 0, *, tries: int = 10, fill: float = STEALTHY_FILL
    ) -> list[Reply]:
        """`forge_update` on `to`'s own state, pushed to `to`; retried while the fragment moved on under us
        ("duplicate update" / "out of order": honest training goes on meanwhile). All replies, in order."""
        replies: list[Reply] = []
        for _ in range(tries):
            replies.append(self.push_update(to, self.forge_update(to, fragment, term, fill=fill)))
            if replies[-1].tag not in ("duplicate update", "out of order"):
                break
        return replies

    # ---- deltas -----------------------------------------------------------------------------------

    def revert_delta(
        self, source: str, fragment: int, *, scale_like: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[StateId, dict[str, torch.Tensor]]:
        """A delta of `fragment` pointing from `source`'s current global weights back to the initial ones
        (the outer step Θ - lr·Δ with Δ ∝ Θ - Θ₀ moves Θ toward Θ₀), each tensor scaled to the norm of the
        same tensor in `scale_like` (e.g. the latest merged outer gradient: it then looks honest)."""
        fetched = self.fetch(source, fragment)
        delta = {}
        for name, theta in fetched.params.items():
            toward_initial = theta - self.initial[name]
            norm = float(toward_initial.norm())
            target = float(scale_like[name].norm()) if scale_like is not None else norm
            delta[name] = toward_initial * (target / norm) if norm > 0 else toward_initial
        return fetched.snapshot, delta

    def send_delta(
        self,
        to: str,
        fragment: int,
        anchor_version: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        steps: int,
        tokens: int | None = None,
        timeout: float = 20.0,
    ) -> Reply:
        """One delta frame to `to` claiming `steps` inner steps and `tokens` tokens (default: the matching
        count, steps x batch x block, so the token-per-step check passes)."""
        if tokens is None:
            tokens = steps * self.manifest.diloco.batch_size * self.manifest.model.block_size
        self._seq += 1
        header = DeltaHeader(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=fragment,
            anchor_version=anchor_version,
            tokens=tokens,
            steps=steps,
            seq=self._seq,
        )
        wire = self.manifest.wire
        payload = encode_tensors(dict(tensors), codec="int8", block_size=wire.block_size)
        return self.transport.send_and_wait(keys.OP_DELTA, to, encode_delta(header, payload), timeout=timeout)

    def _paced(
        self,
        to: str,
        source: str,
        rounds: int,
        steps: int,
        make: Callable[[int], Mapping | None],
        timeout: float,
        stale: int = 0,
    ) -> list[tuple[int, Reply]]:
        """`rounds` deltas per fragment made by `make(fragment)` (None: skip), each on a newer version of the
        fragment than the last (the same payload twice is a replay, refused as such: not this attack),
        claiming an anchor `stale` versions older than the fragment's current one."""
        replies: list[tuple[int, Reply]] = []
        last: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(replies) < rounds * self.plan.num_fragments:
            for fragment in range(self.plan.num_fragments):
                if sum(f == fragment for f, _ in replies) >= rounds:
                    continue
                version = self.fetch(source, fragment).snapshot.version
                if last.get(fragment) == version:
                    continue
                tensors = make(fragment)
                if tensors is None:
                    continue
                last[fragment] = version
                anchor = max(0, version - stale)
                replies.append((fragment, self.send_delta(to, fragment, anchor, tensors, steps=steps)))
            time.sleep(0.2)  # pacing: wait for the fragments to move on, not synchronization
        return replies

    def send_revert_deltas(
        self, to: str, source: str, *, rounds: int = 4, steps: int = 10**6, timeout: float = 60.0
    ) -> list[tuple[int, Reply]]:
        """The "revert toward the initial weights" attack: per fragment, `rounds` deltas (each on a newer
        version) toward the initial weights at the norm of the latest merged outer gradient, claiming
        `steps` inner steps with matching tokens, sent to the synchronizer `to` (state read from
        `source`). Returns (fragment, reply) per delta sent."""

        def make(fragment: int) -> Mapping | None:
            like = self.latest_outer_gradient(source, fragment)
            return self.revert_delta(source, fragment, scale_like=like)[1]

        return self._paced(to, source, rounds, steps, make, timeout)

    def send_inflated_deltas(
        self,
        to: str,
        source: str,
        *,
        rounds: int = 4,
        steps: int = 10**6,
        stale: int = 0,
        timeout: float = 60.0,
    ) -> list[tuple[int, Reply]]:
        """Claim inflation on deltas that pass every content screen: per fragment, `rounds` times (each on a
        newer version), the latest merged outer gradient itself (aligned with recent updates, at an honest
        norm), claiming `steps` inner steps with matching tokens and an anchor `stale` versions old (a
        schedule that allows H steps per version since the anchor then allows more), sent to the
        synchronizer `to` (state read from `source`). Returns (fragment, reply) per delta sent."""

        def latest(fragment: int) -> Mapping | None:
            return self.latest_outer_gradient(source, fragment)

        return self._paced(to, source, rounds, steps, latest, timeout, stale=stale)

    # ---- poisoned snapshots ------------------------------------------------------------------------

    def serve_poisoned_snapshot(self, fragment: int, version: int, *, seed: int = 0) -> str:
        """From now on answer snapshot requests for `fragment` with random weights at `version`, with a
        correct checksum (so only *who* vouches for it can tell it apart). Returns that checksum."""
        generator = torch.Generator().manual_seed(seed)
        shapes = self.shapes(fragment)
        params = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
        momentum = {n: torch.zeros(s) for n, s in shapes.items()}
        checksum = fragment_checksum(self.plan.names(fragment), params, momentum, version)
        chunk_bytes = self.manifest.limits.snapshot_chunk_bytes
        chunks = []
        for chunk in chunk_layout(shapes, chunk_bytes):
            tensor = (params if chunk.part == THETA else momentum)[chunk.name].reshape(-1)
            chunks.append(tensor[chunk.start : chunk.start + chunk.count].numpy().tobytes())
        index = SnapshotIndex(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=fragment,
            version=version,
            checksum=checksum,
            chunk_bytes=chunk_bytes,
            digests=tuple(chunk_digest(c) for c in chunks),
        )
        self.handlers.snapshots[fragment] = (encode_index(index), chunks)
        return checksum

    @property
    def snapshots_served(self) -> list[tuple[str, int]]:
        return list(self.handlers.served)

    # ---- idle streams -----------------------------------------------------------------------------

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="rogue-p2p", daemon=True)
            self._loop_thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    async def _open_idle(self, to: str, op: str, claimed_bytes: int) -> bool:
        protocol = keys.protocol_id(self.manifest.run_id, self.manifest.manifest_hash, op)
        try:
            _, _, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(to), protocol)
        except Exception:
            return False
        writer.write(streams.MAGIC + _U64.pack(claimed_bytes))  # a header promising a body never sent
        await writer.drain()
        self._held.append(writer)
        return True

    def hold_idle_streams(self, to: str, n: int, claimed_bytes: int, op: str = keys.OP_DELTA) -> int:
        """Open `n` streams to `to`, each sending a request header that claims `claimed_bytes` of body and
        then nothing; they stay open until `release_streams`. Returns how many opened."""
        if self._p2p is None:  # its own client of the DHT's p2pd (hivemind's cached replica is shared)
            self._p2p = self._run(P2P.replicate(self.dht_peer.dht.run_coroutine(_daemon_listen_maddr)))
        opened = 0
        for _ in range(n):
            opened += bool(self._run(self._open_idle(to, op, claimed_bytes)))
        return opened

    def release_streams(self) -> None:
        async def close_all() -> None:
            for writer in self._held:
                with contextlib.suppress(Exception):
                    writer.close()
            self._held.clear()

        if self._loop is not None:
            self._run(close_all())

    # ---- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.release_streams()
        self.transport.close()
        if self._loop is not None:
            loop = self._loop
            if self._p2p is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._p2p.shutdown(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=10)
            self._loop = None
