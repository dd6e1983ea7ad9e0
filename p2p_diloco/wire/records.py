"""Byte encodings of the DHT records the swarm writes: heartbeats and leases.

Strictly schema-checked JSON: a record that does not match is dropped by the reader (with a reason),
never trusted. The subkey a record was read under is the peer ID (owner-signed on the real DHT), so the
peer ID is never taken from the value.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from functools import cached_property

from p2p_diloco.protocol.election import LeaseRecord, PeerHeartbeat
from p2p_diloco.protocol.reconcile import TIP_CHECKSUM_CHARS, BranchTip

MAX_RECORD_BYTES = 12 * 1024  # what the DHT store takes (net/dht_store.py says why it is small)
ROLES = ("learner", "synchronizer", "bootstrap", "observer")
MAX_COUNTERS = 16
MAX_DECISIONS = 8
MAX_SHARDS = 256  # synchronizer shards a heartbeat reports terms of
MAX_TEXT = 240  # characters of one tag, peer ID or decision line


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
    # what `status` shows; the real node fills these, the in-process swarm leaves them empty
    tokens: int = 0
    updates_applied: int = 0
    last_contribution: float = 0.0  # DHT time when an update last merged this peer's delta (0: never)
    rejections: tuple[tuple[str, int], ...] = ()  # (reason tag, count), at most MAX_COUNTERS
    rejections_by_sender: tuple[tuple[str, str, int], ...] = ()  # (sender, tag, count), at most MAX_COUNTERS
    decisions: tuple[str, ...] = ()  # the last few decision lines, at most MAX_DECISIONS
    # per fragment (term, checksum prefix) of the replica's branch tip; with `versions` it gives the
    # `BranchTip` that partition reconciliation compares (`protocol.reconcile`). Empty, or one per fragment.
    tips: tuple[tuple[int, str], ...] = ()
    # synchronizer shards 1..S-1: the highest term seen of each (`term_seen` is shard 0's); left out
    # when S = 1
    shard_terms: tuple[int, ...] = ()

    def term_of(self, shard: int) -> int:
        """The highest term this peer reported seeing for `shard` (0 if it reported none)."""
        if shard == 0:
            return self.term_seen
        return self.shard_terms[shard - 1] if shard <= len(self.shard_terms) else 0

    def tip(self, fragment: int) -> BranchTip | None:
        """The branch tip this peer published for `fragment` (None if it published no tips)."""
        tips = self.branch_tips
        return tips[fragment] if tips else None

    @cached_property
    def branch_tips(self) -> tuple[BranchTip, ...]:
        """Every fragment's `tip`, built once per decoded heartbeat (the per-period rules ask for each
        fragment's tips several times a read: issue #40)."""
        if not self.tips or not self.versions:
            return ()
        return tuple(_tip(term, v, checksum) for (term, checksum), v in zip(self.tips, self.versions))

    def to_bytes(self) -> bytes:
        """JSON within `MAX_RECORD_BYTES`: if the whole would not fit, what only `status` shows goes first
        (decision lines, then per-sender rejections), so a peer never stops announcing itself."""
        d = {
            f.name: _plain(getattr(self, f.name))
            for f in fields(self)
            if f.name != "shard_terms" or self.shard_terms
        }
        raw = json.dumps(d, separators=(",", ":")).encode()
        for optional in ("decisions", "rejections_by_sender", "rejections"):
            if len(raw) <= MAX_RECORD_BYTES:
                break
            d[optional] = []
            raw = json.dumps(d, separators=(",", ":")).encode()
        return raw

    def as_election_record(self, peer_id: str, expires_at: float) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id=peer_id,
            may_sync=self.may_sync,
            reachable=self.reachable,
            versions=self.versions,
            expires_at=expires_at,
            term_seen=self.term_seen,
        )


_TIPS: dict[tuple[int, int, str], BranchTip] = {}  # equal tips shared: most peers report the same states
_MAX_TIPS = 4096


