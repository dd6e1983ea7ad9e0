"""The live learners a holder waits for: `Standing.active_until` and the answer `Membership.live_learners`
keeps between reads (issue #40: a holder asked after every event it handled, a pass over every live peer)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.protocol.standing import Standing
from p2p_diloco.swarm.effects import SwarmRecords
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.wire.interfaces import StoredValue
from p2p_diloco.wire.records import HeartbeatInfo
from tests.support.manifests import tiny_manifest

PEERS = [f"QmLearner{i}" for i in range(6)]
WINDOW, GRACE = 5.0, 3.0


def reference_active(standing: Standing, learners: list[str], now: float) -> frozenset[str]:
    """The rule as `Standing.active` states it, peer by peer."""
    never = float("-inf")
    return frozenset(
        p
        for p in learners
        if now - standing.last_merged.get(p, never) <= standing.active_window
        or now - standing.first_heard.get(p, never) <= standing.newcomer_grace
    )


history = st.lists(
    st.tuples(st.sampled_from(["merged", "heard"]), st.sets(st.sampled_from(PEERS)), st.floats(0.0, 20.0)),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(history, st.floats(0.0, 30.0), st.lists(st.floats(0.0, 30.0), max_size=6))
def test_an_active_answer_holds_until_the_time_it_names(events, now, later):
    standing = Standing(new_peer_rounds=1, active_window=WINDOW, newcomer_grace=GRACE)
    for kind, peers, at in sorted(events, key=lambda e: e[2]):
        if kind == "merged":
            standing.note_merged(sorted(peers), at)
        else:
            standing.heard(sorted(peers), at)
    answer, before = standing.active_until(PEERS, now)
    assert answer == reference_active(standing, PEERS, now) == standing.active(PEERS, now)
    for t in later:
        if now <= t < before:
            assert reference_active(standing, PEERS, t) == answer, f"the answer at {now} changed by {t}"


def test_what_changes_the_standing_changes_its_version():
    standing = Standing(new_peer_rounds=1, active_window=WINDOW, newcomer_grace=GRACE)
    versions = [standing.version]
    standing.note_merged(["QmA"], 1.0)
    versions.append(standing.version)
    standing.heard(["QmB"], 1.0)
    versions.append(standing.version)
    standing.heard(["QmB"], 2.0)  # heard before: its grace started already, nothing changes
    assert standing.version == versions[-1]
    assert versions == sorted(set(versions)), "a merge and a first hearing each bump the version"


def membership() -> Membership:
    manifest = tiny_manifest("live-learners")
    assert manifest.robust.enabled
    standing = Standing(new_peer_rounds=1, active_window=WINDOW, newcomer_grace=GRACE)
    return Membership("QmMe", manifest, 2, Journal("QmMe", lambda intent: None), standing)


def read(now: float, peers: list[str]) -> SwarmRecords:
    beat = HeartbeatInfo(role="learner", may_sync=False, reachable=True, versions=(1, 1)).to_bytes()
    return SwarmRecords(heartbeats={p: StoredValue(beat, now + 10) for p in peers}, leases={}, now=now)


def test_the_kept_answer_follows_merges_reads_and_closing_windows():
    me = membership()
    me.ingest(read(10.0, ["QmA", "QmB"]))
    assert me.live_learners(10.0) == frozenset({"QmA", "QmB"})  # newcomers: awaited for their grace
    assert me.live_learners(13.1) == frozenset(), "their grace closed at 13.0"
    me.standing.note_merged(["QmA"], 13.5)
    assert me.live_learners(13.5) == frozenset({"QmA"}), "a merge since the last answer counts at once"
    assert me.live_learners(18.4) == frozenset({"QmA"})
    assert me.live_learners(18.6) == frozenset(), "QmA's window closed at 18.5"
    me.standing.note_merged(["QmA", "QmB"], 19.0)
    assert me.live_learners(19.0) == frozenset({"QmA", "QmB"})
    me.ingest(read(20.0, ["QmB"]))
    assert me.live_learners(20.0) == frozenset({"QmB"}), "a read that no longer holds QmA drops it"
