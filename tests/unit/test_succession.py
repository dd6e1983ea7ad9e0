"""Fast succession: the holder names its successor in every lease write; the successor takes over at
once when the holder's process is gone (connections refused), and readers accept that early claim only
from the named successor. A frozen holder (no refusal) is still waited out."""

from __future__ import annotations

import pytest

from p2p_diloco.config import SwarmTiming
from p2p_diloco.protocol import election as el
from p2p_diloco.protocol import lease_rules
from p2p_diloco.protocol.election import LeaseRecord, PeerHeartbeat, decide, rendezvous_rank
from p2p_diloco.protocol.lease_rules import SeenLease, screen_leases
from p2p_diloco.wire.records import RecordError, decode_lease, encode_lease

RUN = "run-1"
T = SwarmTiming()  # lease_ttl 6, lease_margin 0.5
PEERS = ("peer-a", "peer-b", "peer-c", "peer-d")


def hb(peer: str, versions=(3, 3)) -> PeerHeartbeat:
    return PeerHeartbeat(peer, True, True, tuple(versions), 1000.0)


def everyone() -> list[PeerHeartbeat]:
    return [hb(p) for p in PEERS]


def follower_decide(peer: str, lease: LeaseRecord, now: float, down=(), heartbeats=None):
    return decide(
        peer, RUN, heartbeats or everyone(), [lease], now, T, my_lease=None, rounds_done=0, down=down
    )


def test_the_named_successor_is_the_top_ranked_eligible_peer_other_than_the_holder():
    expected = rendezvous_rank(RUN, 3, ["peer-b", "peer-c", "peer-d"])[0]
    assert el.named_successor("peer-a", RUN, everyone(), 0.0, 3) == expected
    # a lagging peer is never named; nobody eligible names nobody
    lagging = [hb(p, (0, 0)) if p == expected else hb(p) for p in PEERS]
    assert el.named_successor("peer-a", RUN, lagging, 0.0, 3) not in ("", expected, "peer-a")
    assert el.named_successor("peer-a", RUN, [hb("peer-a")], 0.0, 3) == ""


def test_a_claim_names_the_next_successor():
    claim = decide("peer-a", RUN, [hb("peer-a"), hb("peer-b")], [], 100.0, T, my_lease=None, rounds_done=0)
    if claim.action != el.CLAIM:  # peer-b's window: claim from peer-b's side instead
        claim = decide(
            "peer-b", RUN, [hb("peer-a"), hb("peer-b")], [], 100.0, T, my_lease=None, rounds_done=0
        )
    assert claim.action == el.CLAIM
    lease = claim.lease_to_write()
    assert lease is not None and lease.successor == ({"peer-a", "peer-b"} - {lease.holder}).pop()


def test_the_successor_claims_at_once_when_the_holder_is_down():
    lease = LeaseRecord("peer-a", 4, expires_at=20.0, successor="peer-c")
    waiting = follower_decide("peer-c", lease, 15.0)
    assert (waiting.action, waiting.holder) == (el.FOLLOW, "peer-a")  # alive (or frozen): follow
    claim = follower_decide("peer-c", lease, 15.0, down={"peer-a"})
    assert (claim.action, claim.term, claim.holder) == (el.CLAIM, 5, "peer-c")
    assert claim.tag == el.ElectionTag.SUCCESSION
    assert claim.expires_at == 15.0 + T.lease_ttl
    # another follower, not named, keeps following the dead holder until the successor's claim shows up
    other = follower_decide("peer-b", lease, 15.0, down={"peer-a"})
    assert other.action == el.FOLLOW


def test_a_lagging_successor_does_not_claim_early():
    lease = LeaseRecord("peer-a", 4, expires_at=20.0, successor="peer-c")
    behind = [hb(p, (0, 0)) if p == "peer-c" else hb(p) for p in PEERS]
    d = follower_decide("peer-c", lease, 15.0, down={"peer-a"}, heartbeats=behind)
    assert d.action == el.FOLLOW


def seen(lease: LeaseRecord, first_seen: float) -> SeenLease:
    return SeenLease(lease, first_seen)


def screen(*items: SeenLease, term_floor: int = 4):
    return screen_leases(items, term_floor=term_floor, timing=T, may_synchronize=lambda p: True)


def test_readers_accept_an_early_claim_only_from_the_named_successor():
    old = LeaseRecord("peer-a", 4, expires_at=20.0, successor="peer-c")  # written at 14
    by_successor = LeaseRecord("peer-c", 5, expires_at=21.0)  # written at 15, 5 s before the lease lapses
    by_other = LeaseRecord("peer-b", 5, expires_at=21.0)
    ok = screen(seen(old, 14.2), seen(by_successor, 15.1))
    assert [x.lease for x in ok.valid] == [old, by_successor]
    refused = screen(seen(old, 14.2), seen(by_other, 15.1))
    assert [x.lease for x in refused.valid] == [old]
    assert [(lease.holder, tag) for lease, tag, _ in refused.refused] == [
        ("peer-b", lease_rules.LeaseTag.EARLY_CLAIM)
    ]


def test_the_holders_latest_renewal_decides_who_is_named():
    first = LeaseRecord("peer-a", 4, expires_at=17.0, successor="peer-c")
    renewal = LeaseRecord("peer-a", 4, expires_at=20.0, successor="peer-b")
    claim = LeaseRecord("peer-c", 5, expires_at=21.0)
    out = screen(seen(first, 11.1), seen(renewal, 14.1), seen(claim, 15.1))
    assert [lease.holder for lease, tag, _ in out.refused] == ["peer-c"]


def test_a_frozen_holder_waking_up_steps_down_for_its_successor():
    mine = LeaseRecord("peer-a", 4, expires_at=20.0, successor="peer-c")
    successor = LeaseRecord("peer-c", 5, expires_at=21.0)
    d = decide("peer-a", RUN, everyone(), [mine, successor], 16.0, T, my_lease=mine, rounds_done=3)
    assert (d.action, d.term, d.holder) == (el.STEP_DOWN, 5, "peer-c")
    assert (
        lease_rules.should_accept_update(4, 5).action == lease_rules.IGNORE
    )  # its late updates are fenced out


def test_lease_records_carry_the_successor_and_old_records_still_decode():
    lease = LeaseRecord("peer-a", 4, expires_at=20.0, rounds_done=2, successor="peer-c")
    assert decode_lease("peer-a", encode_lease(lease)) == lease
    old_format = b'{"term":4,"expires_at":20.0,"rounds_done":2,"released":false}'
    assert decode_lease("peer-a", old_format).successor == ""
    with pytest.raises(RecordError, match="successor"):
        decode_lease("peer-a", b'{"term":4,"expires_at":20.0,"rounds_done":2,"released":false,"successor":7}')
