"""Typed replies on the wire: round trip, and what a stranger could send instead is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.errors import DecodeError
from p2p_diloco.wire.replies import MAX_REASON_BYTES, Reply, ReplyStatus, decode_reply, encode_reply


@pytest.mark.parametrize("status", list(ReplyStatus))
def test_every_status_round_trips_with_its_reason_and_tag(status):
    reply = Reply(status, "stale anchor: v3 < v5 - 4 (fragment 2)")
    assert decode_reply(encode_reply(reply)) == reply
    assert reply.tag == "stale anchor" and reply.ok == (status in (ReplyStatus.ACCEPTED, ReplyStatus.APPLIED))


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "empty"),
        (bytes([len(ReplyStatus)]) + b"x", "unknown reply status"),
        (b"\x00" + b"x" * (MAX_REASON_BYTES + 1), "exceeds"),
        (b"\x00\xff\xfe", "not UTF-8"),
    ],
)
def test_malformed_replies_are_refused_with_a_reason(data, why):
    with pytest.raises(DecodeError, match=why) as refused:
        decode_reply(data)
    assert refused.value.reason == "bad reply"


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_decode_to_a_reply_or_raise_decode_error(data):
    try:
        reply = decode_reply(data)
    except DecodeError:
        return
    assert isinstance(reply.status, ReplyStatus) and isinstance(reply.reason, str)
