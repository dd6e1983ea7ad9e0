"""The dissemination model of scripts/bench_swarm.py --inprocess (sim/dissemination.py) on the link model."""

from __future__ import annotations

import pytest

from p2p_diloco.sim.dissemination import SpreadSpec, children, relay_order, run_spread
from p2p_diloco.swarm.links import LinkSpec

pytestmark = pytest.mark.sim
FRAME = 10_000
LINK = LinkSpec(up=1e6, down=4e6, latency=0.01)


def tree_depth(peers: int, fanout: int) -> int:
    """Hops to the last of `peers` nodes of a complete `fanout`-ary tree (the root is hop 0)."""
    depth, level, covered = 0, 1, 1
    while covered < peers:
        depth, level = depth + 1, level * fanout
        covered += level
    return depth


def spec(peers: int, **kw) -> SpreadSpec:
    return SpreadSpec(peers=peers, update_bytes=FRAME, delta_bytes=FRAME, rounds=2, link=LINK, **kw)


def test_push_to_all_makes_the_holder_carry_every_copy():
    report = run_spread(spec(16))
    assert report["every_peer_got_every_update"] and report["depth_max"] == 1
    # one holder (S = 1) sends 15 copies and receives 15 deltas of each of the 4 fragments per round
    assert report["busiest_update_bytes_per_round"] == 4 * 15 * FRAME
    assert report["busiest_delta_bytes_per_round"] == 4 * 15 * FRAME


def test_the_relay_tree_reaches_everyone_in_log_hops_with_bounded_update_bytes():
    small, big = run_spread(spec(16, fanout=3)), run_spread(spec(128, fanout=3))
    for report, peers in ((small, 16), (big, 128)):
        assert report["every_peer_got_every_update"]
        assert report["depth_max"] == tree_depth(peers, 3)
    # a peer sends at most 3 payloads and receives one per update, whatever the size
    assert big["max_update_bytes_per_round"] <= 4 * (3 + 1) * (FRAME + 2 * 120)
    assert big["max_update_bytes_per_round"] < 1.5 * small["max_update_bytes_per_round"]
    # deltas still all go to the shard's holder: that part grows with the swarm
    assert big["busiest_delta_bytes_per_round"] == 4 * 127 * FRAME


def test_shards_spread_the_deltas_over_holders():
    one, four = run_spread(spec(32, fanout=3)), run_spread(spec(32, fanout=3, shards=4))
    assert one["busiest_delta_bytes_per_round"] == 4 * 31 * FRAME  # one holder takes every delta
    # four holders: each takes 31 deltas of its own fragment and sends its 3 others to the other holders
    assert four["busiest_delta_bytes_per_round"] == (31 + 3) * FRAME


def test_relay_order_starts_at_the_leader_and_children_partition_the_rest():
    peers = [f"p{i}" for i in range(10)]
    order = relay_order(peers, "p7", fragment=1, rnd=2)
    assert order[0] == "p7" and sorted(order) == sorted(peers)
    assert relay_order(peers, "p7", fragment=1, rnd=3) != order  # another update, another tree
    reached = [c for i in range(len(order)) for c in children(order, i, 3)]
    assert sorted(reached) == sorted(order[1:])
    with pytest.raises(ValueError):
        spec(4, shards=5)
