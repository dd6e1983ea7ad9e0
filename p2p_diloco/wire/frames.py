"""Message frames: delta, update, snapshot and request records as bytes, with a strict decoder.

Every frame, integers little-endian::

    magic (4 bytes, one per record kind) | version u8 | header length u32 | payload length u64 |
    header (UTF-8 JSON object) | payload (opaque bytes: `wire.codecs.codec` frames)

The JSON header is schema-checked on both sides: exact key set, exact types (bool is not an int),
integer ranges, string lengths and characters, no NaN/inf, no duplicate keys. Decoders raise only
`DecodeError` with the reason tags of `wire.codecs.codec`. Distinct magics mean a frame of one kind fed to
another kind's decoder fails with "bad magic". A delta's `sender` never comes from the wire: the
receiver fills it in from the authenticated connection.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, replace
from typing import Any

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.wire.bounds import (
    MAX_CONTRIBUTORS,
    MAX_COUNTER,
    MAX_FRAGMENT,
    MAX_ID_CHARS,
    MAX_SIGNATURE_BYTES,
    Check,
    contributor_list,
    hex_string,
    identifier,
    integer,
    one_of,
    seq_list,
)
from p2p_diloco.wire.codecs.codec import (
    BAD_HEADER,
    OVERSIZED,
    TRAILING_BYTES,
    UNSUPPORTED_VERSION,
    ByteReader,
    byte_view,
)
from p2p_diloco.wire.delta_listing import left_out_problem, listing_fields, listing_problem, parse_listing

DELTA_MAGIC = b"PDde"
UPDATE_MAGIC = b"PDup"
SNAPSHOT_MAGIC = b"PDsn"
REQUEST_MAGIC = b"PDrq"
SNAPSHOT_INDEX_MAGIC = b"PDsi"  # wire.snapshot_chunks
FRAME_VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_REQUEST_BYTES = 4096
REQUEST_UPDATES = "updates"
REQUEST_SNAPSHOT = "snapshot"

_PREFIX = struct.Struct("<BIQ")
_KIND_BY_MAGIC = {
    DELTA_MAGIC: "delta",
    UPDATE_MAGIC: "update",
    SNAPSHOT_MAGIC: "snapshot",
    REQUEST_MAGIC: "request",
    SNAPSHOT_INDEX_MAGIC: "snapshot index",
}


@dataclass(frozen=True)
class FragmentSnapshot:
    """Global state of one fragment at `version`: `params` and `momentum` are fp32 `wire.codecs.codec` frames;
    `checksum` is the published checksum of the parameters at that version."""

    run_id: str
    manifest_hash: str
    fragment: int
    version: int
    checksum: str
    params: bytes
    momentum: bytes


@dataclass(frozen=True)
class FragmentRequest:
    """ "updates": the update records of `fragment` after `after_version`; "snapshot": its snapshot."""

    kind: str
    run_id: str
    manifest_hash: str
    fragment: int
    after_version: int = 0


# --- schema (field checks: `wire.bounds`) ---------------------------------------------------------
_COUNTER = integer(0, MAX_COUNTER)
_FRAGMENT = integer(0, MAX_FRAGMENT)
_IDS: dict[str, Check] = {"run_id": identifier, "manifest_hash": identifier, "fragment": _FRAGMENT}
DELTA_SCHEMA: dict[str, Check] = {
    **_IDS,
    "anchor_version": _COUNTER,
    "tokens": _COUNTER,
    "steps": integer(1, MAX_COUNTER),
    "seq": _COUNTER,
    "since_seq": _COUNTER,
}
UPDATE_SCHEMA: dict[str, Check] = {
    **_IDS,
    "from_version": integer(0, MAX_COUNTER - 1),
    "term": _COUNTER,
    "leader": identifier,
    "contributors": contributor_list,
    "seqs": seq_list,
    "checksum": identifier,
    "signature": hex_string(MAX_SIGNATURE_BYTES),
}
# sparse codecs: a delta carries its learner's signature, and an update lists the deltas it merged
SIGNED_DELTA_SCHEMA: dict[str, Check] = {**DELTA_SCHEMA, "signature": hex_string(MAX_SIGNATURE_BYTES)}
UNION_UPDATE_SCHEMA: dict[str, Check] = {
    **UPDATE_SCHEMA,
    "deltas": listing_problem,
    "live": integer(1, MAX_CONTRIBUTORS),
}
# a sparse round that listed `[diloco] gather` of its deltas names the ones it left out
GATHERED_UPDATE_SCHEMA: dict[str, Check] = {**UNION_UPDATE_SCHEMA, "left_out": left_out_problem}
SNAPSHOT_SCHEMA: dict[str, Check] = {
    **_IDS,
    "version": _COUNTER,
    "checksum": identifier,
    "params_len": _COUNTER,
}
REQUEST_SCHEMA: dict[str, Check] = {
    **_IDS,
    "kind": one_of(REQUEST_UPDATES, REQUEST_SNAPSHOT),
    "after_version": _COUNTER,
}


def _schema_problem(header: Any, schema: dict[str, Check]) -> str | None:
    if not isinstance(header, dict):
        return "header is not a JSON object"
    if set(header) != set(schema):
        missing, extra = sorted(set(schema) - set(header)), sorted(set(header) - set(schema))
        return f"header keys differ: missing {missing[:5]}, unexpected {[k[:40] for k in extra[:5]]}"
    for key, check in schema.items():
        problem = check(header[key])
        if problem is not None:
            return f"{key} {problem}"
    return None


# --- framing -----------------------------------------------------------------------------------------
def _encode(magic: bytes, header: dict[str, Any], schema: dict[str, Check], payload: bytes = b"") -> bytes:
    problem = _schema_problem(header, schema)
    if problem is not None:
        raise ValueError(f"cannot encode {_KIND_BY_MAGIC[magic]} frame: {problem}")
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"{_KIND_BY_MAGIC[magic]} header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    return b"".join((magic, _PREFIX.pack(FRAME_VERSION, len(raw), len(payload)), raw, payload))


def _reject_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def _decode(
    frame: bytes,
    magic: bytes,
    schema: dict[str, Check],
    max_bytes: int,
    extended: dict[str, Check] | tuple[dict[str, Check], ...] | None = None,
) -> tuple[dict[str, Any], bytes]:
    """`extended`: other schemas (more keys) the header may follow instead, chosen by its key set."""
    header, view, payload_at, payload_len = _decode_parts(frame, magic, schema, max_bytes, extended)
    return header, bytes(view[payload_at : payload_at + payload_len])


def _decode_parts(
    frame: bytes,
    magic: bytes,
    schema: dict[str, Check],
    max_bytes: int,
    extended: dict[str, Check] | tuple[dict[str, Check], ...] | None = None,
) -> tuple[dict[str, Any], memoryview, int, int]:
    """The checked header, the frame's view, and where its payload starts and how long it is (uncopied)."""
    kind = _KIND_BY_MAGIC[magic]
    view = byte_view(frame)
    if len(view) > max_bytes:
        raise DecodeError(OVERSIZED, f"{kind} frame of {len(view)} bytes exceeds the limit of {max_bytes}")
    reader = ByteReader(view, max_bytes)
    reader.expect_magic(magic, kind)
    version, header_len, payload_len = reader.unpack(_PREFIX, f"{kind} frame prefix")
    if version != FRAME_VERSION:
        raise DecodeError(
            UNSUPPORTED_VERSION, f"{kind} frame version {version}, this peer reads {FRAME_VERSION}"
        )
    if header_len > MAX_HEADER_BYTES:
        raise DecodeError(OVERSIZED, f"{kind} header claims {header_len} bytes, limit {MAX_HEADER_BYTES}")
    raw_header = reader.take(header_len, f"{kind} header")
    payload_at = reader.claim(payload_len, f"{kind} payload")
    if reader.pos != len(view):
        raise DecodeError(TRAILING_BYTES, f"{len(view) - reader.pos} bytes after the {kind} payload")
    try:
        header = json.loads(
            raw_header.decode("utf-8"),
            object_pairs_hook=_reject_pairs,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except (ValueError, RecursionError) as exc:
        raise DecodeError(BAD_HEADER, f"{kind} header is not valid JSON: {str(exc)[:120]}") from exc
    alternatives = (extended,) if isinstance(extended, dict) else extended or ()
    for alternative in alternatives:
        if isinstance(header, dict) and set(header) == set(alternative):
            schema = alternative
    problem = _schema_problem(header, schema)
    if problem is not None:
        raise DecodeError(BAD_HEADER, f"{kind} header: {problem}")
    return header, view, payload_at, payload_len


# --- records -----------------------------------------------------------------------------------------
def encode_delta(header: DeltaHeader, payload: bytes) -> bytes:
    """`payload` is the sender's `wire.codecs.codec` frame; `header.sender` is not sent, `header.signature`
    only when there is one (sparse codecs)."""
    schema = SIGNED_DELTA_SCHEMA if header.signature else DELTA_SCHEMA
    fields = {key: getattr(header, key) for key in schema}
    if header.signature:
        fields["signature"] = header.signature.hex()
    return _encode(DELTA_MAGIC, fields, schema, payload)


def decode_delta(frame: bytes, *, max_bytes: int) -> tuple[DeltaHeader, bytes]:
    """(header with sender "", codec payload). The caller sets the sender from the connection."""
    header, payload = _decode(frame, DELTA_MAGIC, DELTA_SCHEMA, max_bytes, SIGNED_DELTA_SCHEMA)
    signature = bytes.fromhex(header.pop("signature", ""))
    return DeltaHeader(**header, sender="", signature=signature), payload


@dataclass(frozen=True)
class InboundDelta:
    """A delta frame as it entered a peer, decoded once (`decode`): its header and codec payload, or the
    `DecodeError` that says why it does not decode. Every check after that reads these fields; none
    decodes the frame again (the tensors in `payload` are decoded once, by the synchronizer that screens
    them)."""

    frame: bytes
    header: DeltaHeader | None
    payload: bytes = b""
    error: DecodeError | None = None

    @classmethod
    def decode(cls, frame: bytes, *, max_bytes: int) -> InboundDelta:
        try:
            header, payload = decode_delta(frame, max_bytes=max_bytes)
        except DecodeError as exc:
            return cls(frame, None, error=exc)
        return cls(frame, header, payload)

    @property
    def fragment(self) -> int | None:
        """The fragment the header names (None if it does not decode or names none)."""
        fragment = self.header.fragment if self.header is not None else None
        return fragment if isinstance(fragment, int) and fragment >= 0 else None


def _update_schema(record: UpdateRecord) -> dict[str, Check]:
    if record.left_out:
        return GATHERED_UPDATE_SCHEMA
    return UNION_UPDATE_SCHEMA if record.deltas else UPDATE_SCHEMA


def _update_fields(record: UpdateRecord) -> dict[str, Any]:
    fields = {key: getattr(record, key) for key in _update_schema(record)}
    fields["contributors"] = [[peer, float(weight)] for peer, weight in record.contributors]
    fields["seqs"] = list(record.seqs)
    fields["signature"] = record.signature.hex()
    if record.deltas:
        fields["deltas"] = listing_fields(record.deltas)
    if record.left_out:
        fields["left_out"] = [[learner, seq] for learner, seq in record.left_out]
    return fields


def encode_update(record: UpdateRecord) -> bytes:
    return _encode(UPDATE_MAGIC, _update_fields(record), _update_schema(record), record.payload)


def decode_update(frame: bytes, *, max_bytes: int) -> UpdateRecord:
    header, payload = _decode(
        frame, UPDATE_MAGIC, UPDATE_SCHEMA, max_bytes, (UNION_UPDATE_SCHEMA, GATHERED_UPDATE_SCHEMA)
    )
    if "deltas" in header:
        header["deltas"] = parse_listing(header["deltas"])
    if "left_out" in header:
        header["left_out"] = tuple(map(tuple, header["left_out"]))  # pairs: the schema checked them
    contributors = tuple(map(tuple, header.pop("contributors")))
    seqs = tuple(header.pop("seqs"))
    if seqs and len(seqs) != len(contributors):
        raise DecodeError(BAD_HEADER, f"update names {len(contributors)} contributors but {len(seqs)} seqs")
    signature = bytes.fromhex(header.pop("signature"))
    return UpdateRecord(**header, contributors=contributors, payload=payload, signature=signature, seqs=seqs)


def update_signing_bytes(record: UpdateRecord) -> bytes:
    """What the leader signs: every header field but the signature, and a digest of the payload."""
    fields = _update_fields(record)
    fields.pop("signature")
    header = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return b"".join((UPDATE_MAGIC, b"sig1", header, hashlib.blake2b(record.payload, digest_size=32).digest()))


def encode_snapshot(snapshot: FragmentSnapshot) -> bytes:
    fields = {key: getattr(snapshot, key) for key in SNAPSHOT_SCHEMA if key != "params_len"}
    fields["params_len"] = len(snapshot.params)
    return _encode(SNAPSHOT_MAGIC, fields, SNAPSHOT_SCHEMA, snapshot.params + snapshot.momentum)


def decode_snapshot(frame: bytes, *, max_bytes: int) -> FragmentSnapshot:
    header, payload = _decode(frame, SNAPSHOT_MAGIC, SNAPSHOT_SCHEMA, max_bytes)
    params_len = header.pop("params_len")
    if params_len > len(payload):
        raise DecodeError(
            BAD_HEADER, f"snapshot params_len {params_len} exceeds its payload of {len(payload)}"
        )
    return FragmentSnapshot(**header, params=payload[:params_len], momentum=payload[params_len:])


def encode_request(
    kind: str, run_id: str, manifest_hash: str, fragment: int, after_version: int = 0
) -> bytes:
    """`kind` is REQUEST_UPDATES (records after `after_version`) or REQUEST_SNAPSHOT (after_version 0)."""
    if kind == REQUEST_SNAPSHOT and after_version != 0:
        raise ValueError("a snapshot request takes no after_version")
    fields = {
        "kind": kind,
        "run_id": run_id,
        "manifest_hash": manifest_hash,
        "fragment": fragment,
        "after_version": after_version,
    }
    return _encode(REQUEST_MAGIC, fields, REQUEST_SCHEMA)


def decode_request(frame: bytes, *, max_bytes: int = MAX_REQUEST_BYTES) -> FragmentRequest:
    header, payload = _decode(frame, REQUEST_MAGIC, REQUEST_SCHEMA, max_bytes)
    if payload:
        raise DecodeError(BAD_HEADER, f"request carries a payload of {len(payload)} bytes")
    request = FragmentRequest(**header)
    if request.kind == REQUEST_SNAPSHOT and request.after_version != 0:
        raise DecodeError(BAD_HEADER, f"snapshot request with after_version {request.after_version}")
    return request


# --- size bounds (what a receiver may cap a frame at before reading it) ---------------------------------
def _envelope_bytes(header_bytes: int, payload_bytes: int) -> int:
    return 4 + _PREFIX.size + header_bytes + payload_bytes


def _header_bytes(magic: bytes, header: dict[str, Any], schema: dict[str, Check]) -> int:
    return len(_encode(magic, header, schema)) - _envelope_bytes(0, 0)


def delta_frame_bound(run_id: str, manifest_hash: str, payload_bytes: int, *, signed: bool = False) -> int:
    """The largest `encode_delta` frame of this run with a payload of `payload_bytes`: every counter at
    its maximum, so no valid delta header is longer (`wire.codecs.codec.frame_size` gives the payload's size);
    `signed`: with the longest signature (sparse codecs)."""
    schema = SIGNED_DELTA_SCHEMA if signed else DELTA_SCHEMA
    fields: dict[str, Any] = {key: MAX_COUNTER for key in schema}
    fields.update(run_id=run_id, manifest_hash=manifest_hash, fragment=MAX_FRAGMENT)
    if signed:
        fields["signature"] = "ff" * MAX_SIGNATURE_BYTES
    return _envelope_bytes(_header_bytes(DELTA_MAGIC, fields, schema), payload_bytes)


def update_frame_bound(payload_bytes: int) -> int:
    """The largest `encode_update` frame with a payload of `payload_bytes`. Its header lists the
    contributors, so it is bounded by `MAX_HEADER_BYTES` rather than by the run."""
    return _envelope_bytes(MAX_HEADER_BYTES, payload_bytes)


def snapshot_frame_bound(run_id: str, manifest_hash: str, payload_bytes: int) -> int:
    """The largest `encode_snapshot` frame of this run whose params and momentum frames together take
    `payload_bytes` (a checksum of `MAX_ID_CHARS` characters, every counter at its maximum)."""
    fields: dict[str, Any] = {key: MAX_COUNTER for key in SNAPSHOT_SCHEMA}
    fields.update(run_id=run_id, manifest_hash=manifest_hash, fragment=MAX_FRAGMENT)
    fields.update(checksum="f" * MAX_ID_CHARS, params_len=payload_bytes)  # params_len <= the payload
    return _envelope_bytes(_header_bytes(SNAPSHOT_MAGIC, fields, SNAPSHOT_SCHEMA), payload_bytes)


def with_sender(header: DeltaHeader, sender: str) -> DeltaHeader:
    """The decoded header with the sender taken from the authenticated connection."""
    return replace(header, sender=sender)
