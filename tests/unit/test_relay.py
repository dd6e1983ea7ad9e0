"""Relaying updates peer to peer: the tree of offers (`swarm.relay`), its bookkeeping on a fake clock,
the relay frames (`wire.relay_frames`) and the `[diloco] fanout` knob."""

from __future__ import annotations

import dataclasses
import math

import pytest

from p2p_diloco.config import DilocoConfig
from p2p_diloco.errors import ConfigError, DecodeError
from p2p_diloco.protocol.messages import UpdateTag
from p2p_diloco.protocol.replica import ReplicaTag
from p2p_diloco.swarm.relay import Relay, children, relay_order
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


def depth(u: UpdateId, peers: list[str], fanout: int) -> dict[str, int]:
    """Hops at which each peer gets `u` when every peer offers to its children."""
    hops, frontier = {u.leader: 0}, [u.leader]
    while frontier:
        nxt = []
        for peer in frontier:
            for child in children(u, peers, peer, fanout):
                assert child not in hops, f"{child} offered twice"
                hops[child] = hops[peer] + 1
                nxt.append(child)
        frontier = nxt
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
