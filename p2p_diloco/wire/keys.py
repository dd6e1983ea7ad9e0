"""Every name this project puts on the network: DHT keys and libp2p protocol IDs.

Each name carries the run ID and the manifest hash, so peers of another run, or of the same run with a
different manifest, never read each other's records or reach each other's handlers.

DHT keys have the form ``p2p_diloco/<run_id>/<manifest_hash>_<record>``: `namespace()` is the prefix
and `<record>` one of `RECORD_NAMES` (the shape hivemind's `SchemaValidator(prefix=...)` expects, should
DHT-level schema checks ever be wanted; see `dht_store` for why they are not used now).
"""

from __future__ import annotations

import re

from p2p_diloco.errors import ConfigError

KEY_PREFIX = "p2p_diloco"
PROTOCOL_PREFIX = "/p2p-diloco"
PROTOCOL_VERSION = "1"

HEARTBEAT = "heartbeat"
LEASE = "lease"
UPDATE_LOG = "updates"
SNAPSHOTS = "snapshots"
EVALS = "evals"
STATS = "stats"
UNDERWAY = "underway"  # proofs that a run is under way (`wire.underway`)
RECORD_NAMES = (HEARTBEAT, LEASE, UPDATE_LOG, SNAPSHOTS, EVALS, STATS, UNDERWAY)

# transport operations (one libp2p protocol each)
OP_DELTA = "delta"
OP_UPDATE = "update"
OP_FETCH_UPDATES = "fetch-updates"
OP_FETCH_SNAPSHOT = "fetch-snapshot"  # a fragment snapshot's index (wire.snapshot_chunks)
OP_FETCH_CHUNK = "fetch-chunk"  # one chunk of a snapshot
OP_RELAY = "relay"  # an update offered or relayed peer to peer (wire.relay_frames)
TRANSPORT_OPS = (OP_DELTA, OP_UPDATE, OP_FETCH_UPDATES, OP_FETCH_SNAPSHOT, OP_FETCH_CHUNK, OP_RELAY)

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_MANIFEST_HASH_RE = re.compile(r"^[0-9a-f]{16}$")


def _check(run_id: str, manifest_hash: str) -> None:
    if not _RUN_ID_RE.match(run_id):
        raise ConfigError(f"run_id must be 1-64 of letters, digits, '-', '_' or '.', got {run_id!r}")
    if not _MANIFEST_HASH_RE.match(manifest_hash):
        raise ConfigError(
            "manifest hash must be 16 lowercase hex digits (RunManifest.manifest_hash), "
            f"got {manifest_hash!r}"
        )


def namespace(run_id: str, manifest_hash: str) -> str:
    """The prefix shared by all DHT keys of one run and manifest."""
    _check(run_id, manifest_hash)
    return f"{KEY_PREFIX}/{run_id}/{manifest_hash}"


def record_key(run_id: str, manifest_hash: str, record: str) -> str:
    if record not in RECORD_NAMES:
        raise ValueError(f"unknown record {record!r}; expected one of {RECORD_NAMES}")
    return f"{namespace(run_id, manifest_hash)}_{record}"


def heartbeat_key(run_id: str, manifest_hash: str, bucket: int = 0) -> str:
    """Live peers: subkey = peer ID (owner-signed), value = the peer's heartbeat record. With heartbeat
    buckets (`protocol.heartbeat_buckets`, runs of 16 shards or more) bucket 0, the candidates', keeps the
    unbucketed key and bucket k > 0 appends ``/k``."""
    if bucket < 0:
        raise ValueError(f"bucket must be >= 0, got {bucket}")
    key = record_key(run_id, manifest_hash, HEARTBEAT)
    return key if bucket == 0 else f"{key}/{bucket}"


def lease_key(run_id: str, manifest_hash: str, shard: int = 0) -> str:
    """Synchronizer lease of one shard (`protocol.shards`): subkey = holder's peer ID (owner-signed), value =
    its term. Shard 0 keeps the unsharded key; shard k > 0 appends ``/k`` (the manifest hash already
    differs between runs with different shard counts)."""
    if shard < 0:
        raise ValueError(f"shard must be >= 0, got {shard}")
    key = record_key(run_id, manifest_hash, LEASE)
    return key if shard == 0 else f"{key}/{shard}"


def lease_keys(run_id: str, manifest_hash: str, shards: int) -> tuple[str, ...]:
    """The lease key of every shard, shard 0 first."""
    return tuple(lease_key(run_id, manifest_hash, shard) for shard in range(shards))


def update_log_key(run_id: str, manifest_hash: str) -> str:
    """Update-log adverts: subkey = peer ID, value = which update versions that peer can serve."""
    return record_key(run_id, manifest_hash, UPDATE_LOG)


def snapshot_key(run_id: str, manifest_hash: str) -> str:
    """Snapshot adverts: subkey = peer ID, value = which fragment versions that peer can serve whole."""
    return record_key(run_id, manifest_hash, SNAPSHOTS)


def eval_key(run_id: str, manifest_hash: str) -> str:
    """Global evaluation history: subkey = evaluator's peer ID (owner-signed), value = its bounded history
    of eval points (`wire.observe.EvalHistory`); kept after the evaluator leaves, until it expires."""
    return record_key(run_id, manifest_hash, EVALS)


def stats_key(run_id: str, manifest_hash: str) -> str:
    """Peer facts for the dashboard: subkey = peer ID (owner-signed), value = `wire.observe.PeerStats`."""
    return record_key(run_id, manifest_hash, STATS)


def protocol_id(run_id: str, manifest_hash: str, op: str) -> str:
    """libp2p protocol ID of one transport operation, e.g. ``/p2p-diloco/demo/0123456789abcdef/delta/1``."""
    if op not in TRANSPORT_OPS:
        raise ValueError(f"unknown transport op {op!r}; expected one of {TRANSPORT_OPS}")
    _check(run_id, manifest_hash)
    return f"{PROTOCOL_PREFIX}/{run_id}/{manifest_hash}/{op}/{PROTOCOL_VERSION}"
