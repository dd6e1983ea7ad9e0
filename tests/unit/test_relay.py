"""Relaying updates peer to peer: the tree of offers (`swarm.relay`), its bookkeeping on a fake clock,
the relay frames (`wire.relay_frames`) and the `[diloco] fanout` knob."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.config import DilocoConfig
from p2p_diloco.errors import ConfigError, DecodeError
from p2p_diloco.protocol.messages import UpdateTag
from p2p_diloco.protocol.replica import ReplicaTag
from p2p_diloco.swarm.relay import (
    RECENT_RECORDS,
    Relay,
    Ring,
    children,
    children_in,
    relay_order,
    update_point,
)
from p2p_diloco.wire.relay_frames import (
    Offer,
    Relayed,
    RelayTag,
    UpdateId,
    decode_relay,
    encode_offer,
    encode_relayed,
)
from p2p_diloco.wire.replies import ReplyStatus

PEERS = [f"peer-{i}" for i in range(32)]


def update(version: int = 0, fragment: int = 0) -> UpdateId:
    return UpdateId(fragment, version, 1, "peer-0", f"c{fragment}-{version}")


def parents(
    u: UpdateId, peers: list[str], fanout: int, proven: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Who offers `u` to each peer when every peer offers to its children."""
    found, frontier = {}, [u.leader]
    while frontier:
        nxt = []
        for peer in frontier:
            for child in children(u, peers, peer, fanout, proven):
                assert child not in found and child != u.leader, f"{child} offered twice"
                found[child] = peer
                nxt.append(child)
        frontier = nxt
    return found


def depth(u: UpdateId, peers: list[str], fanout: int) -> dict[str, int]:
    """Hops at which each peer gets `u` when every peer offers to its children."""
    hops = {u.leader: 0}
    for child, parent in parents(u, peers, fanout).items():  # parents come before their children
        hops[child] = hops[parent] + 1
    return hops


@pytest.mark.parametrize("fanout", [1, 2, 3, 5])
def test_the_tree_reaches_every_peer_once_in_log_hops(fanout):
    u = update()
    hops = depth(u, PEERS, fanout)
    assert set(hops) == set(PEERS)
    levels = math.ceil(math.log(len(PEERS) * (fanout - 1) + 1, fanout)) - 1 if fanout > 1 else len(PEERS) - 1
    assert max(hops.values()) == levels
    assert all(len(children(u, PEERS, p, fanout)) <= fanout for p in PEERS)


def test_different_updates_start_at_different_peers():
    first = {tuple(children(update(v), PEERS, "peer-0", 3)) for v in range(20)}
    assert len(first) > 10  # a publisher's pushes go to different peers per update
    assert relay_order(update(4), PEERS) == relay_order(update(4), list(reversed(PEERS)))


def test_a_relays_trees_follow_the_live_peers_as_they_change():
    """The relay keeps its ring across updates and builds it again when the live peers change: its
    children are always those of the tree over the live peers it is given."""
    relay = Relay("peer-0", 3)
    for live in (PEERS[:8], PEERS[:8] + ["newcomer"], PEERS[:4], PEERS):
        for v in range(6):
            u = update(v)
            assert relay.onward(u, live) == children(u, live, "peer-0", 3)
    reached = {c for v in range(40) for c in children(update(v), PEERS[:8] + ["newcomer"], "peer-0", 3)}
    assert "newcomer" in reached  # a peer that joined sits in the trees of some updates


def test_tree_orders_walk_the_ring_from_each_updates_point():
    """Every peer once in each order, the leader first; the order is a rotation of one ring order, so two
    updates' orders differ only in where the walk starts."""
    orders = [relay_order(update(v), PEERS) for v in range(8)]
    assert all(o[0] == "peer-0" and sorted(o) == sorted(PEERS) for o in orders)
    rest = [o[1:] for o in orders]
    ring = rest[0]
    for other in rest[1:]:
        start = ring.index(other[0])
        assert other == ring[start:] + ring[:start]
    assert len({o[0] for o in rest}) > 1


def test_publisher_sends_at_most_fanout_frames_whatever_the_swarm_size():
    relay = Relay("peer-0", 3)
    for size in (2, 4, 32):
        assert len(relay.publish(update(size), PEERS[:size], frame_bytes=1000)) == min(3, size - 1)
    assert relay.stats.published == 3 and relay.stats.publish_pushes == 1 + 3 + 3
    assert relay.stats.update_bytes_sent == 7000 and relay.stats.update_frames_sent == 7


