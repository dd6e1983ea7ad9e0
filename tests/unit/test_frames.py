"""Message frames: round trips, strict header schema, distinct magics, and DecodeError-only decoding."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.wire import frames
from p2p_diloco.wire.codecs import codec
from p2p_diloco.wire.codecs.codec import encode_tensors
from p2p_diloco.wire.frames import (
    REQUEST_SNAPSHOT,
    REQUEST_UPDATES,
    FragmentRequest,
    FragmentSnapshot,
    decode_delta,
    decode_request,
    decode_snapshot,
    decode_update,
    encode_delta,
    encode_request,
    encode_snapshot,
    encode_update,
    with_sender,
)

LIMIT = 1 << 20
FAST = settings(max_examples=60, deadline=None)
ids = st.text(alphabet="abcXYZ019-_.:", min_size=1, max_size=frames.MAX_ID_CHARS)
counters = st.integers(0, frames.MAX_COUNTER)
fragments = st.integers(0, frames.MAX_FRAGMENT)

DELTA = DeltaHeader("run-1", "0123456789abcdef", 2, 5, 4096, 12, 7)
UPDATE = UpdateRecord(
    "run-1", "0123456789abcdef", 2, 5, 3, "QmLeader", (("QmA", 1.5), ("QmB", 0.25)), "ab12", b"xy"
)
SNAPSHOT = FragmentSnapshot("run-1", "0123456789abcdef", 2, 6, "ab12", b"params", b"momentum!")
DECODERS = {
    "delta": lambda f, m=LIMIT: decode_delta(f, max_bytes=m),
    "update": lambda f, m=LIMIT: decode_update(f, max_bytes=m),
    "snapshot": lambda f, m=LIMIT: decode_snapshot(f, max_bytes=m),
    "request": lambda f, m=LIMIT: decode_request(f, max_bytes=m),
}
FRAMES = {
    "delta": encode_delta(DELTA, b"payload"),
    "update": encode_update(UPDATE),
    "snapshot": encode_snapshot(SNAPSHOT),
    "request": encode_request(REQUEST_UPDATES, "run-1", "0123456789abcdef", 2, after_version=5),
}
MAGICS = {"delta": frames.DELTA_MAGIC, "update": frames.UPDATE_MAGIC, "snapshot": frames.SNAPSHOT_MAGIC}
MAGICS["request"] = frames.REQUEST_MAGIC


def _raw(magic: bytes, header: bytes, payload: bytes = b"", version: int = 1) -> bytes:
    return magic + struct.pack("<BIQ", version, len(header), len(payload)) + header + payload


def _reason(kind: str, frame: bytes, max_bytes: int = LIMIT) -> str:
    with pytest.raises(DecodeError) as info:
        DECODERS[kind](frame, max_bytes)
    return info.value.reason


def _header(kind: str) -> dict:
    frame = FRAMES[kind]
    (length,) = struct.unpack_from("<I", frame, 5)
    return json.loads(frame[17 : 17 + length])


@FAST
@given(
    run=ids, manifest=ids, fragment=fragments, anchor=counters, tokens=counters, steps=st.integers(1, 10**9)
)
def test_delta_round_trip_drops_the_sender(run, manifest, fragment, anchor, tokens, steps):
    header = DeltaHeader(run, manifest, fragment, anchor, tokens, steps, seq=anchor // 2, sender="QmForged")
    payload = encode_tensors({"w": torch.ones(3)}, codec="fp32")
    decoded, got_payload = decode_delta(encode_delta(header, payload), max_bytes=LIMIT)
    assert decoded == DeltaHeader(run, manifest, fragment, anchor, tokens, steps, seq=anchor // 2, sender="")
    assert got_payload == payload
    assert with_sender(decoded, "QmReal").sender == "QmReal"
    inbound = frames.InboundDelta.decode(encode_delta(header, payload), max_bytes=LIMIT)
    assert (inbound.header, inbound.payload, inbound.error, inbound.fragment) == (
        decoded,
        payload,
        None,
        fragment,
    )


def test_an_inbound_delta_keeps_why_it_does_not_decode():
    """A peer decodes a delta once where it enters (`InboundDelta`); a frame that does not decode keeps
    `decode_delta`'s reason for the checks that refuse it later, and names no fragment."""
    frame = encode_delta(DELTA, b"payload")
    for bad in (frame + b"!", frame[:-1], frame[:4] + b"\x02" + frame[5:]):
        with pytest.raises(DecodeError) as whole:
            decode_delta(bad, max_bytes=LIMIT)
        inbound = frames.InboundDelta.decode(bad, max_bytes=LIMIT)
        assert inbound.header is None and inbound.fragment is None and inbound.frame == bad
        assert inbound.error is not None and inbound.error.reason == whole.value.reason


