"""A sparse round's delta listing (`wire.delta_listing`): canonical JSON form, strict checks, round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.wire.delta_listing import listing_fields, listing_problem, parse_listing
from p2p_diloco.wire.delta_signature import ListedDelta, payload_digest
from p2p_diloco.wire.frames import MAX_CONTRIBUTORS

A = ListedDelta("QmA", 3, payload_digest(b"a"), 4096)
B = ListedDelta("QmB", 1, payload_digest(b"b"), 2048)
A2 = ListedDelta("QmA", 4, payload_digest(b"a2"), 1)


def test_listing_is_sorted_and_survives_json():
    fields = listing_fields([B, A2, A])
    assert [f[:2] for f in fields] == [["QmA", 3], ["QmA", 4], ["QmB", 1]]
    assert listing_problem(fields) is None
    assert parse_listing(json.loads(json.dumps(fields))) == (A, A2, B)


def test_invalid_listings_name_the_problem():
    good = listing_fields([A, B])
    for value, words in [
        ([], "1-"),
        ("x", "1-"),
        ([good[0]] * (MAX_CONTRIBUTORS + 1), "1-"),
        ([good[1], good[0]], "sorted"),
        ([good[0], good[0]], "sorted"),
        ([good[0][:3]], "entries must be"),
        ([["Qm A", 3, good[0][2], 1]], "learner"),
        ([["QmA", -1, good[0][2], 1]], "seq"),
        ([["QmA", True, good[0][2], 1]], "seq"),
        ([["QmA", 3, good[0][2].upper(), 1]], "digest"),
        ([["QmA", 3, good[0][2][:-2], 1]], "digest"),
        ([["QmA", 3, good[0][2], 0]], "weight"),
        ([["QmA", 3, good[0][2], 1.0]], "weight"),
    ]:
        problem = listing_problem(value)
        assert problem is not None and words in problem, (value, problem)
        with pytest.raises(ValueError):
            parse_listing(value)
    with pytest.raises(ValueError, match="sorted"):
        listing_fields([A, A])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=70),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(value=json_values)
def test_any_json_value_is_checked_without_raising(value):
    problem = listing_problem(value)
    if problem is None:
        assert listing_fields(parse_listing(value)) == value  # what passes is canonical
