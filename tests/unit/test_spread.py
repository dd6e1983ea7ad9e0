"""Update spread from peers' event logs (demo/spread.py): propagation, bytes per merged update, fan-out."""

from __future__ import annotations

import pytest

from p2p_diloco.demo import spread


def progress(t: float, sent: float, received: float) -> dict:
    return {"t": t, "event": "progress", "tokens": t, "bytes_sent": sent, "bytes_received": received}


def update(kind: str, t: float, fragment: int, version: int) -> dict:
    return {"t": t, "event": kind, "fragment": fragment, "version": version, "term": 1, "leader": "a"}


def logs() -> dict[str, list[dict]]:
    """a publishes v1 and v2 of fragment 0 to b and c; 100-byte updates, b sends one 100-byte delta."""
    return {
        "a": [
            {"t": 0.0, "event": "start"},
            update("published", 10.0, 0, 1),
            update("published", 20.0, 0, 2),
            progress(30.0, 400.0, 100.0),
        ],
        "b": [
            {"t": 0.0, "event": "start"},
            update("applied", 10.5, 0, 1),
            update("applied", 21.0, 0, 2),
            progress(30.0, 100.0, 200.0),
        ],
        "c": [
            {"t": 0.0, "event": "start"},
            update("applied", 11.0, 0, 1),
            update("applied", 20.2, 0, 2),
            update("applied", 25.0, 0, 2),  # a duplicate line: the first application counts
            progress(30.0, 0.0, 200.0),
        ],
    }


def test_propagation_is_publish_to_the_last_peer_applied():
    prop = spread.propagation(logs(), 0.0, 30.0)
    assert prop["updates"] == 2
    assert prop["max"] == pytest.approx(1.0)  # v1: 10 -> 11 (c); v2: 20 -> 21 (b)
    assert prop["p50"] == pytest.approx(1.0) and prop["peers_reached_median"] == 2
    assert spread.propagation(logs(), 15.0, 30.0)["updates"] == 1  # only v2 was published in the window


def test_traffic_per_merged_update_busiest_and_fanout():
    moved = spread.traffic(logs(), 0.0, 30.0, update_bytes=100.0)
    assert moved["merged_updates"] == 2
    assert moved["busiest"] == "a"
    assert moved["busiest_bytes_per_update"] == pytest.approx(250.0)  # (400 + 100) / 2
    assert moved["per_peer"]["b"]["received_per_update"] == pytest.approx(100.0)
    assert moved["per_peer"]["c"]["applied"] == 2 and moved["per_peer"]["a"]["published"] == 2
    assert moved["publisher_fanout"] == {"a": pytest.approx(2.0)}  # 400 bytes for 2 updates of 100
    assert moved["received_per_applied_median"] == pytest.approx(100.0)
    assert moved["claims"] == 0


def test_two_publishers_of_one_version_each_count_it_for_their_fanout():
    events = logs()
    events["b"].insert(1, update("published", 20.5, 0, 2))  # a split election: b publishes v2 too
    events["b"].insert(1, {"t": 19.0, "event": "claim", "term": 1})
    events["a"].insert(1, {"t": 9.0, "event": "claim", "term": 1})
    moved = spread.traffic(events, 0.0, 30.0, update_bytes=100.0)
    assert moved["merged_updates"] == 2
    assert moved["per_peer"]["b"]["published"] == 1
    assert moved["publisher_fanout"]["b"] == pytest.approx(1.0)  # 100 bytes sent for its 1 update
    assert moved["claims"] == 2 and moved["terms_claimed"] == 1 and moved["terms_held_twice"] == 1


def test_the_same_term_number_in_two_shards_is_not_a_term_held_twice():
    events = logs()
    events["a"].insert(1, {"t": 9.0, "event": "claim", "term": 1, "shard": 0})
    events["b"].insert(1, {"t": 9.5, "event": "claim", "term": 1, "shard": 1})
    events["b"].insert(1, {"t": 19.0, "event": "claim", "term": 2, "shard": 1})
    moved = spread.traffic(events, 0.0, 30.0, update_bytes=100.0)
    assert moved["claims"] == 3 and moved["terms_claimed"] == 3 and moved["terms_held_twice"] == 0


def test_percentile_interpolates_and_is_none_without_values():
    assert spread.percentile([], 0.5) is None
    assert spread.percentile([1.0, 3.0], 0.5) == pytest.approx(2.0)
    assert spread.percentile([5.0, 1.0, 3.0], 0.99) == pytest.approx(4.96)


def test_relay_counts_grow_in_the_window_and_give_pushes_per_update():
    def relayed(t: float, published: int, pushes: int, hop: int) -> dict:
        stats = {"published": published, "publish_pushes": pushes, "relayed": 0, "max_hop": hop}
        return {"t": t, "event": "progress", "relay": stats}

    events = {
        "a": [relayed(5.0, 2, 6, 0), relayed(15.0, 6, 18, 0), relayed(40.0, 9, 27, 0)],
        "b": [relayed(15.0, 0, 0, 3)],
        "c": [progress(15.0, 0.0, 0.0)],  # no relay field: not counted
    }
    counts = spread.relay_counts(events, 10.0, 20.0)
    assert counts["per_peer"]["a"]["published"] == 4 and counts["per_peer"]["a"]["publish_pushes"] == 12
    assert counts["publisher_pushes_per_update"] == {"a": pytest.approx(3.0)}
    assert counts["max_hop"] == 3 and set(counts["per_peer"]) == {"a", "b"}
    assert spread.relay_counts(logs(), 0.0, 30.0) == {}
