"""Partition reconciliation rule (protocol/reconcile.py) and the partitionable in-memory store."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.protocol import reconcile
from p2p_diloco.protocol.reconcile import (
    CATCH_UP,
    IN_SYNC,
    KEEP,
    RECONCILE,
    BranchTip,
    Outranked,
    ReconcileTag,
    classify,
    outranks,
    winning_tip,
)
from p2p_diloco.swarm.memory import InMemoryKeyValueStore, PartitionedKeyValueStore

A, B, C = "a" * 16, "b" * 16, "c" * 16


def test_more_updates_win_over_a_higher_term():
    # The real run kept its holder (term 1) and went on; an island elected three times and did less.
    real, island = BranchTip(1, 30, A), BranchTip(4, 20, B)
    assert winning_tip([real, island]) == real
    assert winning_tip([island, real]) == real
    assert outranks(real, island) == Outranked.MORE_UPDATES
    decision = classify(island, real)
    assert decision.action == RECONCILE and decision.tag == ReconcileTag.DIVERGED
    assert Outranked.MORE_UPDATES in decision.reason
    assert classify(real, island).action == KEEP


def test_ties_go_to_higher_term_then_checksum_whatever_the_order():
    tips = [BranchTip(3, 20, C), BranchTip(2, 21, C), BranchTip(3, 21, A), BranchTip(3, 21, B)]
    for rotation in range(len(tips)):
        assert winning_tip(tips[rotation:] + tips[:rotation]) == BranchTip(3, 21, B)
    assert outranks(BranchTip(3, 21, A), BranchTip(2, 21, C)) == Outranked.HIGHER_TERM
    assert outranks(BranchTip(3, 21, B), BranchTip(3, 21, A)) == Outranked.LARGER_CHECKSUM
    assert outranks(BranchTip(0, 21, A), BranchTip(3, 21, A)) == Outranked.SAME_STATE
    with pytest.raises(ValueError):
        outranks(BranchTip(9, 20, C), BranchTip(1, 21, A))


def test_an_island_with_more_versions_but_fewer_checked_updates_loses():
    """Only tips vouched for by checked records, or reported alike by two peers that may synchronize, take
    part (swarm/vouching.py): an island's higher version that nobody checked does not count, so the real
    run's tip wins even against an island tip with more versions and a higher term."""
    from p2p_diloco.swarm.vouching import Vouchers

    real, island = BranchTip(1, 30, A), BranchTip(5, 45, B)
    reported = {"real-1": real, "real-2": real, "island-1": island}
    trusted = Vouchers(1).trusted_tips(0, reported, may_witness=lambda peer: True)
    assert set(trusted) == {"real-1", "real-2"}
    assert winning_tip(trusted.values()) == real
    # ... whereas the same tips all counted would pick the island: the filter is what keeps the run.
    assert winning_tip(reported.values()) == island


def test_no_tips_is_an_error():
    with pytest.raises(ValueError):
        winning_tip([])


def test_tip_keeps_a_checksum_prefix_and_refuses_negative_numbers():
    assert BranchTip(1, 2, "ab" * 32).checksum == "ab" * 8
    with pytest.raises(ValueError):
        BranchTip(-1, 0, A)


def test_same_state_is_in_sync_whatever_the_recorded_term():
    # A term of 0 is "unknown" (e.g. restored from disk): the same version and checksum is the same state.
    decision = classify(BranchTip(0, 7, A), BranchTip(3, 7, A))
    assert decision.action == IN_SYNC and decision.tag == ReconcileTag.SAME_STATE


def test_the_winner_itself_keeps_its_branch():
    tip = BranchTip(2, 9, A)
    assert classify(tip, tip).action == IN_SYNC
    decision = classify(BranchTip(1, 12, A), BranchTip(2, 9, B))  # a winner that ranks below me
    assert decision.action == KEEP and decision.tag == ReconcileTag.WINNING


@pytest.mark.parametrize(
    "mine, winner",
    [
        (BranchTip(2, 5, A), BranchTip(2, 9, B)),  # same term, behind: most likely the same history
        (BranchTip(1, 5, A), BranchTip(2, 9, B)),  # lower term, behind: an ancestor if the fork is later
        (BranchTip(0, 0, A), BranchTip(4, 1, B)),  # the initial state is everyone's ancestor
    ],
)
def test_behind_with_no_higher_term_catches_up_by_verified_replay(mine, winner):
    decision = classify(mine, winner)
    assert decision.action == CATCH_UP and decision.tag == ReconcileTag.BEHIND


