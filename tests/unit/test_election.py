"""Synchronizer election over DHT records: every action and tag of `decide`, ranking, ties and fencing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.config import SwarmTiming
from p2p_diloco.protocol import election as el
from p2p_diloco.protocol.election import (
    LeaseRecord,
    PeerHeartbeat,
    current_holder,
    decide,
    eligible_candidates,
    highest_term,
    rendezvous_rank,
)
from p2p_diloco.protocol.lease_rules import ACCEPT, IGNORE, FencingTag, should_accept_update

RUN = "run-1"
T = SwarmTiming()  # lease_ttl 6, renew at 50%, claim_grace 2, lease_margin 0.5, term_rounds 50
PEERS = ("peer-a", "peer-b", "peer-c")


def hb(peer: str, *, versions=(3, 3), expires_at=1000.0, may_sync=True, reachable=True, term_seen=0):
    return PeerHeartbeat(peer, may_sync, reachable, tuple(versions), expires_at, term_seen)


def everyone(*extra: PeerHeartbeat) -> list[PeerHeartbeat]:
    replaced = {h.peer_id for h in extra}
    return [hb(p) for p in PEERS if p not in replaced] + list(extra)


def run_decide(peer, heartbeats, leases, now, *, my_lease=None, rounds_done=0, timing=T, **kw):
    return decide(
        peer, RUN, heartbeats, leases, now, timing, my_lease=my_lease, rounds_done=rounds_done, **kw
    )


# --- ranking, holders, eligibility -------------------------------------------------------------------


def test_rendezvous_rank_is_deterministic_and_order_free():
    ranked = rendezvous_rank(RUN, 4, PEERS)
    assert ranked == rendezvous_rank(RUN, 4, reversed(PEERS)) == rendezvous_rank(RUN, 4, PEERS + PEERS)
    assert sorted(ranked) == sorted(PEERS)
    # the top candidate changes with the term (rotation spreads the role) and with the run
    assert len({rendezvous_rank(RUN, t, PEERS)[0] for t in range(1, 30)}) == 3
    assert any(rendezvous_rank("other", t, PEERS) != rendezvous_rank(RUN, t, PEERS) for t in range(1, 10))


def test_current_holder_takes_highest_live_term_and_ignores_expired_or_released():
    leases = [
        LeaseRecord("peer-a", 2, expires_at=50.0),
        LeaseRecord("peer-b", 5, expires_at=9.0),  # expired
        LeaseRecord("peer-c", 6, expires_at=50.0, released=True),
    ]
    assert current_holder(leases, 10.0) == leases[0]
    assert current_holder(leases, 50.0) is None
    assert highest_term(leases) == 6
    assert highest_term([]) == 0


def test_tie_between_two_live_leases_of_one_term_is_resolved_identically_by_everyone():
    a, b = LeaseRecord("peer-a", 3, 20.0), LeaseRecord("peer-b", 3, 21.0)
    winner = current_holder([a, b], 10.0)
    assert winner == current_holder([b, a], 10.0)
    assert (
        winner is not None and winner.holder == rendezvous_rank(el.LEASE_TIE_SALT, 3, ["peer-a", "peer-b"])[0]
    )
    loser = a if winner is b else b
    views = {
        p: run_decide(p, everyone(), [a, b], 10.0, my_lease={a.holder: a, b.holder: b}.get(p)) for p in PEERS
    }
    assert views[loser.holder].action == el.STEP_DOWN and views[loser.holder].tag == el.ElectionTag.LOST_TIE
    assert views[winner.holder].action == el.HOLD
    assert views["peer-c"].action == el.FOLLOW and views["peer-c"].holder == winner.holder


def test_eligible_candidates_filters_may_sync_reachability_lag_and_liveness():
    beats = [
        hb("ok", versions=(4, 4)),
        hb("no-sync", may_sync=False, versions=(4, 4)),
        hb("unreachable", reachable=False, versions=(4, 4)),
        hb("lagging", versions=(4, 3)),
        hb("dead", versions=(4, 4), expires_at=5.0),
        hb("observer", may_sync=False, versions=(5, 4)),  # newest state sets the bar even if it cannot sync
    ]
    assert [h.peer_id for h in eligible_candidates(beats, 10.0)] == []
    assert [h.peer_id for h in eligible_candidates(beats, 10.0, max_lag=1)] == ["ok"]
    assert [h.peer_id for h in eligible_candidates(beats, 10.0, max_lag=2)] == ["lagging", "ok"]
    assert [h.peer_id for h in eligible_candidates(beats[:5], 10.0)] == ["ok"]


# --- the holder's side -------------------------------------------------------------------------------


def test_follow_when_another_peer_holds_a_live_lease():
    lease = LeaseRecord("peer-b", 2, expires_at=20.0)
    d = run_decide("peer-a", everyone(), [lease], 15.0)
    assert (d.action, d.tag, d.holder, d.term, d.expires_at) == (
        el.FOLLOW,
        el.ElectionTag.HELD_BY,
        "peer-b",
        2,
        20.0,
    )
    assert d.lease_to_write() is None


def test_hold_then_renew_once_the_renew_fraction_has_elapsed():
    mine = LeaseRecord("peer-a", 2, expires_at=16.0)  # written at 10
    hold = run_decide("peer-a", everyone(), [mine], 12.9, my_lease=mine, rounds_done=3)
    assert (hold.action, hold.tag, hold.term) == (el.HOLD, el.ElectionTag.HOLDING, 2)
    renew = run_decide("peer-a", everyone(), [mine], 13.0, my_lease=mine, rounds_done=3)
    assert (renew.action, renew.tag, renew.term, renew.expires_at) == (
        el.RENEW,
        el.ElectionTag.RENEW,
        2,
        19.0,
    )
    # every renewal names the successor: the eligible peer other than the holder ranked first for term 3
    successor = rendezvous_rank(RUN, 3, ["peer-b", "peer-c"])[0]
    assert renew.lease_to_write() == LeaseRecord("peer-a", 2, 19.0, rounds_done=3, successor=successor)


def test_step_down_when_a_higher_term_is_live_or_was_seen():
    mine = LeaseRecord("peer-a", 2, expires_at=16.0)
    other = LeaseRecord("peer-b", 3, expires_at=18.0)
    d = run_decide("peer-a", everyone(), [mine, other], 12.0, my_lease=mine)
    assert (d.action, d.tag, d.term, d.holder) == (el.STEP_DOWN, el.ElectionTag.HIGHER_TERM, 3, "peer-b")
    # the term-3 record is gone from the DHT, but this peer remembers it (its term floor)
    d = run_decide("peer-a", everyone(), [mine], 12.0, my_lease=mine, term_floor=3)
    assert (d.action, d.tag, d.term) == (el.STEP_DOWN, el.ElectionTag.HIGHER_TERM, 3)
    # a heartbeat's term_seen is a self-report: it never raises the term
    d = run_decide("peer-a", everyone(hb("peer-c", term_seen=1001)), [mine], 12.0, my_lease=mine)
    assert (d.action, d.term) == (el.HOLD, 2)


def test_step_down_instead_of_renewing_too_close_to_expiry():
    mine = LeaseRecord("peer-a", 2, expires_at=16.0)
    assert run_decide("peer-a", everyone(), [mine], 15.49, my_lease=mine).action == el.RENEW
    for now in (15.5, 16.0, 30.0):  # fencing: stop merging lease_margin before anyone may claim
        d = run_decide("peer-a", everyone(), [mine], now, my_lease=mine)
        assert (d.action, d.tag) == (el.STEP_DOWN, el.ElectionTag.LEASE_EXPIRED), now


def test_holder_fences_on_the_older_expiry_others_still_see():
    written = LeaseRecord("peer-a", 2, expires_at=19.0)  # my renewal at 13 ...
    visible = LeaseRecord("peer-a", 2, expires_at=16.0)  # ... has not reached the replicas I read
    d = run_decide("peer-a", everyone(), [visible], 15.6, my_lease=written)
    assert (d.action, d.tag, d.expires_at) == (el.STEP_DOWN, el.ElectionTag.LEASE_EXPIRED, 16.0)
    assert run_decide("peer-a", everyone(), [written], 15.6, my_lease=written).action == el.HOLD


def test_term_ended_then_release_rotates_to_the_next_candidate_without_margin():
    mine = LeaseRecord("peer-a", 2, expires_at=16.0)
    d = run_decide("peer-a", everyone(), [mine], 12.0, my_lease=mine, rounds_done=T.term_rounds)
    assert (d.action, d.tag, d.term) == (el.STEP_DOWN, el.ElectionTag.TERM_ENDED, 2)
    released = el.release_lease(mine, 12.5, T, rounds_done=T.term_rounds)
    assert (
        released.released
        and released.expires_at == 18.5
        and el.dht_expiration(released, T) > 16.0 + T.lease_ttl
    )
    others = rendezvous_rank(RUN, 3, ["peer-b", "peer-c"])
    views = {
        p: run_decide(p, everyone(), [released], 12.5, my_lease=released if p == "peer-a" else None)
        for p in PEERS
    }
    assert (views[others[0]].action, views[others[0]].term) == (el.CLAIM, 3)  # immediately, no lease_margin
    assert views[others[1]].tag == el.ElectionTag.CLAIM_GRACE and views[others[1]].holder == others[0]
    assert views["peer-a"].tag == el.ElectionTag.NOT_ELIGIBLE and "previous holder" in views["peer-a"].reason
    # if nobody else is eligible, the previous holder takes the next term itself
    alone = [hb("peer-a"), hb("peer-b", may_sync=False), hb("peer-c", reachable=False)]
    assert run_decide("peer-a", alone, [released], 12.5).action == el.CLAIM


def test_an_unconfirmed_claim_merges_only_once_a_read_shows_it_alone():
    """Issue #40: a claim holds unconfirmed (merging nothing) until a read shows it; a read that shows it and
    no other claim of its term confirms it; a renewal due on that read carries the confirmation along."""
    mine = LeaseRecord("peer-a", 4, expires_at=16.0)  # written at 10
    unconfirmed = dict(my_lease=mine, confirmed=False)
    waiting = run_decide("peer-a", everyone(), [], 10.5, **unconfirmed)  # my write has not landed yet
    assert (waiting.action, waiting.tag) == (el.HOLD, el.ElectionTag.UNCONFIRMED)
    confirmed = run_decide("peer-a", everyone(), [mine], 11.0, **unconfirmed)
    assert (confirmed.action, confirmed.tag, confirmed.term) == (el.HOLD, el.ElectionTag.CONFIRMED, 4)
    late = run_decide("peer-a", everyone(), [mine], 13.0, **unconfirmed)  # half the TTL went by meanwhile
    assert (late.action, late.tag, late.expires_at) == (el.RENEW, el.ElectionTag.CONFIRMED, 19.0)
    renew = run_decide("peer-a", everyone(), [], 13.0, **unconfirmed)  # still not read back: renew anyway
    assert (renew.action, renew.tag) == (el.RENEW, el.ElectionTag.RENEW)
    expired = run_decide("peer-a", everyone(), [], 15.6, **unconfirmed)
    assert (expired.action, expired.tag) == (el.STEP_DOWN, el.ElectionTag.LEASE_EXPIRED)


def test_a_claimant_that_sees_another_claim_of_its_term_yields_whoever_wins_the_tie():
    """Two claims of one term: the claimant whose read shows the other yields (and the other, confirmed
    before that claim was readable, holds on); a claim released with no round merged is no rival, one
    released after merging is (that term published)."""
    a, b = LeaseRecord("peer-a", 4, expires_at=16.0), LeaseRecord("peer-b", 4, expires_at=17.0)
    for mine, other in ((a, b), (b, a)):
        d = run_decide(mine.holder, everyone(), [a, b], 11.5, my_lease=mine, confirmed=False)
        assert (d.action, d.tag, d.term) == (el.STEP_DOWN, el.ElectionTag.YIELDED, 4)
        assert other.holder in d.detail
    yielded = LeaseRecord("peer-b", 4, expires_at=17.5, released=True)
    d = run_decide("peer-a", everyone(), [a, yielded], 11.5, my_lease=a, confirmed=False)
    assert d.tag == el.ElectionTag.CONFIRMED
    ended = LeaseRecord("peer-b", 4, expires_at=17.5, rounds_done=3, released=True)
    d = run_decide("peer-a", everyone(), [a, ended], 11.5, my_lease=a, confirmed=False)
    assert d.tag == el.ElectionTag.YIELDED
    # a higher term outranks an unconfirmed claim as it does a confirmed one
    d = run_decide(
        "peer-a", everyone(), [a, LeaseRecord("peer-c", 5, 17.0)], 11.5, my_lease=a, confirmed=False
    )
    assert (d.action, d.tag) == (el.STEP_DOWN, el.ElectionTag.HIGHER_TERM)


def test_my_lease_must_be_mine():
    with pytest.raises(ValueError, match="held by"):
        run_decide("peer-a", everyone(), [], 1.0, my_lease=LeaseRecord("peer-b", 1, 5.0))


# --- claiming ----------------------------------------------------------------------------------------

OLD = LeaseRecord("peer-x", 3, expires_at=10.0)  # a crashed holder: claims open at 10.5


def decisions(now, leases=(OLD,), beats=None):
    beats = everyone() if beats is None else beats
    return {p: run_decide(p, beats, list(leases), now) for p in PEERS}


def test_lease_grace_until_expiry_plus_margin():
    for now in (10.0, 10.49):
        for d in decisions(now).values():
            assert (d.action, d.tag, d.term, d.holder) == (el.WAIT, el.ElectionTag.LEASE_GRACE, 3, "peer-x")


def test_top_candidate_claims_first_and_the_others_wait_their_turn_in_order():
    ranked = rendezvous_rank(RUN, 4, PEERS)
    for slot, now in enumerate((10.5, 12.5, 14.5, 16.5)):  # the second claims only if the first never did
        ds = decisions(now)
        claimer = ranked[slot % 3]
        assert (ds[claimer].action, ds[claimer].tag, ds[claimer].term) == (el.CLAIM, el.ElectionTag.CLAIM, 4)
        successor = rendezvous_rank(RUN, 5, set(PEERS) - {claimer})[0]
        assert ds[claimer].lease_to_write() == LeaseRecord(claimer, 4, now + T.lease_ttl, successor=successor)
        for p in set(PEERS) - {claimer}:
            assert (ds[p].action, ds[p].tag, ds[p].holder) == (el.WAIT, el.ElectionTag.CLAIM_GRACE, claimer)
    second = decisions(12.49)[ranked[1]]
    assert second.tag == el.ElectionTag.CLAIM_GRACE and "12.50" in second.reason


def test_once_a_claim_is_visible_everyone_follows_it():
    ranked = rendezvous_rank(RUN, 4, PEERS)
    claimed = LeaseRecord(ranked[0], 4, expires_at=16.5)
    ds = {
        p: run_decide(p, everyone(), [OLD, claimed], 11.0, my_lease=claimed if p == ranked[0] else None)
        for p in PEERS
    }
    assert ds[ranked[0]].action == el.HOLD
    assert all(ds[p].action == el.FOLLOW and ds[p].holder == ranked[0] for p in ranked[1:])


@pytest.mark.parametrize(
    ("beat", "why"),
    [
        (hb("peer-a", may_sync=False), "may_sync"),
        (hb("peer-a", reachable=False), "reachable"),
        (hb("peer-a", versions=(3, 2)), "lags"),
        (hb("peer-a", expires_at=5.0), "no live heartbeat"),
    ],
)
def test_not_eligible_peers_never_claim(beat, why):
    for now in (10.5, 12.5, 14.5, 16.5, 18.5):
        d = run_decide("peer-a", everyone(beat), [OLD], now)
        assert (d.action, d.tag, d.term) == (el.WAIT, el.ElectionTag.NOT_ELIGIBLE, 4)
        assert why in d.reason and d.holder in ("peer-b", "peer-c")


def test_no_candidates():
    beats = [hb(p, may_sync=False) for p in PEERS]
    for d in decisions(11.0, beats=beats).values():
        assert (d.action, d.tag) == (el.WAIT, el.ElectionTag.NO_CANDIDATES)


def test_fresh_run_without_any_lease_elects_exactly_one():
    for now in (0.0, 1.0, 3.0, 777.7):
        ds = decisions(now, leases=())
        claims = [p for p, d in ds.items() if d.action == el.CLAIM]
        assert len(claims) == 1 and all(d.term == 1 and d.holder == claims[0] for d in ds.values())


def test_restarted_holder_does_not_resume_its_old_lease():
    lease = LeaseRecord("peer-a", 2, expires_at=20.0)
    d = run_decide("peer-a", everyone(), [lease], 15.0, my_lease=None)
    assert (d.action, d.tag, d.holder) == (el.WAIT, el.ElectionTag.LEASE_GRACE, "peer-a")


def test_stale_lower_term_lease_is_not_followed():
    stale = LeaseRecord("peer-b", 2, expires_at=50.0)  # should have stepped down: term 3 was seen
    ds = decisions(20.0, leases=[stale, LeaseRecord("peer-c", 3, expires_at=10.0)])
    assert all(d.action in (el.CLAIM, el.WAIT) and d.term == 4 for d in ds.values())
    assert sum(d.action == el.CLAIM for d in ds.values()) == 1


def test_peers_reading_the_same_records_agree():
    scenarios = [
        (9.0, [OLD]),
        (10.2, [OLD]),
        (11.0, [OLD]),
        (13.0, [OLD]),
        (11.0, [OLD, LeaseRecord("peer-b", 4, 17.0), LeaseRecord("peer-c", 4, 17.2)]),
    ]
    for now, leases in scenarios:
        ds = decisions(now, leases=leases)
        assert len({(d.term, d.holder) for d in ds.values()}) == 1, (now, ds)


# --- fencing and a small failover walk-through -------------------------------------------------------


def test_fencing_ignores_updates_from_a_lower_term():
    d = should_accept_update(2, 3)
    assert (d.action, d.tag) == (IGNORE, FencingTag.LOWER_TERM)
    assert should_accept_update(3, 3).action == ACCEPT
    assert (should_accept_update(4, 3).action, (should_accept_update(4, 3)).tag) == (
        ACCEPT,
        FencingTag.NEWER_TERM,
    )


def test_failover_walk_through_never_has_two_merging_holders():
    """Peers decide every 0.25 s on a shared store; the holder crashes at t=20. Nobody claims before its
    lease + margin, and no two peers ever consider themselves holders at once."""
    store: dict[str, LeaseRecord] = {}
    mine: dict[str, LeaseRecord | None] = dict.fromkeys(PEERS)
    alive = set(PEERS)
    holders_seen: list[tuple[float, str]] = []
    for tick in range(0, 200):
        now = tick * 0.25
        if now == 20.0:
            crashed = next(p for p in PEERS if mine[p] is not None)
            alive.discard(crashed)
        beats = [hb(p, expires_at=now + T.heartbeat_ttl) for p in sorted(alive)]
        holding = []
        for p in sorted(alive):
            d = run_decide(p, beats, list(store.values()), now, my_lease=mine[p])
            record = d.lease_to_write()
            if record is not None:
                store[p] = mine[p] = record
            elif d.action == el.STEP_DOWN:
                mine[p] = None
            if d.action in (el.HOLD, el.RENEW, el.CLAIM):
                holding.append(p)
        assert len(holding) <= 1, (now, holding)
        holders_seen += [(now, p) for p in holding]
    first = holders_seen[0][1]
    takeover = next(t for t, p in holders_seen if p != first)
    crashed_expiry = store[first].expires_at  # the last lease the crashed holder wrote
    assert crashed_expiry + T.lease_margin <= takeover <= crashed_expiry + T.lease_margin + T.claim_grace
    assert max(t for t, p in holders_seen if p == first) < 20.0


# --- property: at most one claimer -------------------------------------------------------------------

beat_strategy = st.builds(
    PeerHeartbeat,
    peer_id=st.sampled_from(["p0", "p1", "p2", "p3", "p4", "p5"]),
    may_sync=st.sampled_from([True, True, True, False]),
    reachable=st.sampled_from([True, True, True, False]),
    versions=st.tuples(st.integers(2, 3), st.just(3)),
    expires_at=st.floats(0, 80),
    term_seen=st.integers(0, 4),
)
lease_strategy = st.builds(
    LeaseRecord,
    holder=st.sampled_from(["p0", "p1", "p2", "p3", "p4", "p5"]),
    term=st.integers(0, 4),
    expires_at=st.floats(0, 40),
    rounds_done=st.just(0),
    released=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    beats=st.lists(beat_strategy, max_size=8),
    leases=st.lists(lease_strategy, max_size=3),
    now=st.floats(0, 40),
)
def test_at_most_one_peer_claims_at_any_moment(beats, leases, now):
    peers = sorted({b.peer_id for b in beats} | {"p0"})
    ds = {p: decide(p, RUN, beats, leases, now, T, my_lease=None, rounds_done=0) for p in peers}
    claims = [p for p, d in ds.items() if d.action == el.CLAIM]
    assert len(claims) <= 1
    assert len({(d.term, d.holder) for d in ds.values()}) <= 1
    if any(d.tag == el.ElectionTag.CLAIM_GRACE for d in ds.values()):  # someone's window is open: they claim
        assert len(claims) == 1


# --- a peer that is no candidate only follows (`follow_only`, issue #40) --------------------------------

_lease = st.builds(
    LeaseRecord,
    holder=st.sampled_from(PEERS),
    term=st.integers(1, 4),
    expires_at=st.floats(90.0, 110.0),
    released=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    leases=st.lists(_lease, max_size=5),
    now=st.floats(95.0, 115.0),
    term_floor=st.integers(0, 5),
    candidates=st.lists(st.sampled_from(PEERS), unique=True),
)
def test_follow_only_decides_as_decide_does_for_a_peer_no_heartbeat_shows_eligible(
    leases, now, term_floor, candidates
):
    """What a non-candidate's full election would decide, without ranking anyone: the same action, tag,
    term and holder whenever it follows or waits out a lease grace; otherwise a wait for some candidate."""
    me = "peer-z"  # no candidate: its heartbeat cannot make it eligible
    heartbeats = [*(hb(p) for p in candidates), hb(me, may_sync=False)]
    full = run_decide(me, heartbeats, leases, now, term_floor=term_floor, down=set(PEERS))
    quick = el.follow_only(me, leases, now, T, term_floor=term_floor)
    assert quick.action == full.action
    if full.tag in (el.ElectionTag.HELD_BY, el.ElectionTag.LEASE_GRACE):
        assert quick == full
    else:
        assert full.tag in (el.ElectionTag.NOT_ELIGIBLE, el.ElectionTag.NO_CANDIDATES)
        assert (quick.tag, quick.term, quick.holder) == (el.ElectionTag.NOT_ELIGIBLE, full.term, None)


def test_follow_only_never_claims_even_when_named_successor_of_a_holder_seen_down():
    lease = LeaseRecord("peer-a", 3, expires_at=120.0, successor="peer-z")
    full = run_decide("peer-z", everyone(hb("peer-z")), [lease], 100.0, down={"peer-a"})
    assert full.tag == el.ElectionTag.SUCCESSION  # a candidate named successor takes over at once
    quick = el.follow_only("peer-z", [lease], 100.0, T)
    assert (quick.action, quick.tag, quick.holder) == (el.FOLLOW, el.ElectionTag.HELD_BY, "peer-a")


def test_follow_only_lets_its_own_lease_from_before_a_restart_lapse():
    lease = LeaseRecord("peer-z", 2, expires_at=104.0)
    quick = el.follow_only("peer-z", [lease], 100.0, T)
    assert (quick.action, quick.tag, quick.holder) == (el.WAIT, el.ElectionTag.LEASE_GRACE, "peer-z")