@FAST
@given(
    from_version=st.integers(0, frames.MAX_COUNTER - 1),
    term=counters,
    weights=st.lists(st.floats(0, 1e30, allow_nan=False), min_size=1, max_size=20),
    payload=st.binary(max_size=64),
)
def test_update_round_trip_keeps_weights_exactly(from_version, term, weights, payload):
    contributors = tuple((f"Qm{i}", w) for i, w in enumerate(weights))
    record = UpdateRecord("r", "m", 0, from_version, term, "QmL", contributors, "c0ffee", payload)
    assert decode_update(encode_update(record), max_bytes=LIMIT) == record


def test_snapshot_round_trip_with_codec_frames():
    params = encode_tensors({"w": torch.randn(4, 4)}, codec="fp32")
    momentum = encode_tensors({"w": torch.zeros(4, 4)}, codec="fp32")
    snapshot = FragmentSnapshot("run", "hash", 3, 17, "abcd", params, momentum)
    assert decode_snapshot(encode_snapshot(snapshot), max_bytes=LIMIT) == snapshot
    empty = FragmentSnapshot("run", "hash", 3, 0, "abcd", b"", b"")
    assert decode_snapshot(encode_snapshot(empty), max_bytes=LIMIT) == empty


def test_request_round_trips():
    assert decode_request(FRAMES["request"]) == FragmentRequest(
        REQUEST_UPDATES, "run-1", "0123456789abcdef", 2, 5
    )
    snap = encode_request(REQUEST_SNAPSHOT, "run-1", "h", 9)
    assert decode_request(snap) == FragmentRequest(REQUEST_SNAPSHOT, "run-1", "h", 9, 0)
    with pytest.raises(ValueError):
        encode_request(REQUEST_SNAPSHOT, "run-1", "h", 9, after_version=3)
    with pytest.raises(ValueError):
        encode_request("everything", "run-1", "h", 9)


@pytest.mark.parametrize("kind", list(FRAMES))
@pytest.mark.parametrize("other", list(FRAMES))
def test_frames_of_one_kind_are_refused_by_other_decoders(kind, other):
    if kind != other:
        assert _reason(other, FRAMES[kind]) == codec.BAD_MAGIC
    assert _reason(kind, encode_tensors({"w": torch.ones(2)}, codec="fp32")) == codec.BAD_MAGIC


@pytest.mark.parametrize("kind", list(FRAMES))
def test_structural_errors(kind):
    frame = FRAMES[kind]
    assert _reason(kind, frame[:4] + b"\x02" + frame[5:]) == codec.UNSUPPORTED_VERSION
    assert _reason(kind, frame + b"!") == codec.TRAILING_BYTES
    assert _reason(kind, frame, max_bytes=len(frame) - 1) == codec.OVERSIZED
    for cut in range(len(frame)):
        assert _reason(kind, frame[:cut]) == codec.TRUNCATED
    huge_payload = MAGICS[kind] + struct.pack("<BIQ", 1, 2, 2**60) + b"{}"
    assert _reason(kind, huge_payload) == codec.OVERSIZED
    huge_header = MAGICS[kind] + struct.pack("<BIQ", 1, 2**31, 0)
    assert _reason(kind, huge_header, max_bytes=2**40) == codec.OVERSIZED
    assert _reason(kind, 12345) == codec.BAD_HEADER  # type: ignore[arg-type]


BAD_VALUES = [
    ("fragment", True),
    ("fragment", 1.0),
    ("fragment", -1),
    ("fragment", frames.MAX_FRAGMENT + 1),
    ("run_id", ""),
    ("run_id", "x" * (frames.MAX_ID_CHARS + 1)),
    ("run_id", "run/../1"),
    ("run_id", 7),
    ("manifest_hash", None),
]


@pytest.mark.parametrize("kind", list(FRAMES))
@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_bad_field_values_are_refused(kind, key, value):
    header = _header(kind)
    header[key] = value
    assert _reason(kind, _raw(MAGICS[kind], json.dumps(header).encode())) == codec.BAD_HEADER