def _tip(term: int, version: int, checksum: str) -> BranchTip:
    """The `BranchTip` of (term, version, checksum), one object per distinct tip while at most `_MAX_TIPS`
    are kept (a read's peers report the same few states of each fragment: building each was a tenth of a
    peer's time at 256 peers, issue #40). Tips are immutable values, so sharing them changes nothing."""
    key = (term, version, checksum)
    tip = _TIPS.get(key)
    if tip is None:
        if len(_TIPS) >= _MAX_TIPS:
            _TIPS.clear()
        tip = _TIPS[key] = BranchTip(term, version, checksum)
    return tip


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _text(value, name: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise RecordError(f"{name} must be a string of at most {MAX_TEXT} characters")
    return value


def _rows(value, name: str, kinds: tuple[str, ...], limit: int) -> tuple:
    """A list of at most `limit` rows, each a list of len(kinds) items: "s" a short string, "i" a count."""
    if not isinstance(value, list) or len(value) > limit:
        raise RecordError(f"{name} must be a list of at most {limit} entries")
    rows = []
    for row in value:
        if not isinstance(row, list) or len(row) != len(kinds):
            raise RecordError(f"{name} entries must be lists of {len(kinds)} items")
        rows.append(
            tuple(
                _text(v, name) if k == "s" else int(_num(v, name, integer=True)) for v, k in zip(row, kinds)
            )
        )
    return tuple(rows)


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


def _counts(values: list, name: str) -> tuple[int, ...]:
    """A list of integers >= 0 (versions, terms) as a tuple; the first bad one named as `_num` names it.
    Heartbeats carry one per fragment and per shard, read every period: checked in bulk first."""
    if not values or (set(map(type, values)) == {int} and min(values) >= 0):
        return tuple(values)
    return tuple(int(_num(v, name, integer=True)) for v in values)


_HEX = re.compile("[0-9a-f]*")


def _plain_tips(rows: list) -> bool:
    """Whether every row is a well-formed [term >= 0, checksum] pair, the checksums checked by one regex over
    their concatenation (each of exactly TIP_CHECKSUM_CHARS characters); `_tips` says what is wrong
    otherwise."""
    if not rows:
        return True
    if set(map(type, rows)) != {list} or set(map(len, rows)) != {2}:
        return False
    terms, checksums = zip(*rows)
    if set(map(type, terms)) != {int} or min(terms) < 0:
        return False
    if set(map(type, checksums)) != {str} or set(map(len, checksums)) != {TIP_CHECKSUM_CHARS}:
        return False
    return _HEX.fullmatch("".join(checksums)) is not None


def _tips(value, fragments: int) -> tuple[tuple[int, str], ...]:
    """Empty, or one [term >= 0, lowercase hex of TIP_CHECKSUM_CHARS] pair per fragment version."""
    if not isinstance(value, list) or len(value) not in (0, fragments):
        raise RecordError(f"tips must be empty or list one (term, checksum) pair per fragment ({fragments})")
    if _plain_tips(value):  # every row well formed: the common case, checked without a call per row
        return tuple(map(tuple, value))
    tips = []
    for row in value:
        if not isinstance(row, list) or len(row) != 2:
            raise RecordError("tips entries must be [term, checksum] pairs")
        term = int(_num(row[0], "tips[].term", integer=True))
        checksum = row[1]
        if (
            not isinstance(checksum, str)
            or len(checksum) != TIP_CHECKSUM_CHARS
            or checksum.strip("0123456789abcdef")
        ):
            raise RecordError(f"tips[].checksum must be {TIP_CHECKSUM_CHARS} lowercase hex characters")
        tips.append((term, checksum))
    return tuple(tips)


_HEARTBEAT_KEYS = frozenset(HeartbeatInfo.__dataclass_fields__)


def decode_heartbeat(raw: bytes, num_fragments: int) -> HeartbeatInfo:
    d = _load(raw)
    shard_terms = d.setdefault("shard_terms", [])  # optional: only sharded runs write it
    if not isinstance(shard_terms, list) or len(shard_terms) > MAX_SHARDS:
        raise RecordError(f"shard_terms must be a list of at most {MAX_SHARDS} terms")
    d["shard_terms"] = _counts(shard_terms, "shard_terms[]")
    if set(d) != _HEARTBEAT_KEYS:
        raise RecordError(f"heartbeat keys {sorted(d)} != {sorted(_HEARTBEAT_KEYS)}")
    if d["role"] not in ROLES:
        raise RecordError(f"unknown role {d['role']!r}")
    for name in ("may_sync", "reachable"):
        if not isinstance(d[name], bool):
            raise RecordError(f"{name} must be a boolean")
    versions = d["versions"]
    if not isinstance(versions, list) or len(versions) not in (0, num_fragments):
        raise RecordError(f"versions must list {num_fragments} fragment versions")
    versions = _counts(versions, "versions[]")
    for name in ("term_seen", "step", "ranks", "tokens", "updates_applied"):
        if type(d[name]) is not int or d[name] < 0:  # `_num` names what is wrong
            _num(d[name], name, integer=True)
    for name in ("tokens_per_s", "step_time", "loss", "last_contribution"):
        if type(d[name]) not in (float, int) or not 0.0 <= d[name] < math.inf:
            _num(d[name], name)
    d["rejections"] = _rows(d["rejections"], "rejections", ("s", "i"), MAX_COUNTERS)
    d["rejections_by_sender"] = _rows(
        d["rejections_by_sender"], "rejections_by_sender", ("s", "s", "i"), MAX_COUNTERS
    )
    decisions = d["decisions"]
    if not isinstance(decisions, list) or len(decisions) > MAX_DECISIONS:
        raise RecordError(f"decisions must be a list of at most {MAX_DECISIONS} strings")
    d["decisions"] = tuple(_text(line, "decisions[]") for line in decisions)
    addresses = d["addresses"]
    if not isinstance(d["digest"], str) or len(d["digest"]) > 128:
        raise RecordError("digest must be a short string")
    if (
        not isinstance(addresses, list)
        or len(addresses) > 16
        or not all(isinstance(a, str) for a in addresses)
    ):
        raise RecordError("addresses must be a list of at most 16 strings")
    d["tips"] = _tips(d["tips"], len(versions))
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
            "successor": lease.successor,
        },
        separators=(",", ":"),
    ).encode()


_LEASE_KEYS = {"term", "expires_at", "rounds_done", "released"}
MAX_PEER_ID_CHARS = 128


def decode_lease(holder: str, raw: bytes) -> LeaseRecord:
    d = _load(raw)
    if set(d) - {"successor"} != _LEASE_KEYS:
        raise RecordError(
            f"lease keys {sorted(d)} are not term, expires_at, rounds_done, released (and successor)"
        )
    if not isinstance(d["released"], bool):
        raise RecordError("released must be a boolean")
    successor = d.get("successor", "")
    if not isinstance(successor, str) or len(successor) > MAX_PEER_ID_CHARS:
        raise RecordError(f"successor must be a peer ID of at most {MAX_PEER_ID_CHARS} characters")
    return LeaseRecord(
        holder=holder,
        term=int(_num(d["term"], "term", integer=True, lo=1)),
        expires_at=float(_num(d["expires_at"], "expires_at")),
        rounds_done=int(_num(d["rounds_done"], "rounds_done", integer=True)),
        released=d["released"],
        successor=successor,
    )