def test_onward_skips_peers_that_hold_the_update():
    u = update()
    me = children(u, PEERS, "peer-0", 2)[0]
    relay = Relay(me, 2)
    mine = children(u, PEERS, me, 2)
    assert relay.onward(u, PEERS) == mine
    relay.on_offer(mine[0], u, hop=3, version=0, now=0.0)  # it offered it to me: it holds it
    assert relay.onward(u, PEERS, holds=[mine[1]]) == []
    assert relay.stats.offers_sent == 2


def test_an_offer_is_asked_for_once_until_its_payload_is_late():
    relay = Relay("me", 3, ask_seconds=5.0)
    u = update(version=4)
    assert relay.on_offer("a", u, hop=2, version=5, now=0.0).tag == RelayTag.HAVE
    first = relay.on_offer("a", u, hop=2, version=4, now=0.0)
    assert (first.status, first.tag) == (ReplyStatus.ACCEPTED, RelayTag.SEND)
    assert relay.on_offer("b", u, hop=3, version=4, now=4.9).tag == RelayTag.ASKED
    assert relay.on_offer("b", u, hop=3, version=4, now=5.1).tag == RelayTag.SEND  # a's payload is late
    assert relay.expected("a", u) == RelayTag.UNASKED  # a's late payload was not asked for any more
    assert relay.expected("b", u) == 3
    assert relay.expected("b", u) == RelayTag.UNASKED  # used up
    assert relay.stats.offers_received == 4 and relay.stats.asked == 2


def test_a_relayer_that_sends_another_update_than_offered_is_dropped():
    relay = Relay("me", 3)
    u = update(version=2)
    forged = dataclasses.replace(u, checksum="forged")
    relay.on_offer("mallory", u, hop=2, version=2, now=0.0)
    assert relay.expected("mallory", forged) == RelayTag.MISMATCH
    assert relay.refused("mallory", RelayTag.MISMATCH)
    assert relay.on_offer("mallory", update(version=3), hop=2, version=3, now=1.0).tag == RelayTag.DROPPED
    assert relay.stats.offences == 1 and "mallory" in relay.dropped


def test_only_offences_drop_a_relayer():
    relay = Relay("me", 3)
    for harmless in (ReplicaTag.DUPLICATE_UPDATE, ReplicaTag.OUT_OF_ORDER, UpdateTag.LEASE_NOT_LIVE):
        assert not relay.refused("slow", harmless)
    assert relay.refused("mallory", UpdateTag.BAD_SIGNATURE)
    assert list(relay.dropped) == ["mallory"] and relay.stats.offences == 1


def test_applied_updates_record_hops_and_times():
    relay = Relay("me", 3)
    relay.applied(update(version=0, fragment=1), hop=1, now=3.0, relayed=False)
    relay.applied(update(version=1, fragment=1), hop=4, now=7.5, relayed=True)
    stats = relay.stats.as_dict()
    assert stats["hops"] == {"1": 4} and stats["applied_at"] == {"1": [2, 7.5]}
    assert (stats["max_hop"], stats["applied_pushed"], stats["applied_relayed"]) == (4, 1, 1)


def test_relay_frames_round_trip_and_garbage_is_refused():
    offer = Offer(update(version=7, fragment=3), hop=5)
    assert decode_relay(encode_offer(offer)) == offer
    assert decode_relay(encode_relayed(2, b"frame")) == Relayed(2, b"frame")
    good = encode_offer(offer)
    for bad in (b"", b"\x01", b"\x09\x00", good[:-1], good + b"x", b"\x01" + good[1:20]):
        with pytest.raises(DecodeError) as info:
            decode_relay(bad)
        assert info.value.reason == RelayTag.BAD_FRAME


def test_fanout_must_be_at_least_one():
    assert DilocoConfig().fanout == 3
    with pytest.raises(ConfigError, match=r"\[diloco\] fanout = 0: must be >= 1"):
        DilocoConfig(fanout=0)


def test_the_children_of_an_unreachable_peer_are_offered_by_its_parent():
    u = update()
    me = children(u, PEERS, "peer-0", 2)[0]
    relay = Relay(me, 2)
    gone = children(u, PEERS, me, 2)[0]
    heirs = relay.heirs(u, PEERS, [gone])
    assert heirs == children(u, PEERS, gone, 2) and len(heirs) == 2 and me not in heirs
    assert relay.stats.heirs_offered == 2


FRESH = [f"fresh-{i}" for i in range(64)]


@pytest.mark.parametrize("version", range(8))
def test_fresh_keys_never_stand_between_the_leader_and_a_proven_peer(version):
    u = update(version)
    proven = frozenset(PEERS[1:8])
    found = parents(u, PEERS[:8] + FRESH, 3, proven)
    assert set(found) == set(PEERS[1:8] + FRESH)
    assert all(found[p] in proven | {u.leader} for p in proven), "a fresh key parents a proven peer"
    order = relay_order(u, PEERS[:8] + FRESH, proven)
    assert set(order[1:8]) == proven  # the proven first, in rendezvous order, then the fresh keys