@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        ("delta", "steps", 0),
        ("delta", "tokens", 2**53),
        ("delta", "seq", "1"),
        ("update", "contributors", []),
        ("update", "contributors", [["QmA", 1.0], ["QmA", 2.0]]),
        ("update", "contributors", [["QmA", -1.0]]),
        ("update", "contributors", [["QmA", 1]]),
        ("update", "contributors", [["QmA", 1.0, 2.0]]),
        ("update", "contributors", {"QmA": 1.0}),
        ("update", "leader", "Qm A"),
        ("request", "kind", "everything"),
        ("snapshot", "params_len", 10**6),
    ],
)
def test_schema_specific_values_are_refused(kind, key, value):
    header = _header(kind)
    header[key] = value
    payload = b"" if kind == "request" else b"abc"
    assert _reason(kind, _raw(MAGICS[kind], json.dumps(header).encode(), payload)) == codec.BAD_HEADER


@pytest.mark.parametrize("kind", list(FRAMES))
def test_header_text_is_strict(kind):
    header = _header(kind)
    key = next(iter(header))
    text = json.dumps(header)
    bad_headers = [
        json.dumps({**header, "extra": 1}),
        json.dumps({k: v for k, v in header.items() if k != key}),
        text[:-1] + f', "{key}": {json.dumps(header[key])}}}',  # duplicate key
        text.replace('"fragment": 2', '"fragment": NaN'),
        text.replace('"fragment": 2', '"fragment": 1e999'),
        "[1, 2]",
        "[" * 100_000,
        "{",
    ]
    for bad in bad_headers:
        assert _reason(kind, _raw(MAGICS[kind], bad.encode())) == codec.BAD_HEADER, bad[:80]
    assert _reason(kind, _raw(MAGICS[kind], b'{"run_id": "\xff"}')) == codec.BAD_HEADER
    assert _reason(kind, _raw(MAGICS[kind], text.encode(), version=0)) == codec.UNSUPPORTED_VERSION


def test_request_refuses_payload_and_snapshot_after_version():
    header = _header("request")
    assert (
        _reason("request", _raw(frames.REQUEST_MAGIC, json.dumps(header).encode(), b"x")) == codec.BAD_HEADER
    )
    header["kind"] = REQUEST_SNAPSHOT
    assert _reason("request", _raw(frames.REQUEST_MAGIC, json.dumps(header).encode())) == codec.BAD_HEADER


def test_encoders_refuse_invalid_records():
    with pytest.raises(ValueError):
        encode_delta(DeltaHeader("run", "h", 0, 0, 10, 0, 0), b"")  # zero steps
    with pytest.raises(ValueError):
        encode_update(UpdateRecord("run", "h", 0, 0, 0, "L", (("A", float("nan")),), "c", b""))
    with pytest.raises(ValueError):
        encode_snapshot(FragmentSnapshot("bad run", "h", 0, 0, "c", b"", b""))


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=200), kind=st.sampled_from(list(FRAMES)))
def test_garbage_only_raises_decode_error(data, kind):
    for candidate in (data, MAGICS[kind] + data, MAGICS[kind] + b"\x01" + data):
        try:
            DECODERS[kind](candidate)
        except DecodeError:
            pass


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(list(FRAMES)),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=3),
    cut=st.integers(0, 10_000),
    tail=st.binary(max_size=4),
)
def test_mutated_frames_only_raise_decode_error(kind, edits, cut, tail):
    frame = bytearray(FRAMES[kind])
    for position, value in edits:
        frame[position % len(frame)] = value
    candidate = bytes(frame[: cut % (len(frame) + 1)]) + tail
    try:
        DECODERS[kind](candidate)
    except DecodeError:
        pass


def test_updates_carry_each_contributors_delta_seq():
    record = UpdateRecord(
        "r", "0123456789abcdef", 0, 3, 2, "lead", (("a", 1.0), ("b", 2.0)), "c0ffee", b"p", seqs=(7, 9)
    )
    back = frames.decode_update(frames.encode_update(record), max_bytes=1 << 20)
    assert back == record and back.seq_of("b") == 9 and back.seq_of("z") is None
    assert dataclasses.replace(record, seqs=()).seq_of("a") is None  # no seqs recorded: unknown
    bad = frames.encode_update(dataclasses.replace(record, seqs=(7,)))  # one seq for two contributors
    with pytest.raises(DecodeError, match="2 contributors but 1 seqs"):
        frames.decode_update(bad, max_bytes=1 << 20)
