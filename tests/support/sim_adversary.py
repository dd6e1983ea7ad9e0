"""A generic adversary for the in-process swarm (issue #27): K keys that no manifest lists, each doing
whatever the in-memory DHT and transport accept, with strategies drawn by the test.

Every key writes records under its own subkey (the DHT's owner signature) and speaks over its own
connection (the transport names the sender); it signs update records with its own key only. Within that
it forges freely:

- "tips": heartbeats whose branch tips all keys share (term + 5000, a made-up checksum), versions 10^6,
  `may_sync`, a high `term_seen`: the "two fresh keys poison every replica" attack, K-fold;
- "leases": lease records of terms above the highest seen, expiring far ahead, naming itself successor;
- "snapshots": serves a self-consistent poisoned state (chunk digests and checksum right) for the forged
  tip, so only *who vouches* for it can tell it apart;
- "logs": serves update logs of genuine records it was pushed (replays) and of records it forged;
- "pushes": pushes those genuine records again, and forged ones, to every honest peer;
- "deltas": sends deltas with NaN, or a million times an honest norm, claiming huge token counts;
- "evals": writes dedicated eval histories dated far in the future.

Deterministic for a seed (its own `torch.Generator`); it only reads the honest peers' state through what
they send it, and `watch` (which records whom each honest peer follows) changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import torch

from p2p_diloco.protocol.checksum import fragment_checksum
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.swarm.inprocess import InProcessSwarm
from p2p_diloco.swarm.memory import InMemoryTransport
from p2p_diloco.swarm.snapshots import SnapshotServer
from p2p_diloco.wire.codecs.codec import encode_tensors
from p2p_diloco.wire.frames import decode_update, encode_delta, encode_update, update_signing_bytes
from p2p_diloco.wire.keys import eval_key, heartbeat_key, lease_key
from p2p_diloco.wire.observe import EvalHistory, EvalPoint
from p2p_diloco.wire.records import HeartbeatInfo, encode_lease
from p2p_diloco.wire.relay_frames import Relayed, RelayTag, decode_relay
from p2p_diloco.wire.replies import Reply, ReplyStatus

STRATEGIES = ("tips", "leases", "snapshots", "logs", "pushes", "deltas", "evals")
TERM_JUMP = 5000
KEPT_FRAMES = 32  # genuine update frames an adversary key keeps for replays


def stranger_id(i: int) -> str:
    """A well-formed peer ID that no manifest lists."""
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    digits = "".join(alphabet[(i // len(alphabet) ** k) % len(alphabet)] for k in range(4))
    return "Qm" + "z" * 40 + digits


class _Key:
    """One adversary key: its handlers on the network, what it was pushed, the poisoned state it serves."""

    def __init__(self, adversary: SimAdversary, peer_id: str, strategies: frozenset[str]):
        self.adversary, self.peer_id, self.strategies = adversary, peer_id, strategies
        self.transport = InMemoryTransport(adversary.swarm.network, peer_id)
        self.transport.bind(self)
        self.genuine: deque[bytes] = deque(maxlen=KEPT_FRAMES)
        self.seq = 0

    # ---- what honest peers ask of it ----------------------------------------------------------------

    def handle_delta(self, sender: str, frame: bytes) -> Reply:
        return Reply(ReplyStatus.ACCEPTED, "thanks")  # lies: it merges nothing

    def handle_update(self, sender: str, frame: bytes) -> Reply:
        self.genuine.append(frame)
        return Reply(ReplyStatus.APPLIED, "applied")

    def handle_relay(self, sender: str, frame: bytes) -> Reply:
        """Asks for every offered update and keeps it, as it keeps pushed ones."""
        message = decode_relay(frame)
        if isinstance(message, Relayed):
            self.genuine.append(message.frame)
            return Reply(ReplyStatus.APPLIED, "applied")
        return Reply(ReplyStatus.ACCEPTED, RelayTag.SEND)

    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
        if "logs" not in self.strategies:
            return []
        return [*self.genuine, *(encode_update(self.adversary.forged_update(self, p)) for p in (0, 1))]

    def serve_snapshot(self, requester: str, fragment: int) -> bytes:
        if "snapshots" not in self.strategies:
            return b""
        return self.adversary.poisoned_index(fragment)

    def serve_chunk(self, requester: str, fragment: int, chunk: int, checksum: str) -> bytes:
        return self.adversary.snapshots.chunk(fragment, chunk, checksum, self.adversary.now())


class SimAdversary:
    """K keys acting every `period` fake seconds; `strategies[i]` is the set key i plays."""

    def __init__(
        self, swarm: InProcessSwarm, strategies: list[frozenset[str]], *, seed: int, period: float = 1.0
    ):
        self.swarm, self.period = swarm, period
        self.manifest, self.plan = swarm.manifest, swarm.plan
        self.generator = torch.Generator().manual_seed(seed)
        self.keys = [_Key(self, stranger_id(i), s) for i, s in enumerate(strategies)]
        self.ids = frozenset(k.peer_id for k in self.keys)
        self.followed: set[tuple[str, str]] = set()  # (honest peer, unlisted key it followed)
        m = self.manifest
        self.snapshots = SnapshotServer(
            m.run_id, m.manifest_hash, chunk_bytes=m.limits.snapshot_chunk_bytes, max_pins=64, pin_seconds=1e9
        )
        self._poisoned = {p: self._poison(p) for p in range(self.plan.num_fragments)}

    def now(self) -> float:
        return self.swarm.clock.now()

    def _shapes(self, fragment: int) -> dict[str, tuple[int, ...]]:
        return {name: self.swarm.shapes[name] for name in self.plan.names(fragment)}

    def install(self) -> None:
        self.swarm.loop.call_at(0.5, self._act)

    # ---- forged material ------------------------------------------------------------------------

    def _poison(self, fragment: int) -> tuple[int, str, dict, dict]:
        shapes = self._shapes(fragment)
        params = {n: torch.randn(s, generator=self.generator) for n, s in shapes.items()}
        momentum = {n: torch.zeros(s) for n, s in shapes.items()}
        version = 10**6
        checksum = fragment_checksum(self.plan.names(fragment), params, momentum, version)
        return version, checksum, params, momentum

    def poisoned_index(self, fragment: int) -> bytes:
        if not 0 <= fragment < self.plan.num_fragments:
            return b""
        version, checksum, params, momentum = self._poisoned[fragment]
        return self.snapshots.index(fragment, version, checksum, params, momentum, now=self.now())

    def _term(self) -> int:
        honest = [peer.membership.term_seen for peer in self.swarm.peers.values()]
        return max(honest, default=0)

    def forged_update(self, key: _Key, fragment: int) -> UpdateRecord:
        shapes = self._shapes(fragment)
        grad = {n: torch.full(s, 0.05) for n, s in shapes.items()}
        version = self._poisoned[fragment][0]
        record = UpdateRecord(
            self.manifest.run_id,
            self.manifest.manifest_hash,
            fragment,
            version - 1,
            self._term() + TERM_JUMP,
            key.peer_id,
            ((key.peer_id, 1.0),),
            self._poisoned[fragment][1],
            encode_tensors(grad, codec=self.manifest.wire.codec),
        )
        signature = self.swarm.keys.for_peer(key.peer_id).signer.sign(update_signing_bytes(record))
        return dataclasses.replace(record, signature=signature)

    # ---- every period ---------------------------------------------------------------------------

    def _act(self) -> None:
        self.watch()
        for key in self.keys:
            for strategy in sorted(key.strategies):
                getattr(self, f"_{strategy}")(key)
        self.swarm.loop.call_later(self.period, self._act)

    def watch(self) -> None:
        """Record every honest peer that follows an unlisted key (the property says: none ever does)."""
        for peer in self.swarm.peers.values():
            if peer.membership.holder in self.ids:
                self.followed.add((peer.peer_id, peer.membership.holder))

    def _honest(self) -> list[str]:
        return sorted(peer.peer_id for peer in self.swarm.peers.values())

    def _tips(self, key: _Key) -> None:
        m, term = self.manifest, self._term() + TERM_JUMP
        tips = tuple((term, self._poisoned[p][1][:16]) for p in range(self.plan.num_fragments))
        info = HeartbeatInfo(
            role="synchronizer",
            may_sync=True,
            reachable=True,
            versions=tuple(self._poisoned[p][0] for p in range(self.plan.num_fragments)),
            term_seen=term,
            tips=tips,
        )
        key_name = heartbeat_key(m.run_id, m.manifest_hash)
        self.swarm.kv.store(key_name, key.peer_id, info.to_bytes(), self.now() + m.timing.heartbeat_ttl)

    def _leases(self, key: _Key) -> None:
        m = self.manifest
        lease = LeaseRecord(key.peer_id, self._term() + 1, self.now() + 3600.0, successor=key.peer_id)
        key_name = lease_key(m.run_id, m.manifest_hash)
        self.swarm.kv.store(key_name, key.peer_id, encode_lease(lease), self.now() + 3600.0)

    def _snapshots(self, key: _Key) -> None:
        pass  # served on request (`serve_snapshot`); the forged tips point honest peers at it

    def _logs(self, key: _Key) -> None:
        pass  # served on request (`serve_updates`)

    def _pushes(self, key: _Key) -> None:
        frames = [*key.genuine][-2:] + [encode_update(self.forged_update(key, 0))]
        for frame in frames:
            if frame in key.genuine:  # a replay, and the same record with its term raised (signature breaks)
                record = decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
                frames.append(encode_update(dataclasses.replace(record, term=record.term + TERM_JUMP)))
        for to in self._honest():
            for frame in frames:
                key.transport.push_update(to, frame)

    def _deltas(self, key: _Key) -> None:
        m = self.manifest
        holder = next((p for p in self.swarm.peers.values() if p.sync is not None), None)
        if holder is None:
            return
        fragment = key.seq % self.plan.num_fragments
        version = holder.replica.version(fragment)
        shapes = self._shapes(fragment)
        bad = float("nan") if key.seq % 2 else 1e6
        payload = encode_tensors({n: torch.full(s, bad) for n, s in shapes.items()}, codec=m.wire.codec)
        per_step = m.diloco.batch_size * m.model.block_size
        header = DeltaHeader(
            m.run_id,
            m.manifest_hash,
            fragment,
            version,
            tokens=10**6 * per_step,
            steps=10**6,
            seq=key.seq + 1,
        )
        key.seq += 1
        key.transport.send_delta(holder.peer_id, encode_delta(header, payload))

    def _evals(self, key: _Key) -> None:
        m = self.manifest
        far = self.now() + 10**7
        point = EvalPoint(far, 10**12, (10**6,) * m.diloco.fragments, 0.01, key.peer_id, term=10**6)
        history = EvalHistory((point,), dedicated=True)
        self.swarm.kv.store(eval_key(m.run_id, m.manifest_hash), key.peer_id, history.to_bytes(), far)
