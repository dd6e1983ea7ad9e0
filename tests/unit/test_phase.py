"""A seat's explicit phase (`swarm.election.phase`): the transition table on its own, the claim gate's guards in their
order, and every transition of a real `Peer`'s seat, SIGTERM (`Stopping`) in each phase included: a stopping
peer releases what it holds, never claims, and its seats stay `STOPPING`."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.protocol import election
from p2p_diloco.protocol.claim_guard import NO_GAPS, ClaimChecks, ReadGaps, RecordKind, RecordSlot, gate
from p2p_diloco.protocol.election import ElectionDecision, ElectionTag, LeaseRecord
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election.phase import Phase, after_decision, after_read, after_stop
from p2p_diloco.wire.records import HeartbeatInfo, decode_lease
from tests.support.manifests import tiny_manifest
from tests.support.peers import PeerHarness, make_peer

BASE = tiny_manifest("phases")
MANIFEST = dataclasses.replace(BASE, robust=dataclasses.replace(BASE.robust, enabled=False))
TIMING = MANIFEST.timing


def decision(action: str, tag: ElectionTag, term: int = 2) -> ElectionDecision:
    holder = "me" if action in (election.CLAIM, election.RENEW) else "other"
    return ElectionDecision(action, tag, "why", term=term, holder=holder, expires_at=200.0)


CLAIM = decision(election.CLAIM, ElectionTag.CLAIM)


# ---- the transition table --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "made", "may_claim", "after"),
    [
        (Phase.FOLLOWING, decision(election.FOLLOW, ElectionTag.HELD_BY), True, Phase.FOLLOWING),
        (Phase.FOLLOWING, decision(election.WAIT, ElectionTag.NO_CANDIDATES), True, Phase.CANDIDATE),
        (Phase.FOLLOWING, decision(election.WAIT, ElectionTag.NO_CANDIDATES), False, Phase.FOLLOWING),
        (Phase.CANDIDATE, CLAIM, True, Phase.HOLDING),
        (Phase.CANDIDATE, decision(election.FOLLOW, ElectionTag.HELD_BY), True, Phase.FOLLOWING),
        (Phase.HOLDING, decision(election.RENEW, ElectionTag.RENEW), True, Phase.HOLDING),
        (Phase.HOLDING, decision(election.HOLD, ElectionTag.HOLDING), True, Phase.HOLDING),
        (Phase.HOLDING, decision(election.STEP_DOWN, ElectionTag.TERM_ENDED), True, Phase.STEPPING_DOWN),
        (Phase.HOLDING, decision(election.STEP_DOWN, ElectionTag.HIGHER_TERM), True, Phase.CANDIDATE),
        (Phase.HOLDING, decision(election.STEP_DOWN, ElectionTag.LEASE_EXPIRED), False, Phase.FOLLOWING),
        (Phase.STEPPING_DOWN, decision(election.WAIT, ElectionTag.STEPPING_DOWN), True, Phase.STEPPING_DOWN),
        (Phase.STEPPING_DOWN, decision(election.FOLLOW, ElectionTag.HELD_BY), True, Phase.FOLLOWING),
        (Phase.STOPPING, CLAIM, True, Phase.STOPPING),
        (Phase.STOPPING, decision(election.FOLLOW, ElectionTag.HELD_BY), True, Phase.STOPPING),
    ],
)
def test_each_decision_moves_a_seat_to_one_phase(before, made, may_claim, after):
    assert after_decision(before, made, may_claim) == after


def test_stepping_down_ends_with_a_read_that_shows_the_term_over_or_after_a_lease_ttl():
    assert after_read(Phase.STEPPING_DOWN, False, 100.0, 101.0, ttl=6.0) == Phase.STEPPING_DOWN
    assert after_read(Phase.STEPPING_DOWN, True, 100.0, 101.0, ttl=6.0) == Phase.CANDIDATE
    assert after_read(Phase.STEPPING_DOWN, False, 100.0, 106.0, ttl=6.0) == Phase.CANDIDATE
    assert after_read(Phase.HOLDING, True, 100.0, 101.0, ttl=6.0) == Phase.HOLDING
    assert {after_stop(phase) for phase in Phase} == {Phase.STOPPING}


# ---- the claim gate: every guard, in order ------------------------------------------------------------


def test_the_claim_gate_applies_its_guards_in_order_and_only_to_claims():
    gaps = ReadGaps({RecordSlot(RecordKind.HEARTBEAT, "b"): 110.0})
    every = ClaimChecks(True, "released term 1", "reading 1.0s of 4.0s", gaps, "run under way: ...")
    order = [
        ElectionTag.STOPPING,
        ElectionTag.STEPPING_DOWN,
        ElectionTag.PARTIAL_READ,
        ElectionTag.INCOMPLETE_READ,
        ElectionTag.UNDER_WAY,
    ]
    checks = every
    for tag, lifted in zip(order, ["stopping", "stepping_down", "warm_up", "gaps", "under_way"]):
        waited = gate(CLAIM, checks)
        assert (waited.action, waited.tag, waited.holder) == (election.WAIT, tag, None)
        checks = dataclasses.replace(checks, **{lifted: False if lifted == "stopping" else None})
        if lifted == "gaps":
            checks = dataclasses.replace(checks, gaps=NO_GAPS)
    assert gate(CLAIM, checks) == CLAIM
    for other in (election.RENEW, election.HOLD, election.FOLLOW, election.STEP_DOWN):
        made = decision(other, ElectionTag.HOLDING)
        assert gate(made, every) == made  # only claims wait here
    succession = decision(election.CLAIM, ElectionTag.SUCCESSION)
    assert gate(succession, ClaimChecks(gaps=gaps)) == succession  # exact: a gap never holds it


# ---- a real peer's seat -------------------------------------------------------------------------------


def lone_candidate(manifest=MANIFEST) -> PeerHarness:  # noqa: ANN001
    """A peer that may synchronize, alone in the swarm, that has read it for a heartbeat TTL."""
    peer = make_peer(manifest, may_sync=True)
    peer.heartbeat(peer.clock.now())
    first = peer.election_tick(peer.clock.now())
    assert (first.action, first.tag) == (election.WAIT, ElectionTag.PARTIAL_READ)
    assert peer.peer.phases() == (Phase.CANDIDATE,)
    peer.clock.advance_to(peer.clock.now() + manifest.timing.heartbeat_ttl)
    return peer


def tick(peer: PeerHarness, seconds: float) -> ElectionDecision:
    peer.clock.advance_to(peer.clock.now() + seconds)
    peer.heartbeat(peer.clock.now())
    return peer.election_tick(peer.clock.now())


def my_leases(peer: PeerHarness) -> list[LeaseRecord]:
    stored = peer.kv.get(peer.peer.membership.lease_key, peer.clock.now())
    return [decode_lease(holder, value.value) for holder, value in stored.items() if holder == "me"]


def holding(manifest=MANIFEST) -> PeerHarness:  # noqa: ANN001
    peer = lone_candidate(manifest)
    claimed = tick(peer, 0.0)
    assert (claimed.action, claimed.term) == (election.CLAIM, 1)
    assert peer.peer.phases() == (Phase.HOLDING,) and peer.peer.sync is not None
    return peer


def stop(peer: PeerHarness) -> list[fx.Intent]:
    peer.clock.advance_to(peer.clock.now() + 0.5)  # a later write: its DHT expiration replaces the last
    intents = peer.peer.handle(fx.Stopping(peer.clock.now()))
    for intent in intents:
        peer.perform(intent)
    return intents


def released_records(intents: list[fx.Intent]) -> list[fx.StoreRecord]:
    return [i for i in intents if isinstance(i, fx.StoreRecord) and i.what == "released lease"]


def test_a_candidate_claims_and_holds_and_a_peer_that_sees_a_live_holder_follows_it():
    peer = holding()
    assert tick(peer, 0.5).action == election.HOLD and peer.peer.phases() == (Phase.HOLDING,)
    follower = make_peer(MANIFEST, peer_id="other", may_sync=True, kv=peer.kv, clock=peer.clock)
    follower.heartbeat(peer.clock.now())
    followed = follower.election_tick(peer.clock.now())
    assert (followed.action, followed.holder) == (election.FOLLOW, "me")
    assert follower.peer.phases() == (Phase.FOLLOWING,) and follower.peer.sync is None


def test_sigterm_while_claiming_an_election_read_in_flight_claims_nothing_and_stops():
    """The read of an election round is out when `Stopping` arrives; its result comes back after it."""
    harness = lone_candidate()
    peer = harness.peer
    intents = peer.handle(fx.Tick(fx.TickKind.SWARM, harness.clock.now()))
    (read,) = [i for i in intents if isinstance(i, fx.Perform) and isinstance(i.request, fx.ReadSwarm)]
    for intent in intents:
        if intent is not read:
            harness.perform(intent)
    stop(harness)
    after = peer.handle(fx.TaskResult(read.task, harness.read_all()))
    assert not [i for i in after if isinstance(i, (fx.Claimed, fx.StoreRecord))]
    assert peer.phases() == (Phase.STOPPING,) and peer.sync is None and my_leases(harness) == []
    assert "stopping: never claims again" in peer.decisions[-1]


def test_sigterm_while_holding_releases_the_lease_and_never_claims_again():
    harness = holding()
    intents = stop(harness)
    (released,) = released_records(intents)
    assert [lease.released for lease in my_leases(harness)] == [True]
    assert harness.peer.phases() == (Phase.STOPPING,) and harness.peer.sync is None
    waited = tick(harness, TIMING.lease_ttl + TIMING.lease_margin)  # a term anyone could claim now
    assert waited.action == election.WAIT  # it may no longer synchronize: no candidate at all
    assert harness.peer.phases() == (Phase.STOPPING,) and [x.released for x in my_leases(harness)] == [True]
    assert released.subkey == "me"


def term_of_one_round() -> PeerHarness:
    """A holder whose term ends after one round, and which merged that round (its own delta: quorum 1)."""
    manifest = dataclasses.replace(
        MANIFEST,
        timing=dataclasses.replace(TIMING, term_rounds=1),
        diloco=dataclasses.replace(MANIFEST.diloco, min_quorum=1),
    )
    harness = holding(manifest)
    assert tick(harness, 0.0).tag == ElectionTag.CONFIRMED  # a read shows its claim alone: it merges
    for _ in range(manifest.diloco.steps_per_fragment):
        harness.train_step()
    assert harness.sync_now(harness.clock.now()) and harness.peer.sync.rounds_done == 1
    return harness


def test_a_term_that_ended_steps_down_and_claims_again_only_once_a_read_shows_it_released():
    harness = term_of_one_round()
    ended = tick(harness, 0.5)  # later than the claim: the released record replaces it in the DHT
    assert (ended.action, ended.tag) == (election.STEP_DOWN, ElectionTag.TERM_ENDED)
    assert harness.peer.phases() == (Phase.STEPPING_DOWN,) and harness.peer.sync is None
    key = harness.peer.membership.lease_key
    hidden = harness.kv._data.pop(key)  # the next read misses the released record (a partial read)
    waited = tick(harness, 0.0)  # it remembers its own term live (lease grace); the gate would wait too
    assert waited.action == election.WAIT and harness.peer.phases() == (Phase.STEPPING_DOWN,)
    harness.kv._data[key] = hidden
    again = tick(harness, TIMING.claim_grace)
    assert (again.action, again.term) == (election.CLAIM, 2) and harness.peer.phases() == (Phase.HOLDING,)


def test_sigterm_while_stepping_down_releases_nothing_twice_and_never_claims():
    harness = term_of_one_round()
    assert tick(harness, 0.5).tag == ElectionTag.TERM_ENDED
    assert harness.peer.phases() == (Phase.STEPPING_DOWN,)
    intents = stop(harness)
    assert released_records(intents) == [] and harness.peer.phases() == (Phase.STOPPING,)
    waited = tick(harness, TIMING.lease_ttl + TIMING.claim_grace)
    assert waited.action == election.WAIT
    assert [lease.term for lease in my_leases(harness)] == [1]


def test_a_holder_is_woken_at_its_rounds_deadline_not_polled():
    """`SyncDue` names when the open round's grace window ends; once merged, nothing is due."""
    harness = holding(
        dataclasses.replace(MANIFEST, diloco=dataclasses.replace(MANIFEST.diloco, min_quorum=1))
    )
    peer = harness.peer
    info = HeartbeatInfo(role="learner", may_sync=False, reachable=True, versions=(0, 0))
    harness.kv.store(peer.membership.hb_key, "other", info.to_bytes(), harness.clock.now() + 60.0)
    assert tick(harness, 0.0).action == election.HOLD  # a second live learner: its delta is awaited
    peer.sync.observe_step_time(5.0)  # learners step every 5 s: a grace window keeps the round open
    due: list[float | None] = []
    original = harness.sync_due
    harness.sync_due = lambda at: (due.append(at), original(at))
    for _ in range(MANIFEST.diloco.steps_per_fragment):
        harness.train_step()
    (fragment,) = peer.sync.rounds.open_fragments
    opened = peer.sync.rounds.round(fragment)
    assert due and due[-1] is not None and harness.clock.now() < due[-1]
    assert due[-1] <= opened.quorum_at + peer.sync.rounds.grace()  # the window, capped by the round time
    harness.clock.advance_to(due[-1])
    harness.post(fx.Tick(fx.TickKind.SYNC, harness.clock.now()))
    assert peer.replica.versions()[fragment] == 1 and due[-1] is None
