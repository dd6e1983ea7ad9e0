"""Eval history and peer stats records: round trips, strict schema, garbage never raises but RecordError."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.wire.observe import (
    MAX_EVAL_BYTES,
    MAX_EVAL_POINTS,
    EvalHistory,
    EvalPoint,
    PeerStats,
    decode_eval_history,
    decode_peer_stats,
    merge_points,
    thin,
)
from p2p_diloco.wire.records import MAX_RECORD_BYTES, RecordError

A, B = "QmA" + "a" * 40, "QmB" + "b" * 40


def point(t: float, loss: float = 2.0, evaluator: str = A, versions=(1, 2)) -> EvalPoint:  # noqa: ANN001
    return EvalPoint(
        t=t, tokens=int(t * 100), versions=tuple(versions), loss=loss, evaluator=evaluator, term=1
    )


HISTORY = EvalHistory(points=(point(1.0, 3.0), point(2.0, 2.5)), dedicated=True, contributions=((A, 900, 4),))


def test_eval_history_round_trip_and_point_fields():
    assert decode_eval_history(HISTORY.to_bytes(), 2) == HISTORY
    p = HISTORY.points[1]
    assert p.perplexity == pytest.approx(math.exp(2.5)) and p.updates == 3
    assert p.as_dict()["perplexity"] == p.perplexity and p.as_dict()["versions"] == [1, 2]


def mutate(transform) -> bytes:  # noqa: ANN001
    d = json.loads(HISTORY.to_bytes())
    transform(d)
    return json.dumps(d).encode()


@pytest.mark.parametrize(
    "transform, why",
    [
        (lambda d: d.pop("dedicated"), "missing key"),
        (lambda d: d.update(extra=1), "unknown key"),
        (lambda d: d.update(dedicated=1), "dedicated not a boolean"),
        (lambda d: d["points"][0].__setitem__(3, float("nan")), "NaN loss"),
        (lambda d: d["points"][0].__setitem__(3, -1.0), "negative loss"),
        (lambda d: d["points"][0].__setitem__(4, 99.0), "perplexity is not exp(loss)"),
        (lambda d: d["points"][0].__setitem__(2, [1]), "one version for two fragments"),
        (lambda d: d["points"][0].__setitem__(1, True), "a boolean as tokens"),
        (lambda d: d["points"][0].__setitem__(5, ""), "empty evaluator"),
        (lambda d: d["points"][0].__setitem__(5, "a\nb"), "unprintable evaluator"),
        (lambda d: d["points"].reverse(), "points out of time order"),
        (lambda d: d["points"][0].append(1), "a point of 8 items"),
        (lambda d: d.update(points=[d["points"][0]] * (MAX_EVAL_POINTS + 1)), "too many points"),
        (lambda d: d["contributions"][0].__setitem__(1, -5), "negative tokens"),
        (lambda d: d.update(contributions=[[A, 1, 1]] * 33), "too many contributors"),
    ],
)
def test_eval_history_refuses_what_does_not_match(transform, why):
    with pytest.raises(RecordError):
        decode_eval_history(mutate(transform), 2)


def test_eval_history_refuses_oversized_and_non_json():
    with pytest.raises(RecordError):
        decode_eval_history(b" " * (MAX_EVAL_BYTES + 1), 2)
    for raw in (b"", b"[]", b"\xff\xfe", b"{" * 5000, "x"):
        with pytest.raises(RecordError):
            decode_eval_history(raw, 2)  # type: ignore[arg-type]


def test_a_large_history_is_trimmed_to_fit_the_record():
    fragments = 400
    history = EvalHistory(points=tuple(point(float(t), versions=[t] * fragments) for t in range(300)))
    raw = history.to_bytes()
    decoded = decode_eval_history(raw, fragments)
    assert len(raw) <= MAX_EVAL_BYTES and 0 < len(decoded.points) < 300
    assert decoded.points[-1] == history.points[-1]  # the newest points are kept


def test_a_long_history_keeps_its_newest_half_and_thins_the_older_points_evenly():
    points = [point(float(t)) for t in range(1000)]
    kept = thin(points, 10)
    assert [p.t for p in kept] == [0.0, 199.0, 398.0, 597.0, 796.0, 995.0, 996.0, 997.0, 998.0, 999.0]
    assert thin(points[:7], 10) == tuple(points[:7])
    history = EvalHistory(points=tuple(points))
    raw = history.to_bytes()
    assert (
        len(raw) <= MAX_EVAL_BYTES < MAX_RECORD_BYTES
    )  # small enough for hivemind's DHT pipe (dht_store.py)
    decoded = decode_eval_history(raw, 2).points
    assert decoded[0].t == 0.0 and decoded[-1].t == 999.0 and len(decoded) <= MAX_EVAL_POINTS


def test_merge_points_keeps_one_point_per_time_and_evaluator_newest_last():
    mine, theirs = [point(1.0), point(3.0)], [point(1.0), point(2.0, evaluator=B)]
    merged = merge_points(mine, theirs)
    assert [(p.t, p.evaluator) for p in merged] == [(1.0, A), (2.0, B), (3.0, A)]
    assert merge_points(mine, theirs, limit=2) == (merged[0], merged[-1])  # thinned: first and newest


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
        max_leaves=20,
    )
)
def test_any_json_decodes_or_raises_record_error(value):
    raw = json.dumps(value).encode()
    for decode in (lambda r: decode_eval_history(r, 2), decode_peer_stats):
        try:
            decode(raw)
        except RecordError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_valid_records_decode_or_raise_record_error(data):
    for raw in (HISTORY.to_bytes(), PeerStats(1.0, "cpu", 2, 3).to_bytes()):
        i = data.draw(st.integers(0, len(raw) - 1))
        b = data.draw(st.integers(0, 255))
        mutated = raw[:i] + bytes([b]) + raw[i + 1 :]
        for decode in (lambda r: decode_eval_history(r, 2), decode_peer_stats):
            try:
                decode(mutated)
            except RecordError:
                pass


def test_peer_stats_round_trip_and_refusals():
    stats = PeerStats(started_at=12.5, device="cuda:0", bytes_sent=10, bytes_received=20)
    assert decode_peer_stats(stats.to_bytes()) == stats
    d = json.loads(stats.to_bytes())
    for bad in (
        {**d, "device": "x" * 33},
        {**d, "bytes_sent": -1},
        {**d, "extra": 0},
        {**d, "started_at": "1"},
    ):
        with pytest.raises(RecordError):
            decode_peer_stats(json.dumps(bad).encode())


def test_a_writer_cannot_rewrite_or_add_to_a_live_evaluators_curve():
    from p2p_diloco.wire.observe import merge_records

    honest = EvalHistory(points=(point(10.0, 3.0), point(20.0, 2.5)))  # A's own record
    forged = EvalHistory(
        points=(
            point(5.0, 9.0),  # older than all A's record holds: taken as relayed history
            point(15.0, 0.1),  # "A" at a time A's record covers but does not have: refused
            point(20.0, 0.1),  # a rewrite of A's point: A's own copy wins
            point(16.0, 0.2, evaluator=B),  # B's own point
            point(17.0, 0.3, evaluator="QmGone"),  # an evaluator whose record is gone: relayed
        )
    )
    merged = merge_records({A: honest, B: forged})
    assert [(p.t, p.evaluator, p.loss) for p in merged] == [
        (5.0, A, 9.0),
        (10.0, A, 3.0),
        (16.0, B, 0.2),
        (17.0, "QmGone", 0.3),
        (20.0, A, 2.5),
    ]
