"""Which DHT records a peer reads: those of peers its run allows, at most `max_subkeys` per key.

Anyone who can reach the DHT can store signed records under a run's keys, one subkey per identity, and
identities are cheap. `RecordAdmission` bounds what `DhtKeyValueStore.get` hands up to the swarm:

* a record whose owner may not write that key is ignored: the lease key only from peers that may hold
  the lease (`RunManifest.may_synchronize`), every other key only from peers that may take part
  (`may_learn` or `may_synchronize`);
* of the rest, at most `max_subkeys` per key are kept, by a rule every reader applies alike (so peers
  that read the same records keep the same ones): peers the manifest names (allowlist, synchronizers,
  listed learners, authority) first, then the others in the order of a hash of (key, peer ID), which a
  writer can only improve by generating identities until one ranks high. The excess is counted and never
  reaches the swarm's record decoders.

`stream_admission` applies the same rule to transport requests before their bodies are read: updates
only from peers that may synchronize, every other request only from peers that may take part.

This bounds the work and the state a flood of identities costs a reader; it does not tell honest
strangers from Sybils. Naming the peers in the manifest (`[trust]`, `allowlist`) does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from p2p_diloco.config import LEARNERS_ANY, RunManifest
from p2p_diloco.wire import keys

DEFAULT_MAX_SUBKEYS = 512  # per key: a public run larger than this should name its peers

# reasons `DhtKeyValueStore.get` ignores a record (counted in `dropped` with the decoding ones)
DROP_NOT_ADMITTED = "peer not allowed"
DROP_EXCESS = "excess peers"

T = TypeVar("T")


@dataclass(frozen=True)
class RecordAdmission:
    """`allows(key, peer)`: whether `peer`'s record under `key` is read at all; `listed`: peers kept first
    when a key holds more than `max_subkeys` admitted records (module docstring)."""

    allows: Callable[[str, str], bool]
    listed: frozenset[str] = frozenset()
    max_subkeys: int = DEFAULT_MAX_SUBKEYS

    def __post_init__(self) -> None:
        if self.max_subkeys < 1:
            raise ValueError(f"max_subkeys must be >= 1, got {self.max_subkeys}")
        object.__setattr__(self, "listed", frozenset(self.listed))

    def rank(self, key: str, peer: str) -> tuple[bool, bytes]:
        """Sort key of `peer`'s record under `key`: listed peers first, then by a hash of both."""
        return peer not in self.listed, hashlib.sha256(f"{key}\n{peer}".encode()).digest()

    def bound(self, key: str, records: Mapping[str, T]) -> tuple[dict[str, T], int]:
        """(the at most `max_subkeys` records of `key` kept, by peer; how many were left out)."""
        if len(records) <= self.max_subkeys:
            return dict(records), 0
        kept = sorted(records, key=lambda peer: self.rank(key, peer))[: self.max_subkeys]
        return {peer: records[peer] for peer in kept}, len(records) - len(kept)


def listed_peers(manifest: RunManifest) -> frozenset[str]:
    """Every peer the manifest names: allowlist, synchronizers, listed learners, authority."""
    trust = manifest.trust
    learners = trust.learners if trust.learners != LEARNERS_ANY else ()
    authority = (trust.authority,) if trust.authority else ()
    return frozenset((*manifest.allowlist, *trust.synchronizers, *learners, *authority))


def admission_for(manifest: RunManifest, *, max_subkeys: int = DEFAULT_MAX_SUBKEYS) -> RecordAdmission:
    """The records a peer of `manifest`'s run reads (module docstring)."""
    leases = keys.lease_keys(manifest.run_id, manifest.manifest_hash, manifest.diloco.synchronizer_shards)

    def allows(key: str, peer: str) -> bool:
        if key in leases:
            return manifest.may_synchronize(peer)
        return manifest.may_learn(peer) or manifest.may_synchronize(peer)

    return RecordAdmission(allows, listed_peers(manifest), max_subkeys)


def stream_admission(manifest: RunManifest) -> Callable[[str, str], bool]:
    """`admit(op, peer)` for `P2PTransport`: an update push only from a peer that may hold the lease, a
    relayed update from a peer that may hold it or learn, any other request (deltas, fetches) only
    from a peer that may take part."""

    def admit(op: str, peer: str) -> bool:
        if op == keys.OP_UPDATE:
            return manifest.may_synchronize(peer)
        if op == keys.OP_RELAY:
            return manifest.may_learn(peer) or manifest.may_synchronize(peer)
        return manifest.may_learn(peer)

    return admit
