"""Which lease records count (protocol/lease_rules.py): each rule refuses the forgery it is for, and the
honest sequences (claim, renewal, release, failover, a healed partition) pass."""

from __future__ import annotations

from p2p_diloco.protocol import lease_rules as rules
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.lease_rules import SeenLease, counts_as_held, screen_leases
from p2p_diloco.protocol.timing import SwarmTiming

T = SwarmTiming()  # lease_ttl 6, lease_margin 0.5
HONEST = {"a", "b", "c"}


def screen(seen, *, floor=0, reported=None):
    result = screen_leases(
        seen, term_floor=floor, timing=T, may_synchronize=HONEST.__contains__, terms_reported=reported
    )
    return [x.lease for x in result.valid], {
        (lease.holder, lease.term): tag for lease, tag, _ in result.refused
    }


def written(holder, term, at, *, seen=None, released=False):
    """A lease as `holder` writes it at `at`, first read at `seen` (default: at once)."""
    return SeenLease(
        LeaseRecord(holder, term, at + T.lease_ttl, released=released), at if seen is None else seen
    )


def test_honest_claim_renewal_and_failover_all_count():
    first = written("a", 1, 10.0)
    renewed = written("a", 1, 13.0)
    successor = written("b", 2, 13.0 + T.lease_ttl + T.lease_margin)  # after a's last lease lapsed
    valid, refused = screen([first, renewed, successor], floor=1)
    assert refused == {} and len(valid) == 3


def test_a_holder_that_may_not_synchronize_is_refused():
    valid, refused = screen([written("mallory", 1, 10.0)])
    assert valid == [] and refused == {("mallory", 1): rules.LeaseTag.NOT_SYNCHRONIZER}


def test_an_expiry_far_ahead_of_its_first_read_is_refused():
    hour = SeenLease(LeaseRecord("a", 2, expires_at=10.0 + 3600), 10.0)
    valid, refused = screen([written("b", 1, 9.0), hour], floor=1)
    assert refused == {("a", 2): rules.LeaseTag.TOO_LONG}
    assert [x.term for x in valid] == [1]


def test_terms_climb_one_at_a_time_from_the_trusted_floor():
    valid, refused = screen([written("b", 7, 30.0), written("a", 1007, 40.0)], floor=6)
    assert [x.term for x in valid] == [7] and refused == {("a", 1007): rules.LeaseTag.TERM_JUMP}


def test_a_newcomer_trusts_the_highest_live_term_in_view_then_no_jump():
    valid, _ = screen([written("a", 56, 0.0, seen=30.0), written("b", 57, 29.0, seen=30.0)])
    assert [x.term for x in valid] == [56, 57]


def test_a_claim_while_the_previous_term_is_held_is_refused():
    held = written("a", 3, 20.0)  # live until 26
    early = written("b", 4, 21.0)
    valid, refused = screen([held, early], floor=3)
    assert [x.term for x in valid] == [3] and refused == {("b", 4): rules.LeaseTag.EARLY_CLAIM}


def test_a_late_renewal_of_the_old_term_does_not_invalidate_its_successor():
    old = written("a", 3, 20.0)
    successor = written("b", 4, 27.0)
    zombie_renewal = written("a", 3, 28.0)  # seen after the successor's claim
    valid, refused = screen([old, successor, zombie_renewal], floor=3)
    assert refused == {} and {x.term for x in valid} == {3, 4}


def test_a_healed_partition_counts_when_other_peers_report_the_term():
    held = written("a", 3, 20.0)
    other_side = written("b", 4, 21.0)
    assert screen([held, other_side], floor=3, reported={"b": 4})[1] == {("b", 4): rules.LeaseTag.EARLY_CLAIM}
    valid, refused = screen([held, other_side], floor=3, reported={"b": 4, "c": 4})  # c: b's side
    assert refused == {} and {x.term for x in valid} == {3, 4}
    far = written("b", 9, 40.0)  # terms this peer missed
    assert screen([far], floor=3, reported={"b": 9})[1] == {
        ("b", 9): rules.LeaseTag.TERM_JUMP
    }  # only the holder
    assert screen([far], floor=3, reported={"b": 9, "c": 9})[1] == {}


def test_only_a_lease_live_when_first_read_vouches_for_updates():
    assert counts_as_held(written("a", 1, 10.0))
    already_expired = SeenLease(LeaseRecord("a", 1, expires_at=5.0), 10.0)
    assert not counts_as_held(already_expired)
    released = written("a", 1, 10.0, released=True)
    assert counts_as_held(released)


def test_an_early_claim_is_caught_after_the_holders_record_was_replaced_by_a_renewal():
    held = written("a", 3, 20.0)  # seen in an earlier read
    renewal = written("a", 3, 23.0)  # replaces it in the DHT, first seen after the claim below
    early = written("b", 4, 22.0, seen=22.5)
    renewal = SeenLease(renewal.lease, 23.5)
    result = screen_leases(
        [renewal, early], term_floor=3, timing=T, may_synchronize=HONEST.__contains__, history=[held]
    )
    assert [(lease.holder, tag) for lease, tag, _ in result.refused] == [("b", rules.LeaseTag.EARLY_CLAIM)]


def test_a_claim_right_after_a_release_is_not_early_whatever_the_renewals_before_it():
    renewal = written("a", 3, 20.0)  # live until 26
    released = written("a", 3, 22.0, released=True)  # the term ended at 22 (rotation)
    successor = written("b", 4, 22.5)
    result = screen_leases(
        [released, successor], term_floor=3, timing=T, may_synchronize=HONEST.__contains__, history=[renewal]
    )
    assert result.refused == [] and {x.lease.term for x in result.valid} == {3, 4}


def test_a_yielded_claims_release_ends_nothing_while_the_terms_holder_goes_on():
    """Issue #40: c yielded its claim of term 3 at 21 (released, no round merged) while a held term 3 until
    26; a claim of term 4 written at 22 is still early. Each holder's lease ends at its own release or
    expiry, and the term when the last of them does."""
    held = written("a", 3, 20.0)  # live until 26
    yielded = written("c", 3, 21.0, released=True)
    early = written("b", 4, 22.0, seen=22.5)
    result = screen_leases(
        [held, yielded, early], term_floor=3, timing=T, may_synchronize=HONEST.__contains__
    )
    assert [(lease.holder, tag) for lease, tag, _ in result.refused] == [("b", rules.LeaseTag.EARLY_CLAIM)]
