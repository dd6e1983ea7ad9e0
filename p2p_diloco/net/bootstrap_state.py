"""What a bootstrap node remembers across restarts (``bootstrap --manifest RUN.toml --state-dir DIR``).

A restarted bootstrap node starts with an empty routing table and an empty record store: a newcomer that
joins through it would find nobody and start the run again on an island of its own (issue #31). With a
manifest and a state directory the node watches the run it serves, every `WATCH_PERIOD` seconds:

* it reads the run's heartbeats and keeps the announced addresses of the peers it saw (at most
  `MAX_PEERS`, newest first) in ``bootstrap_state.json``; a restart dials them besides ``--initial-peers``,
  so the front door leads back into the swarm (addresses are only where to look: the ones that accept a
  TCP connection at the restart are dialed, a hostile one costs a dial);
* it reads the run's ``underway`` key and keeps the best proof that the run is under way (`wire.underway`:
  an update header signed by a peer that may synchronize, checked here and again by every reader), and
  writes it under its own subkey, so a newcomer that reaches only this node after a restart still learns
  that the run started, and waits for the swarm instead of training from version 0.

The state file is written atomically and read leniently: a corrupt or foreign one is ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.files import write_atomic
from p2p_diloco.net.addresses import parse_peer_address, peer_id_in, tcp_endpoints
from p2p_diloco.net.dht_store import DhtKeyValueStore
from p2p_diloco.net.liveness import probe_endpoints
from p2p_diloco.net.record_signing import RsaSignatureCheck
from p2p_diloco.wire.interfaces import Liveness
from p2p_diloco.wire.keys import UNDERWAY, heartbeat_key, record_key
from p2p_diloco.wire.records import RecordError, decode_heartbeat
from p2p_diloco.wire.underway import Underway, check_proof

log = logging.getLogger(__name__)

STATE_FILE = "bootstrap_state.json"
MAX_PEERS = 64
WATCH_PERIOD = 2.0
PROOF_TTL = 60.0  # how long the proof this node writes lives in the DHT (written again every period)


class BootstrapMemory:
    def __init__(self, state_dir: str | Path, manifest: RunManifest, own_peer_id: str):
        self.path = Path(state_dir) / STATE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.manifest = manifest
        self.own_peer_id = own_peer_id
        self.peers: list[str] = []  # addresses, newest first
        self.proof: bytes | None = None
        self.underway: Underway | None = None
        self._load()

    def _check(self, value: bytes) -> Underway | str:
        m = self.manifest
        return check_proof(
            value,
            run_id=m.run_id,
            manifest_hash=m.manifest_hash,
            check=RsaSignatureCheck(),
            may_synchronize=m.may_synchronize,
        )

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
            if (raw.get("run_id"), raw.get("manifest_hash")) != (
                self.manifest.run_id,
                self.manifest.manifest_hash,
            ):
                return
            self.peers = [str(a) for a in raw.get("peers", ())][:MAX_PEERS]
            proof = bytes.fromhex(raw["proof"]) if raw.get("proof") else None
        except (OSError, ValueError, TypeError, AttributeError, KeyError):
            return
        if proof is not None and not isinstance(found := self._check(proof), str):
            self.proof, self.underway = proof, found

    def save(self) -> None:
        body = {
            "run_id": self.manifest.run_id,
            "manifest_hash": self.manifest.manifest_hash,
            "peers": self.peers,
            "proof": self.proof.hex() if self.proof else "",
        }
        write_atomic(self.path, json.dumps(body, indent=1).encode())

    def dial_list(self) -> list[str]:
        """Saved addresses of other peers that accept TCP connections now, for the DHT's initial peers
        (p2pd refuses to start when none of its initial peers answers; a saved peer may be gone)."""
        saved = [a for a in self.peers if not a.endswith(f"/p2p/{self.own_peer_id}")]
        if not saved:
            return []

        async def probe_all() -> list[Liveness]:
            return list(await asyncio.gather(*(probe_endpoints(tcp_endpoints([a])) for a in saved)))

        return [
            a for a, found in zip(saved, asyncio.run(probe_all()), strict=True) if found == Liveness.ALIVE
        ]

    def watch(self, kv: DhtKeyValueStore, now: float) -> None:
        """One look at the run: remember peers and the best proof; write the proof again; save if changed."""
        m = self.manifest
        before = (list(self.peers), self.proof)
        try:
            heartbeats = kv.get(heartbeat_key(m.run_id, m.manifest_hash), now)
            proofs = kv.get(record_key(m.run_id, m.manifest_hash, UNDERWAY), now)
        except TimeoutError as exc:
            log.warning("bootstrap watch: %s", exc)
            return
        seen: list[str] = []
        for peer, stored in heartbeats.items():
            if peer == self.own_peer_id or not m.may_learn(peer):
                continue
            try:
                info = decode_heartbeat(stored.value, m.diloco.fragments)
            except RecordError:
                continue
            seen += [a for a in info.addresses[:2] if _address_of(a, peer) and a not in seen]
        if seen:
            self.peers = (seen + [a for a in self.peers if a not in seen])[:MAX_PEERS]
        for stored in proofs.values():
            found = self._check(stored.value)
            if not isinstance(found, str) and (self.underway is None or found > self.underway):
                self.proof, self.underway = stored.value, found
        if self.proof is not None:
            kv.store(
                record_key(m.run_id, m.manifest_hash, UNDERWAY), self.own_peer_id, self.proof, now + PROOF_TTL
            )
        if (self.peers, self.proof) != before:
            self.save()


def _address_of(address: str, peer: str) -> bool:
    """Whether `address` parses as a peer address of `peer` (a heartbeat may list anything)."""
    try:
        return peer_id_in(parse_peer_address(address, what="heartbeat address")) == peer
    except ConfigError:
        return False


def dht_now() -> float:
    """The DHT's clock (hivemind's `get_dht_time` is wall time)."""
    return time.time()
