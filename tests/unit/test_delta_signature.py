"""Signed deltas (`wire.delta_signature`): the exact signed bytes and their strict parser, signing with the
record-signing keys, and the check a replica runs on a delta a record lists."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.errors import DecodeError
from p2p_diloco.wire import delta_signature as ds
from p2p_diloco.wire.delta_signature import (
    DeltaRefusal,
    ListedDelta,
    SignedDelta,
    check_listed_delta,
    delta_signing_bytes,
    parse_delta_signing_bytes,
    payload_digest,
    sign_delta,
)
from p2p_diloco.wire.signing import InMemoryKeys

PAYLOAD = b"PDTF a codec frame"
DELTA = SignedDelta("run-1", "0123456789abcdef", "QmLearner", 3, 41, 7, 4096, payload_digest(PAYLOAD))


def test_signing_bytes_have_the_documented_layout_and_parse_back():
    data = delta_signing_bytes(DELTA)
    expected = (
        b"PDds\x01"
        + b"\x05run-1"
        + b"\x100123456789abcdef"
        + b"\x09QmLearner"
        + struct.pack("<HQQQ", 3, 41, 7, 4096)
        + DELTA.digest
    )
    assert data == expected and len(data) <= ds.MAX_SIGNING_BYTES
    assert parse_delta_signing_bytes(data) == DELTA
    assert parse_delta_signing_bytes(bytearray(data)) == DELTA


def test_every_field_changes_the_bytes():
    base = delta_signing_bytes(DELTA)
    for field, value in [
        ("run_id", "run-2"),
        ("manifest_hash", "0123456789abcdee"),
        ("learner", "QmOther"),
        ("fragment", 4),
        ("anchor_version", 42),
        ("seq", 8),
        ("tokens", 4097),
        ("digest", payload_digest(b"other")),
    ]:
        assert delta_signing_bytes(dataclasses.replace(DELTA, **{field: value})) != base, field


def test_out_of_range_fields_cannot_be_signed():
    for field, value in [
        ("run_id", ""),
        ("learner", "x" * 129),
        ("learner", "bad id"),
        ("learner", "é"),
        ("fragment", 65536),
        ("seq", -1),
        ("tokens", 2**53),
        ("anchor_version", True),
        ("digest", b"short"),
    ]:
        with pytest.raises(ValueError, match=field):
            delta_signing_bytes(dataclasses.replace(DELTA, **{field: value}))


def test_the_parser_is_strict():
    data = delta_signing_bytes(DELTA)
    for bad, reason in [
        (b"XXXX" + data[4:], "bad magic"),
        (data[:4] + b"\x02" + data[5:], "unsupported version"),
        (data + b"\x00", "trailing bytes"),
        (data[:5] + b"\x05run 1" + data[11:], "bad header"),  # a space is no identifier character
        (data[:5] + b"\x05ru\xffn1" + data[11:], "bad header"),  # not ASCII
        (data[:5] + b"\x00" + data[11:], "bad header"),  # empty run id, the rest shifted
    ]:
        with pytest.raises(DecodeError) as info:
            parse_delta_signing_bytes(bad)
        assert info.value.reason == reason, bad
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            parse_delta_signing_bytes(data[:cut])


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200))
def test_garbage_only_raises_decode_error(data):
    try:
        parsed = parse_delta_signing_bytes(b"PDds\x01" + data)
    except DecodeError:
        return
    assert delta_signing_bytes(parsed) == b"PDds\x01" + data  # what parses is exactly one encoding


def _checked(keys, listed, *, signed=DELTA, signature=None, payload=PAYLOAD, fragment=3):
    if signature is None:
        signature = sign_delta(keys.signer(signed.learner), signed)
    return check_listed_delta(
        keys,
        listed,
        run_id="run-1",
        manifest_hash="0123456789abcdef",
        fragment=fragment,
        signed=signed,
        signature=signature,
        payload=payload,
    )


def test_a_listed_delta_checks_only_when_signature_digest_and_weight_do():
    keys = InMemoryKeys()
    listed = ListedDelta("QmLearner", 7, payload_digest(PAYLOAD), 4096)
    assert _checked(keys, listed) is None
    forged = sign_delta(keys.signer("QmMallory"), dataclasses.replace(DELTA, learner="QmMallory"))
    for kwargs, reason in [
        ({"payload": PAYLOAD + b"!"}, DeltaRefusal.DIGEST_MISMATCH),
        ({"signature": forged}, DeltaRefusal.BAD_SIGNATURE),  # another peer's signature
        ({"signature": b""}, DeltaRefusal.BAD_SIGNATURE),
        ({"signature": b"x" * 5000}, DeltaRefusal.BAD_SIGNATURE),
        ({"fragment": 2}, DeltaRefusal.WRONG_DELTA),
    ]:
        result = _checked(keys, listed, **kwargs)
        assert result is not None and result[0] == reason, kwargs
    heavier = dataclasses.replace(listed, weight=8192)  # the record claims more tokens than were signed
    assert _checked(keys, heavier)[0] == DeltaRefusal.WEIGHT_MISMATCH
    # the holder may weigh a delta less than its tokens (a newcomer's earned weight, issue #41), never < 1
    assert _checked(keys, dataclasses.replace(listed, weight=819)) is None
    assert _checked(keys, dataclasses.replace(listed, weight=0))[0] == DeltaRefusal.WEIGHT_MISMATCH
    other_seq = dataclasses.replace(listed, seq=8)
    assert _checked(keys, other_seq)[0] == DeltaRefusal.WRONG_DELTA
    # a signature over other tokens does not check for these
    resigned = sign_delta(keys.signer("QmLearner"), dataclasses.replace(DELTA, tokens=1))
    assert _checked(keys, listed, signature=resigned)[0] == DeltaRefusal.BAD_SIGNATURE


def test_only_the_learner_signs_its_delta():
    keys = InMemoryKeys()
    with pytest.raises(ValueError, match="cannot sign"):
        sign_delta(keys.signer("QmOther"), DELTA)
