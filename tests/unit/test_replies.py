"""Typed replies on the wire: round trip, and what a stranger could send instead is refused."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.sync_round import RoundTag
from p2p_diloco.wire.replies import MAX_REPLY_BYTES, Reply, ReplyStatus, decode_reply, encode_reply

HEAD = struct.Struct(">BBd")  # status, tag length, retry_after (the wire form, spelled out)


@pytest.mark.parametrize("status", list(ReplyStatus))
def test_every_status_round_trips_with_its_reason_and_tag(status):
    reply = Reply(status, RoundTag.STALE_ANCHOR, "v3 < v5 - 4 (fragment 2)", retry_after=2.5)
    decoded = decode_reply(encode_reply(reply))
    assert decoded == reply and decoded.tag == RoundTag.STALE_ANCHOR and decoded.retry_after == 2.5
    assert reply.reason == "stale anchor: v3 < v5 - 4 (fragment 2)"
    assert reply.ok == (status in (ReplyStatus.ACCEPTED, ReplyStatus.APPLIED))


def test_a_tag_alone_reads_as_the_tag():
    assert str(decode_reply(encode_reply(Reply.refused(RoundTag.ROUND_CLOSED)))) == "round closed"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "shorter than"),
        (HEAD.pack(len(ReplyStatus), 0, 0.0) + b"x", "unknown reply status"),
        (HEAD.pack(0, 0, 0.0) + b"x" * MAX_REPLY_BYTES, "exceeds"),
        (HEAD.pack(0, 2, 0.0) + b"\xff\xfe", "not UTF-8"),
        (HEAD.pack(0, 9, 0.0) + b"tag", "runs past"),
        (HEAD.pack(0, 0, -1.0), "retry_after"),
        (HEAD.pack(0, 0, float("nan")), "retry_after"),
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
