"""DHT record encodings: round trips, strict schema, garbage never raises anything but RecordError."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.wire.records import (
    MAX_COUNTERS,
    MAX_DECISIONS,
    MAX_RECORD_BYTES,
    MAX_TEXT,
    HeartbeatInfo,
    RecordError,
    decode_heartbeat,
    decode_lease,
    encode_lease,
)

INFO = HeartbeatInfo(
    role="learner",
    may_sync=True,
    reachable=True,
    versions=(1, 2, 3),
    term_seen=4,
    digest="ab",
    tips=((0, "0" * 16), (4, "0123456789abcdef"), (2, "f" * 16)),
)


def test_heartbeat_round_trip_and_election_view():
    assert decode_heartbeat(INFO.to_bytes(), 3) == INFO
    hb = INFO.as_election_record("peer", expires_at=9.0)
    assert (hb.peer_id, hb.versions, hb.term_seen, hb.expires_at) == ("peer", (1, 2, 3), 4, 9.0)


def test_a_heartbeat_too_large_for_the_dht_drops_what_only_status_shows_and_still_decodes():
    long = "x" * MAX_TEXT
    full = dataclasses.replace(
        INFO,
        decisions=(long,) * MAX_DECISIONS,
        rejections=tuple((f"{i}{long}"[:MAX_TEXT], i) for i in range(MAX_COUNTERS)),
        rejections_by_sender=tuple((f"{i}{long}"[:MAX_TEXT], long, i) for i in range(MAX_COUNTERS)),
    )
    raw = full.to_bytes()
    assert len(raw) <= MAX_RECORD_BYTES
    decoded = decode_heartbeat(raw, 3)
    assert decoded.versions == INFO.versions and decoded.tips == INFO.tips and decoded.decisions == ()
    assert decode_heartbeat(INFO.to_bytes(), 3) == INFO  # a normal one keeps everything


def test_heartbeat_tips_give_branch_tips_per_fragment():
    assert INFO.tip(1) == BranchTip(4, 2, "0123456789abcdef")
    assert dataclasses.replace(INFO, tips=()).tip(1) is None
    assert decode_heartbeat(dataclasses.replace(INFO, tips=()).to_bytes(), 3).tips == ()


def test_lease_round_trip():
    lease = LeaseRecord("peer", 3, 12.5, rounds_done=7, released=True)
    assert decode_lease("peer", encode_lease(lease)) == lease


@pytest.mark.parametrize(
    "change, fragment_count",
    [
        ({"role": "king"}, 3),
        ({"may_sync": 1}, 3),
        ({"versions": [1, 2]}, 3),
        ({"versions": [1, -2, 3]}, 3),
        ({"versions": [1, True, 3]}, 3),
        ({"shard_terms": [1, -1]}, 3),
        ({"shard_terms": [1.5]}, 3),
        ({"step": 1.5}, 3),
        ({"loss": float("nan")}, 3),
        ({"addresses": ["a"] * 17}, 3),
        ({"extra": 1}, 3),
        ({"tips": [[1, "0" * 16]]}, 3),
        ({"tips": [[1, "0" * 16]] * 2 + [[-1, "0" * 16]]}, 3),
        ({"tips": [[1, "0" * 15]] * 3}, 3),
        ({"tips": [[1, "G" * 16]] * 3}, 3),
        ({"tips": [[1.0, "0" * 16]] * 3}, 3),
        ({"tips": [[1, "0" * 16, 2]] * 3}, 3),
        # the bulk check joins the checksums: lengths that add up to 3 x 16 must still be refused
        ({"tips": [[1, "0" * 15], [1, "0" * 17], [1, "0" * 16]]}, 3),
        ({"tips": [[1, "0" * 15 + "\n"]] * 3}, 3),
        ({"tips": [[True, "0" * 16]] * 3}, 3),
        ({"step_time": float("inf")}, 3),
        ({"loss": -0.5}, 3),
        ({"tokens_per_s": True}, 3),
        ({"ranks": -1}, 3),
        ({"tokens": False}, 3),
    ],
)
def test_heartbeat_schema_violations_are_rejected(change, fragment_count):
    d = json.loads(INFO.to_bytes())
    d.update(change)
    with pytest.raises(RecordError):
        decode_heartbeat(json.dumps(d).encode(), fragment_count)


@pytest.mark.parametrize(
    "value",
    [
        b"{}",
        b'{"term": 0, "expires_at": 1, "rounds_done": 0, "released": false}',
        b'{"term": 1, "expires_at": 1, "rounds_done": 0, "released": "no"}',
        b'{"term": true, "expires_at": 1, "rounds_done": 0, "released": false}',
    ],
)
def test_bad_leases_are_rejected(value):
    with pytest.raises(RecordError):
        decode_lease("peer", value)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256) | st.text(max_size=128).map(str.encode))
def test_garbage_only_raises_record_error(raw):
    for decode in (lambda r: decode_heartbeat(r, 3), lambda r: decode_lease("p", r)):
        try:
            decode(raw)
        except RecordError:
            pass
