"""The learner's round-robin send schedule: due times, the tau limit, deferred sends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol.schedule import (
    SEND,
    TRAIN,
    LearnerSchedule,
    ScheduleTag,
)

NONE: frozenset[int] = frozenset()


def test_round_robin_sends_fragment_k_mod_p_at_step_k_times_s():
    schedule = LearnerSchedule(num_fragments=3, steps_per_fragment=2, max_in_flight=3)
    sent = {}
    for step in range(1, 13):
        decision = schedule.on_step(step, NONE)
        if decision.action == SEND:
            assert decision.tag == ScheduleTag.DUE
            sent[step] = decision.fragment
        else:
            assert decision.tag == ScheduleTag.NOT_DUE
            assert decision.fragment is None
    assert sent == {2: 1, 4: 2, 6: 0, 8: 1, 10: 2, 12: 0}
    assert schedule.sends == 6


def test_not_due_names_the_next_fragment_and_step():
    schedule = LearnerSchedule(4, 6, 2)
    decision = schedule.on_step(1, NONE)
    assert decision.action == TRAIN
    assert decision.reason == "not due: next is fragment 1 at step 6"


def test_tau_reached_defers_the_due_fragment_without_blocking():
    schedule = LearnerSchedule(num_fragments=3, steps_per_fragment=2, max_in_flight=1)
    assert schedule.on_step(2, NONE).fragment == 1
    blocked = schedule.on_step(4, frozenset({1}))
    assert blocked.action == TRAIN and blocked.tag == ScheduleTag.TAU_REACHED
    assert blocked.fragment == 2
    assert "1/1 in flight" in blocked.reason
    assert schedule.on_step(5, frozenset({1})).action == TRAIN
    assert schedule.pending(5) == 2
    # the slot frees at step 6: the deferred fragment 2 goes first, though fragment 0 is due too
    deferred = schedule.on_step(6, NONE)
    assert (deferred.action, deferred.fragment) == (SEND, 2)
    assert "2 steps late" in deferred.reason
    # fragment 0 (due at 6) follows at the next step where a slot is free; due times did not move
    assert schedule.on_step(7, frozenset({2})).action == TRAIN
    following = schedule.on_step(8, NONE)
    assert (following.action, following.fragment) == (SEND, 0)
    assert "due since step 6" in following.reason
    assert (schedule.next_fragment, schedule.next_due_step) == (1, 8)  # overdue already: goes next
    assert schedule.pending(8) == 1
    assert schedule.deferred_steps == 3


def test_overdue_fragments_drain_one_per_step_in_order():
    schedule = LearnerSchedule(num_fragments=4, steps_per_fragment=1, max_in_flight=4)
    decisions = [schedule.on_step(10, NONE), schedule.on_step(11, NONE), schedule.on_step(12, NONE)]
    assert [d.fragment for d in decisions] == [1, 2, 3]
    assert all(d.action == SEND for d in decisions)


def test_already_in_flight_waits_for_adoption_and_holds_the_queue():
    schedule = LearnerSchedule(num_fragments=2, steps_per_fragment=1, max_in_flight=3)
    assert schedule.on_step(1, NONE).fragment == 1
    assert schedule.on_step(2, frozenset({1})).fragment == 0
    waiting = schedule.on_step(3, frozenset({0, 1}))
    assert waiting.action == TRAIN and waiting.tag == ScheduleTag.ALREADY_IN_FLIGHT
    assert waiting.fragment == 1
    # a free slot is not enough while fragment 1's own delta is unadopted
    assert (schedule.on_step(4, frozenset({1}))).tag == ScheduleTag.ALREADY_IN_FLIGHT
    resumed = schedule.on_step(5, frozenset({0}))
    assert (resumed.action, resumed.fragment) == (SEND, 1)


def test_already_in_flight_takes_precedence_over_tau():
    schedule = LearnerSchedule(num_fragments=2, steps_per_fragment=1, max_in_flight=1)
    assert schedule.on_step(1, NONE).fragment == 1
    assert (schedule.on_step(2, frozenset({1}))).tag == ScheduleTag.TAU_REACHED  # fragment 0 due, 1 in flight
    assert schedule.on_step(3, NONE).fragment == 0
    assert (schedule.on_step(4, frozenset({1}))).tag == ScheduleTag.ALREADY_IN_FLIGHT


def test_steps_must_increase_and_in_flight_must_be_known():
    schedule = LearnerSchedule(2, 1, 1)
    schedule.on_step(3, NONE)
    with pytest.raises(ValueError, match="increase"):
        schedule.on_step(3, NONE)
    with pytest.raises(ValueError, match="unknown fragments"):
        schedule.on_step(4, frozenset({5}))


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_bad_parameters_are_config_errors(args):
    with pytest.raises(ConfigError):
        LearnerSchedule(*args)


@settings(max_examples=100, deadline=None)
@given(
    p=st.integers(min_value=1, max_value=6),
    s=st.integers(min_value=1, max_value=4),
    tau=st.integers(min_value=1, max_value=4),
    adopt_after=st.integers(min_value=0, max_value=9),
)
def test_property_sends_follow_round_robin_and_respect_tau(p, s, tau, adopt_after):
    """Every send is the next fragment in order, never exceeds tau, never duplicates an in-flight one."""
    schedule = LearnerSchedule(p, s, tau)
    in_flight: dict[int, int] = {}  # fragment -> step it was sent
    expected_k = 1
    for step in range(1, 200):
        for fragment, sent_at in list(in_flight.items()):
            if step - sent_at > adopt_after:
                del in_flight[fragment]
        decision = schedule.on_step(step, frozenset(in_flight))
        if decision.action == SEND:
            assert decision.fragment == expected_k % p
            assert step >= expected_k * s
            assert decision.fragment not in in_flight
            assert len(in_flight) < tau
            in_flight[decision.fragment] = step
            expected_k += 1
    assert expected_k > 1
