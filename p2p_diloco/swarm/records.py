"""Byte encodings of the DHT records the swarm writes: heartbeats and leases.

Strictly schema-checked JSON: a record that does not match is dropped by the reader (with a reason),
never trusted. The subkey a record was read under is the peer ID (owner-signed on the real DHT), so the
peer ID is never taken from the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from p2p_diloco.protocol.election import LeaseRecord, PeerHeartbeat

MAX_RECORD_BYTES = 16 * 1024
ROLES = ("learner", "synchronizer", "bootstrap", "observer")


class RecordError(ValueError):
    """A DHT record failed its schema check."""


@dataclass(frozen=True)
class HeartbeatInfo:
    """What a peer announces about itself every heartbeat period."""

    role: str
    may_sync: bool
    reachable: bool
    versions: tuple[int, ...]
    term_seen: int = 0
    step: int = 0
    tokens_per_s: float = 0.0
    step_time: float = 0.0
    loss: float = 0.0
    digest: str = ""
    ranks: int = 1
    addresses: tuple[str, ...] = field(default=())

    def to_bytes(self) -> bytes:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}
        return json.dumps(d, separators=(",", ":")).encode()

    def as_election_record(self, peer_id: str, expires_at: float) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id=peer_id,
            may_sync=self.may_sync,
            reachable=self.reachable,
            versions=self.versions,
            expires_at=expires_at,
            term_seen=self.term_seen,
        )


def _load(raw: bytes) -> dict:
    if not isinstance(raw, bytes | bytearray) or len(raw) > MAX_RECORD_BYTES:
        raise RecordError("record is not bytes or too large")
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RecordError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise RecordError("not a JSON object")
    return value


def _num(value, name: str, *, integer: bool = False, lo: float = 0.0) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool) or not math.isfinite(value) or value < lo:
        raise RecordError(f"{name} must be a finite {'integer' if integer else 'number'} >= {lo}")
    return value


def decode_heartbeat(raw: bytes, num_fragments: int) -> HeartbeatInfo:
    d = _load(raw)
    expected = set(HeartbeatInfo.__dataclass_fields__)
    if set(d) != expected:
        raise RecordError(f"heartbeat keys {sorted(d)} != {sorted(expected)}")
    if d["role"] not in ROLES:
        raise RecordError(f"unknown role {d['role']!r}")
    for name in ("may_sync", "reachable"):
        if not isinstance(d[name], bool):
            raise RecordError(f"{name} must be a boolean")
    versions = d["versions"]
    if not isinstance(versions, list) or len(versions) not in (0, num_fragments):
        raise RecordError(f"versions must list {num_fragments} fragment versions")
    for v in versions:
        _num(v, "versions[]", integer=True)
    for name in ("term_seen", "step", "ranks"):
        _num(d[name], name, integer=True)
    for name in ("tokens_per_s", "step_time", "loss"):
        _num(d[name], name)
    addresses = d["addresses"]
    if not isinstance(d["digest"], str) or len(d["digest"]) > 128:
        raise RecordError("digest must be a short string")
    if (
        not isinstance(addresses, list)
        or len(addresses) > 16
        or not all(isinstance(a, str) for a in addresses)
    ):
        raise RecordError("addresses must be a list of at most 16 strings")
    d["versions"] = tuple(versions)
    d["addresses"] = tuple(addresses)
    return HeartbeatInfo(**d)


def encode_lease(lease: LeaseRecord) -> bytes:
    return json.dumps(
        {
            "term": lease.term,
            "expires_at": lease.expires_at,
            "rounds_done": lease.rounds_done,
            "released": lease.released,
        },
        separators=(",", ":"),
    ).encode()


def decode_lease(holder: str, raw: bytes) -> LeaseRecord:
    d = _load(raw)
    if set(d) != {"term", "expires_at", "rounds_done", "released"}:
        raise RecordError(f"lease keys {sorted(d)} are not term, expires_at, rounds_done, released")
    if not isinstance(d["released"], bool):
        raise RecordError("released must be a boolean")
    return LeaseRecord(
        holder=holder,
        term=int(_num(d["term"], "term", integer=True, lo=1)),
        expires_at=float(_num(d["expires_at"], "expires_at")),
        rounds_done=int(_num(d["rounds_done"], "rounds_done", integer=True)),
        released=d["released"],
    )