def test_a_relay_ranks_listed_peers_and_the_records_contributors_first():
    listed = {"peer-0", "peer-1"}
    relay = Relay("peer-0", 3, listed=listed.__contains__)
    live = ["peer-1", "peer-2", "peer-3", *FRESH]
    # the record names peer-2 and peer-3: with peer-1 (listed) they are the publisher's three pushes
    assert set(relay.publish(update(0), live, 100, contributors=("peer-2", "peer-3"))) == {
        "peer-1",
        "peer-2",
        "peer-3",
    }
    # a later record names no one: the contributors of the records applied before still rank first
    assert set(relay.publish(update(1), live, 100)) == {"peer-1", "peer-2", "peer-3"}
    # only for the last RECENT_RECORDS records
    for v in range(2, 2 + RECENT_RECORDS):
        relay.publish(update(v), live, 100, contributors=("peer-1",))
    assert "peer-2" not in relay._proven(live, ()) and "peer-1" in relay._proven(live, ())


def test_relayers_and_heirs_use_the_same_proven_ranking():
    u = update(5)
    proven = frozenset(PEERS[:6])
    first = children(u, PEERS[:6] + FRESH, "peer-0", 2, proven)[0]
    relay = Relay(first, 2, listed=lambda peer: False)
    mine = relay.onward(u, PEERS[:6] + FRESH, contributors=tuple(proven))
    assert mine == children(u, PEERS[:6] + FRESH, first, 2, proven)
    gone = mine[0]
    assert relay.heirs(u, PEERS[:6] + FRESH, [gone], tuple(proven)) == [
        c for c in children(u, PEERS[:6] + FRESH, gone, 2, proven) if c != first
    ]


@pytest.mark.parametrize("leader_on_ring", [True, False])
@pytest.mark.parametrize("version", range(6))
def test_a_ring_whose_members_are_all_proven_orders_as_the_general_rule(leader_on_ring, version):
    """The shortcut for a run that lists nobody (every member proven, one group sliced in C) gives the tree
    the two-group rule gives when every member is proven."""
    ring = Ring(PEERS if leader_on_ring else PEERS[1:])
    u = update(version)
    assert ring.order(u, ring.members) == ring.order(u, set(ring.members))
    assert ring.order(u, ring.members)[0] == u.leader


@settings(max_examples=200, deadline=None)
@given(
    members=st.sets(st.sampled_from(PEERS), min_size=1),
    proven=st.sets(st.sampled_from(PEERS)),
    leader=st.sampled_from([*PEERS[:4], "peer-elsewhere"]),
    version=st.integers(0, 50),
)
def test_a_tree_order_is_the_leader_then_the_proven_then_the_others_each_round_the_ring(
    members, proven, leader, version
):
    """`Ring.order` against the rule written out peer by peer: the leader first, then the proven members,
    then the others, each group in ring order from the update's point, the leader nowhere else."""
    ring = Ring(members)
    u = dataclasses.replace(update(version), leader=leader)
    start = next((i for i, at in enumerate(ring.points) if at >= update_point(u)), len(ring.points))
    walk = ring.peers[start:] + ring.peers[:start]
    expected = [leader]
    expected += [p for p in walk if p in proven and p != leader]
    expected += [p for p in walk if p not in proven and p != leader]
    assert ring.order(u, frozenset(proven)) == expected


@settings(max_examples=200, deadline=None)
@given(
    members=st.sets(st.sampled_from(PEERS)),
    proven=st.one_of(st.none(), st.sets(st.sampled_from(PEERS))),
    leader=st.sampled_from([*PEERS[:4], "peer-elsewhere"]),
    version=st.integers(0, 50),
    fanout=st.integers(1, 4),
)
def test_a_peers_children_are_its_positions_in_the_tree_order(members, proven, leader, version, fanout):
    """`Ring.children_of` (found by arithmetic when every member is proven, `proven` None here) names, for
    every peer of the order and one outside it, the children `children_in` reads off the whole order."""
    ring = Ring(members)
    u = dataclasses.replace(update(version), leader=leader)
    rule = ring.members if proven is None else frozenset(proven)
    order = ring.order(u, rule)
    for peer in [*order, "peer-nowhere"]:
        expected = children_in(order, peer, fanout) if peer in order else []
        assert ring.children_of(u, peer, fanout, rule) == expected
