"""Synchronizer rounds and timing: anchors, counters, quorum, the grace window and its averages."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.protocol.sync_round import (
    ACCEPT,
    CLOSE,
    REJECT,
    WAIT,
    Contribution,
    FragmentRound,
    RoundTag,
    SynchronizerRounds,
)
from p2p_diloco.protocol.timing import Ema, RoundTimings, grace_window

LIVE3 = frozenset({"a", "b", "c"})


def contrib(sender="a", anchor=5, tokens=100, steps=10, at=0.0, payload=None) -> Contribution:
    return Contribution(sender, anchor, tokens, steps, at, payload)


def new_round(version=5, k=2, staleness=2, opened_at=0.0) -> FragmentRound:
    return FragmentRound(0, version, min_quorum=k, max_staleness=staleness, opened_at=opened_at)


# --- contributions and offers -------------------------------------------------------------------


def test_weight_is_tokens_times_tokens_per_step():
    assert contrib(tokens=100, steps=10).weight == 1000.0
    assert contrib(tokens=0, steps=10).weight == 0.0


def test_accepted_then_replaced_keeps_the_latest_per_learner():
    r = new_round()
    first = r.offer(contrib("a", payload="old", at=1.0), now=1.0)
    assert (first.action, first.tag) == (ACCEPT, RoundTag.ACCEPTED)
    second = r.offer(contrib("a", payload="new", anchor=4, at=2.0), now=2.0)
    assert (second.action, second.tag) == (ACCEPT, RoundTag.REPLACED)
    assert len(r) == 1
    assert [c.payload for c in r.contributions()] == ["new"]
    assert r.quorum_at is None  # one learner, K = 2


def test_stale_anchor_is_rejected_with_the_numbers():
    r = new_round(version=5, staleness=2)
    assert r.offer(contrib(anchor=3), 0.0).action == ACCEPT  # 2 behind: still usable
    d = r.offer(contrib("b", anchor=2), 0.0)
    assert (d.action, d.tag) == (REJECT, RoundTag.STALE_ANCHOR)
    assert "anchor v2 is 3 versions behind" in d.reason and "max_staleness 2" in d.reason
    assert r.reporters == {"a"}
    assert r.rejected == 1


def test_future_anchor_is_rejected():
    d = new_round(version=5).offer(contrib(anchor=6), 0.0)
    assert (d.action, d.tag) == (REJECT, RoundTag.FUTURE_ANCHOR)


@pytest.mark.parametrize(("tokens", "steps", "anchor"), [(0, 10, 5), (100, 0, 5), (-3, 1, 5), (10, 1, -1)])
def test_bad_counters_are_rejected(tokens, steps, anchor):
    r = new_round()
    d = r.offer(contrib(tokens=tokens, steps=steps, anchor=anchor), 0.0)
    assert (d.action, d.tag) == (REJECT, RoundTag.BAD_COUNTERS)
    assert len(r) == 0


def test_contributions_are_ordered_by_sender():
    r = new_round(k=1)
    for sender in ["c", "a", "b"]:
        r.offer(contrib(sender), 0.0)
    assert [c.sender for c in r.contributions()] == ["a", "b", "c"]


def test_a_closed_round_refuses_offers():
    r = new_round(k=1)
    r.offer(contrib("a"), 0.0)
    assert [c.sender for c in r.close(1.0)] == ["a"]
    assert (r.offer(contrib("b"), 1.5)).tag == RoundTag.ROUND_CLOSED


# --- poll: quorum and grace ---------------------------------------------------------------------


def test_quorum_not_met_waits_and_counts():
    r = new_round(k=2)
    r.offer(contrib("a"), 0.0)
    d = r.poll(100.0, LIVE3, grace=1.0, cap=5.0)
    assert (d.action, d.tag) == (WAIT, RoundTag.QUORUM_NOT_MET)
    assert "1/2" in d.reason


def test_grace_clock_starts_at_quorum_and_runs():
    r = new_round(k=2, opened_at=0.0)
    r.offer(contrib("a"), 1.0)
    r.offer(contrib("b"), 3.0)
    assert r.quorum_at == 3.0
    d = r.poll(3.5, LIVE3, grace=2.0, cap=10.0)
    assert (d.action, d.tag) == (WAIT, RoundTag.GRACE_RUNNING)
    assert "1.500s left" in d.reason and "1 live learners missing" in d.reason
    r.offer(contrib("a", anchor=4), 4.0)  # a replacement does not move the clock
    assert r.quorum_at == 3.0


def test_grace_ended():
    r = new_round(k=2)
    r.offer(contrib("a"), 0.0)
    r.offer(contrib("b"), 1.0)
    d = r.poll(3.0, LIVE3, grace=2.0, cap=10.0)
    assert (d.action, d.tag) == (CLOSE, RoundTag.GRACE_ENDED)
    assert r.poll(2.999, LIVE3, grace=2.0, cap=10.0).action == WAIT


def test_grace_ended_early_when_every_live_learner_reported():
    r = new_round(k=2)
    for sender in ["a", "b", "c"]:
        r.offer(contrib(sender), 1.0)
    d = r.poll(1.1, LIVE3, grace=2.0, cap=10.0)
    assert (d.action, d.tag) == (CLOSE, RoundTag.GRACE_ENDED_EARLY)
    assert "all 3 live learners" in d.reason


def test_reports_from_dead_learners_do_not_end_grace_early():
    r = new_round(k=1)
    r.offer(contrib("a"), 0.0)
    r.offer(contrib("x"), 0.0)  # reported, then left the swarm
    assert (r.poll(0.5, frozenset({"a", "b"}), grace=2.0, cap=10.0)).tag == RoundTag.GRACE_RUNNING
    assert (r.poll(0.5, frozenset({"a"}), grace=2.0, cap=10.0)).tag == RoundTag.GRACE_ENDED_EARLY


def test_an_unknown_live_set_never_ends_grace_early():
    r = new_round(k=1)
    r.offer(contrib("a"), 0.0)
    assert (r.poll(0.5, frozenset(), grace=2.0, cap=10.0)).tag == RoundTag.GRACE_RUNNING


def test_grace_capped():
    r = new_round(k=1)
    r.offer(contrib("a"), 0.0)
    assert (r.poll(0.9, LIVE3, grace=5.0, cap=1.0)).tag == RoundTag.GRACE_RUNNING
    d = r.poll(1.0, LIVE3, grace=5.0, cap=1.0)
    assert (d.action, d.tag) == (CLOSE, RoundTag.GRACE_CAPPED)
    assert "5.000s cut to the cap of 1.000s" in d.reason


def test_zero_grace_closes_at_quorum():
    r = new_round(k=1)
    r.offer(contrib("a"), 2.0)
    assert (r.poll(2.0, LIVE3, grace=0.0, cap=1.0)).tag == RoundTag.GRACE_ENDED


def test_rebase_drops_contributions_that_became_stale():
    r = new_round(version=5, k=2, staleness=1)
    r.offer(contrib("a", anchor=4), 0.0)
    r.offer(contrib("b", anchor=5), 0.0)
    assert r.quorum_at == 0.0
    dropped = r.rebase(6, now=1.0)
    assert [d.tag for d in dropped] == [RoundTag.STALE_ANCHOR]
    assert r.reporters == {"b"}
    assert r.quorum_at is None and r.version == 6


# --- timing ---------------------------------------------------------------------------------------


def test_ema_first_sample_sets_then_averages():
    ema = Ema(0.5)
    assert ema.value is None
    assert ema.update(4.0) == 4.0
    assert ema.update(2.0) == 3.0
    assert ema.update(math.nan) == 3.0  # ignored
    assert ema.samples == 2
    assert Ema(0.5, initial=10.0).update(0.0) == 5.0
    with pytest.raises(ConfigError):
        Ema(0.0)


def test_grace_window_formula():
    assert grace_window(0.5, 2, t_step=1.0, t_quorum=0.2, t_sync=0.3, cap=10.0) == pytest.approx(0.75)
    assert grace_window(0.5, 2, t_step=1.0, t_quorum=2.0, t_sync=1.0, cap=10.0) == 0.0
    assert grace_window(0.5, 2, t_step=10.0, t_quorum=0.0, t_sync=0.0, cap=3.0) == 3.0


def test_round_timings_count_unknowns_as_zero():
    timings = RoundTimings()
    assert timings.grace(0.5, 2, cap=100.0) == 0.0
    timings.step_time.update(1.0)
    assert timings.grace(0.5, 2, cap=100.0) == 1.0
    assert timings.round_time(2) == 2.0


@settings(max_examples=200, deadline=None)
@given(
    gamma=st.floats(0, 0.99),
    tau=st.integers(1, 8),
    t_step=st.floats(0, 100),
    t_quorum=st.floats(0, 100),
    t_sync=st.floats(0, 100),
    cap=st.floats(0, 100),
)
def test_property_grace_is_between_zero_and_cap_and_below_a_round(gamma, tau, t_step, t_quorum, t_sync, cap):
    g = grace_window(gamma, tau, t_step, t_quorum, t_sync, cap)
    assert 0.0 <= g <= cap
    assert g <= tau * t_step


# --- SynchronizerRounds ---------------------------------------------------------------------------


def rounds(**overrides) -> SynchronizerRounds:
    kwargs = dict(min_quorum=1, max_staleness=2, gamma=0.5, tau=2)
    kwargs.update(overrides)
    return SynchronizerRounds(3, [5, 0, 0], **kwargs)


def test_first_usable_delta_opens_the_round():
    sync = rounds()
    assert sync.open_fragments == ()
    rejected = sync.offer(0, contrib(anchor=1), 0.0)  # stale: opens nothing
    assert rejected.tag == RoundTag.STALE_ANCHOR and sync.open_fragments == ()
    opened = sync.offer(0, contrib("a"), 1.0)
    assert (opened.action, opened.tag) == (ACCEPT, RoundTag.OPENED_ROUND)
    assert "fragment 0 v5" in opened.reason and "accepted: a" in opened.reason
    assert sync.round(0).opened_at == 1.0
    assert (sync.offer(0, contrib("b"), 1.5)).tag == RoundTag.ACCEPTED
    assert (sync.offer(0, contrib("a"), 1.6)).tag == RoundTag.REPLACED


def test_unknown_fragment_is_rejected():
    d = rounds().offer(3, contrib(), 0.0)
    assert (d.action, d.tag) == (REJECT, AdmissionTag.UNKNOWN_FRAGMENT)


def test_ready_reports_every_open_round():
    sync = rounds(min_quorum=2)
    sync.offer(2, contrib("a", anchor=0), 0.0)
    sync.offer(0, contrib("a"), 0.0)
    sync.offer(0, contrib("b"), 0.0)
    decisions = sync.ready(0.0, LIVE3)
    assert [f for f, _ in decisions] == [0, 2]
    assert decisions[0][1].tag == RoundTag.GRACE_ENDED  # no step time yet: grace 0, merge at quorum
    assert decisions[1][1].tag == RoundTag.QUORUM_NOT_MET


def test_default_cap_is_one_round_and_grace_follows_the_averages():
    sync = rounds(gamma=0.5, tau=2)
    sync.observe_step_time(1.0)
    assert sync.grace() == pytest.approx(1.0)  # 0.5 * 2 * 1.0
    sync.offer(0, contrib("a"), 10.0)
    assert (sync.ready(10.9, LIVE3)[0][1]).tag == RoundTag.GRACE_RUNNING
    assert (sync.ready(11.0, LIVE3)[0][1]).tag == RoundTag.GRACE_ENDED
    assert (sync.ready(10.5, LIVE3, cap=0.5)[0][1]).tag == RoundTag.GRACE_CAPPED


def test_close_merging_finish_lifecycle_records_timings():
    sync = rounds(min_quorum=2)
    sync.observe_step_time(1.0)
    sync.offer(0, contrib("a"), 0.0)
    sync.offer(0, contrib("b"), 0.4)
    taken = sync.close(0, now=2.0)
    assert [c.sender for c in taken] == ["a", "b"]
    assert sync.timings.time_to_quorum.value == pytest.approx(0.4)
    assert sync.merging == {0}
    # a delta arriving during the merge opens the next round, which waits for the merge
    assert (sync.offer(0, contrib("c", anchor=3), 2.5)).tag == RoundTag.OPENED_ROUND
    sync.offer(0, contrib("a"), 2.6)
    assert (sync.ready(9.0, LIVE3)[0][1]).tag == RoundTag.MERGING
    with pytest.raises(ValueError, match="still merging"):
        sync.close(0, 9.0)
    dropped = sync.finish(0, new_version=6, sync_seconds=0.2)
    assert [d.tag for d in dropped] == [RoundTag.STALE_ANCHOR]  # c's anchor 3 is now 3 behind v6
    assert sync.version(0) == 6 and sync.round(0).version == 6
    assert sync.timings.sync_time.value == pytest.approx(0.2)
    assert sync.grace() == pytest.approx(0.5 * (2 * 1.0 - (0.4 + 0.2)))
    assert sync.merging == frozenset()


def test_finish_requires_a_close_and_a_newer_version():
    sync = rounds()
    with pytest.raises(ValueError, match="not merging"):
        sync.finish(0, 6, 0.1)
    sync.offer(0, contrib("a"), 0.0)
    sync.close(0, 0.0)
    with pytest.raises(ValueError, match="<= current"):
        sync.finish(0, 5, 0.1)
    sync.abort(0)
    assert sync.merging == frozenset() and sync.version(0) == 5
    with pytest.raises(ValueError, match="no open round"):
        sync.close(0, 1.0)


def test_set_version_for_a_new_holder_rebases_the_open_round():
    sync = rounds(max_staleness=0)
    sync.offer(1, contrib("a", anchor=0), 0.0)
    assert [d.tag for d in sync.set_version(1, 3)] == [RoundTag.STALE_ANCHOR]
    assert sync.version(1) == 3
    assert sync.round(1) is None  # emptied: discarded
    assert (sync.offer(1, contrib("b", anchor=3), 1.0)).tag == RoundTag.OPENED_ROUND
    assert sync.round(1).opened_at == 1.0


@pytest.mark.parametrize(
    "overrides",
    [dict(min_quorum=0), dict(max_staleness=-1), dict(gamma=1.0), dict(tau=0)],
)
def test_bad_parameters_are_config_errors(overrides):
    with pytest.raises(ConfigError):
        rounds(**overrides)


def test_versions_must_match_fragments():
    with pytest.raises(ConfigError, match="one version per fragment"):
        SynchronizerRounds(2, [0], min_quorum=1, max_staleness=1, gamma=0.1, tau=1)
