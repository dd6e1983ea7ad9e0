"""The bundle of signed delta frames a sparse round's update carries (`wire.delta_bundle`): round trip and
a strict decoder (exact sizes, a count in range, no empty frame, nothing trailing; only `DecodeError`)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.errors import DecodeError
from p2p_diloco.wire.codecs.blockwise import (
    BAD_HEADER,
    BAD_MAGIC,
    TRAILING_BYTES,
    TRUNCATED,
    UNSUPPORTED_VERSION,
)
from p2p_diloco.wire.delta_bundle import MAX_BUNDLED, bundle_bound, decode_bundle, encode_bundle

FRAMES = [b"PDde first frame", b"x", b"PDde" + bytes(300)]


def test_a_bundle_round_trips_and_meets_its_bound():
    data = encode_bundle(FRAMES)
    assert decode_bundle(data, max_bytes=len(data)) == FRAMES
    assert len(data) <= bundle_bound(max(map(len, FRAMES)), len(FRAMES))
    assert len(encode_bundle([b"y" * 10] * 3)) == bundle_bound(10, 3)


@pytest.mark.parametrize("frames", [[], [b""], [b"a"] * (MAX_BUNDLED + 1)])
def test_the_encoder_refuses_what_the_decoder_would(frames):
    with pytest.raises(ValueError):
        encode_bundle(frames)


def test_malformed_bundles_are_refused_with_their_reason():
    good = encode_bundle(FRAMES)
    cases = {
        BAD_MAGIC: b"PDxx" + good[4:],
        UNSUPPORTED_VERSION: good[:4] + b"\x02" + good[5:],
        TRUNCATED: good[:-1],
        TRAILING_BYTES: good + b"\x00",
        BAD_HEADER: good[:5] + struct.pack("<I", 0),  # no frames
    }
    empty = b"PDdb\x01" + struct.pack("<I", 1) + struct.pack("<Q", 0)
    too_many = b"PDdb\x01" + struct.pack("<I", MAX_BUNDLED + 1)
    for reason, data in {**cases, "empty": empty, "too many": too_many}.items():
        with pytest.raises(DecodeError) as caught:
            decode_bundle(data, max_bytes=1 << 20)
        assert caught.value.reason == (BAD_HEADER if reason in ("empty", "too many") else reason), reason


@settings(max_examples=200, deadline=None)
@given(
    st.binary(max_size=200)
    | st.builds(lambda n, tail: encode_bundle(FRAMES)[:n] + tail, st.integers(0, 400), st.binary(max_size=8))
)
def test_any_bytes_decode_to_frames_or_raise_decode_error(data):
    try:
        frames = decode_bundle(data, max_bytes=1 << 16)
    except DecodeError as exc:
        assert exc.reason
    else:
        assert 1 <= len(frames) <= MAX_BUNDLED and encode_bundle(frames) == data