@pytest.mark.parametrize(
    "mine, winner",
    [
        (BranchTip(3, 20, A), BranchTip(1, 30, B)),  # an island of a higher term, fewer updates
        (BranchTip(1, 20, A), BranchTip(2, 20, B)),  # same version, other state
        (BranchTip(2, 20, A), BranchTip(2, 20, B)),  # two holders of one term (both sides lost the holder)
    ],
)
def test_not_an_ancestor_reconciles(mine, winner):
    decision = classify(mine, winner)
    assert decision.action == RECONCILE and decision.tag == ReconcileTag.DIVERGED
    assert str(mine) in decision.reason and str(winner) in decision.reason


def test_fork_proven_by_a_mismatching_replay_reconciles():
    decision = reconcile.fork_proven(BranchTip(1, 5, A), BranchTip(2, 9, B), update_term=2, from_version=5)
    assert decision.action == RECONCILE and decision.tag == ReconcileTag.FORK_PROVEN


def test_reconciled_line_names_both_tips():
    line = reconcile.reconciled_line(3, BranchTip(1, 30, A), BranchTip(2, 21, B), "peer-x", "diverged: ...")
    assert line.startswith(reconcile.LOG_RECONCILED + ": fragment 3")
    assert "t1 v30" in line and "t2 v21" in line and "peer-x" in line


# ---- the partitionable store -----------------------------------------------------------------------


def test_split_store_writes_reach_only_the_writers_side_and_heal_merges_by_later_expiration():
    store = PartitionedKeyValueStore()
    views = {p: store.view(p) for p in "wxyz"}
    views["w"].store("k", "lease", b"before", 10.0)
    assert all(v.get("k", 0.0)["lease"].value == b"before" for v in views.values())
    store.split([{"w", "x"}, {"y", "z"}])
    assert not store.reachable("w", "y") and store.reachable("y", "z")
    views["w"].store("k", "lease", b"left", 20.0)
    views["y"].store("k", "lease", b"right", 30.0)
    views["y"].store("k", "only-right", b"r", 30.0)
    assert views["x"].get("k", 0.0)["lease"].value == b"left"
    assert views["z"].get("k", 0.0)["lease"].value == b"right"
    assert "only-right" not in views["x"].get("k", 0.0)
    store.heal()
    for v in views.values():
        got = v.get("k", 0.0)
        assert got["lease"].value == b"right" and got["only-right"].value == b"r"
    views["x"].store("k", "lease", b"after", 40.0)
    assert views["z"].get("k", 0.0)["lease"].value == b"after"


def test_split_store_refuses_overlapping_groups_and_newcomers_see_their_side():
    store = PartitionedKeyValueStore()
    store.view("w").store("k", "s", b"v", 5.0)
    store.view("u")  # joins after the write: starts from a merge of the replicas it can reach
    with pytest.raises(ValueError):
        store.split([{"w", "x"}, {"x", "y"}])
    store.split([{"w"}, {"n"}])
    assert store.view("n").get("k", 0.0) == {}  # "n" joined on the other side of the cut
    # "late" is in no group: it shares a side with the other ungrouped peer "u", not with "w".
    assert store.view("late").get("k", 0.0)["s"].value == b"v"
    store.view("w").store("k", "s", b"w only", 6.0)
    assert store.view("late").get("k", 0.0)["s"].value == b"v"
    assert isinstance(InMemoryKeyValueStore().get("k", 0.0), dict)


_TIPS = st.builds(
    BranchTip,
    term=st.integers(0, 3),
    version=st.integers(0, 3),
    checksum=st.sampled_from(["aa", "bb", "cc"]),
)


@settings(max_examples=300, deadline=None)
@given(mine=_TIPS, tips=st.lists(_TIPS, max_size=5), subset=st.lists(st.booleans(), min_size=5, max_size=5))
def test_outranked_by_none_means_in_sync_or_keep_against_every_subset(mine, tips, subset):
    """The fast path of a read (anti-entropy, `trusted_ahead`) skips a fragment on this answer alone: it
    must be what the full rules say of whichever tips the trust screens keep."""
    kept = [tip for tip, keep in zip(tips, subset, strict=False) if keep]
    action = classify(mine, winning_tip([mine, *kept])).action
    if reconcile.outranked_by_none(mine, tips):
        assert action in (reconcile.IN_SYNC, reconcile.KEEP)
        assert all(not (tip.same_state(mine) and tip.term > mine.term) for tip in kept)
    elif kept == tips:  # a tip outranks mine, and every tip counts: never kept as it is
        winner = winning_tip([mine, *tips])
        assert action != reconcile.KEEP
        assert action != reconcile.IN_SYNC or (winner.same_state(mine) and winner.term > mine.term)


@settings(max_examples=300, deadline=None)
@given(mine=_TIPS, winner=_TIPS)
def test_action_of_is_the_action_classify_decides(mine, winner):
    assert reconcile.action_of(mine, winner) == classify(mine, winner).action
