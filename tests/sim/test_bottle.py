"""Sim tier: the swarm in a bottle (`p2p_diloco.sim.bottle`), whole nodes on virtual time.

Each test plays seeds or a hand-written fault list through `simulate` and asserts that no invariant
broke (the violation names the rule, the virtual time and the seed; `scripts/explore.py --replay SEED`
prints the trace). The regression seeds (10, 11, 13 of the default scenario, with their fault kinds
pinned) replay races found by exploring: each failed before its fix (seed 13's race no longer comes up
on its trajectory since the relay trees changed: `tests/unit/test_reconcile_overtaken.py` proves that fix
directly). They are CI's fixed set of seeds; `scripts/explore.py --seeds A-B` runs more on demand.
"""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.sim.bottle.faults import Fault, Kind
from p2p_diloco.sim.bottle.invariants import Rule
from p2p_diloco.sim.bottle.run import Scenario, simulate

pytestmark = pytest.mark.sim

SHORT = Scenario(nodes=4, fault_window=40.0, faults=5, settle=25.0, quiet=35.0)
# the fault kinds explored when seed 11 failed, and when seeds 10 and 13 did; pinned, so that new kinds do
# not change their draws
FIRST_KINDS = tuple(
    Kind(k) for k in ("kill", "term", "freeze", "dht_slow", "dht_drop", "starve", "partition", "newcomer")
)
# the scenario those seeds ran (the default then), pinned whole
FIRST_SCENARIO = Scenario(
    nodes=5, shards=1, fault_window=120.0, faults=8, settle=40.0, quiet=40.0, kinds=FIRST_KINDS
)
SECOND_KINDS = tuple(
    Kind(k)
    for k in (
        "kill", "term", "freeze", "dht_slow", "dht_drop", "starved_reads", "starve", "partition", "newcomer",
        "bootstrap",
    )
)  # fmt: skip


def assert_held(result) -> None:  # noqa: ANN001 - sim.bottle.run.Result
    assert result.ok, f"{result.violation}\nfaults: {[f.describe() for f in result.faults]}"


def test_one_seed_replays_byte_for_byte():
    first = simulate(11, SHORT)
    second = simulate(11, SHORT)
    assert first.faults == second.faults and first.faults, "the seed drew no faults"
    assert first.trace_text == second.trace_text
    assert first.events_digest == second.events_digest  # every node's events.jsonl, byte for byte
    other = simulate(12, SHORT)
    assert other.trace_digest != first.trace_digest  # the trace depends on the seed, not only the code


def test_sharded_seed_holds_every_invariant():
    result = simulate(5, Scenario(nodes=5, shards=4, fault_window=90.0, faults=7, settle=30.0, quiet=35.0))
    assert_held(result)
    assert all(v > 0 for v in result.versions)  # every shard's fragments advanced


def test_a_sigkilled_holder_is_replaced_and_rejoins_from_its_state_dir():
    # node order of the first claim is the seed's; kill whoever it is by killing every node in turn
    faults = [Fault(Kind.KILL, 20.0 + 12 * i, i, length=5.0) for i in range(4)]
    result = simulate(3, SHORT, faults=faults)
    assert_held(result)
    restarts = [
        line for line in result.trace_text.splitlines() if " start " in line and '"restored": true' in line
    ]
    assert len(restarts) == 4, restarts  # every restart came back from its own state directory
    # node-0 (term 1) and then node-1 (term 2) held when killed: each named successor probed it, found it
    # gone and claimed at once (succession), not a lease later
    successions = [line for line in result.trace_text.splitlines() if "claim: succession" in line]
    assert len(successions) == 2, successions
    assert [int(float(line.split()[0])) for line in successions] == [20, 32]  # within a second of the kills


def test_a_frozen_holder_is_fenced_out_and_steps_down_after_its_thaw():
    faults = [Fault(Kind.FREEZE, 15.0 + 14 * i, i, length=12.0) for i in range(3)]
    result = simulate(4, SHORT, faults=faults)
    assert_held(result)  # one_holder_per_term and fencing_monotone held throughout
    assert result.claims >= 2


def test_every_rule_can_fail():
    """The invariants are not vacuous: a run that never quiets (no quiet period) fails the end checks."""
    result = simulate(0, Scenario(nodes=4, fault_window=20.0, faults=0, settle=1.0, quiet=0.5))
    assert result.violation is not None
    assert result.violation.rule in {Rule.REPLICAS_IDENTICAL, Rule.DELTAS_SETTLED, Rule.EVERYONE_REJOINED}


def test_a_peer_stopping_while_its_election_read_is_in_flight_never_claims_and_exits():
    """Regression (the wan test's learner that claimed a second after SIGTERM): with slow DHT reads
    (2.5 s), node-2's read that would win term 1 is in flight when SIGTERM arrives at 10.5 s; before the
    fix it came back at 12.6 s and node-2 claimed while stopping (rule no_claim_while_stopping)."""
    faults = [Fault(Kind.DHT_SLOW, 0.0, j, length=20.0, amount=2.5) for j in range(3)]
    faults.append(Fault(Kind.TERM, 10.5, 2, length=3.0))
    result = simulate(
        1, Scenario(nodes=3, fault_window=20.0, faults=0, settle=15.0, quiet=30.0), faults=faults
    )
    assert_held(result)
    lines = result.trace_text.splitlines()
    assert any("node-2 sigterm" in line for line in lines) and any("node-2 exited" in line for line in lines)
    assert not any("node-2 claim" in line and float(line.split()[0]) < 14.0 for line in lines)


def test_seed_11_an_island_holding_a_term_nobody_accepts_steps_down():
    """Regression: node-0, alone in a partition from 63.6 s, claimed term 3 while term 2 lived on the
    other side; after the heal every reader refused its lease as claimed early, yet it kept holding and
    merging its own branch, and at the end its replica differed at the swarm's versions
    (replicas_identical). Now it steps down (`ElectionTag.REFUSED_LEASE`) and follows term 2."""
    result = simulate(11, FIRST_SCENARIO)
    assert_held(result)
    assert "refused lease" in result.trace_text  # the island's step-down happened, not a luckier run


def test_reads_that_return_only_a_peers_own_records_never_make_two_holders():
    """Two listed synchronizers holding one term on starved reads (issue #29's race): with the claim
    guard's incomplete-read wait taken out (`claim_guard.gate` ignoring the read's gaps), seed 5 of this
    scenario fails one_holder_per_term (node-2 and node-5 both held term 3 at 37.6 s); with it, it holds."""
    scenario = Scenario(
        nodes=6, fault_window=60.0, faults=14, settle=20.0, quiet=35.0, kinds=(Kind.STARVED_READS, Kind.KILL)
    )
    result = simulate(5, scenario)
    assert_held(result)
    assert (
        "incomplete read" in result.trace_text
    )  # the guard acted: a starved peer waited instead of claiming


@pytest.mark.parametrize("amnesia", [False, True], ids=["remembers", "amnesia"])
def test_a_newcomer_through_a_restarted_bootstrap_joins_the_run_not_an_island(amnesia):
    """The bootstrap node is down 30-60 s; a newcomer starting meanwhile cannot start (p2pd refuses: no
    initial peer answers) and its supervisor retries; one starting the moment the bootstrap is back meets
    the run through it: the bootstrap re-dials the peers it remembered, or (its memory lost) the peers'
    re-dials reach it. The newcomer downloads the run's state instead of training from version 0."""
    faults = [
        Fault(Kind.BOOTSTRAP, 30.0, -1, length=30.0, amount=float(amnesia)),
        Fault(Kind.NEWCOMER, 35.0, 3),
    ]
    faults.append(Fault(Kind.NEWCOMER, 60.5, 2))
    scenario = Scenario(nodes=4, fault_window=90.0, faults=0, settle=30.0, quiet=35.0)
    result = simulate(2, scenario, faults=faults)
    assert_held(result)
    lines = result.trace_text.splitlines()
    assert any("node-3 dht_unreachable" in line for line in lines)  # it tried while the bootstrap was down
    started = [line for line in lines if " start " in line and line.split()[1] in ("node-2", "node-3")]
    assert len(started) == 2 and all('"versions": [0, 0, 0, 0]' in line for line in started)
    assert "loaded: fragment" in result.trace_text  # the newcomers downloaded snapshots of the run
    assert not any(" claim " in line and line.split()[1] in ("node-2", "node-3") for line in lines)


def test_a_holder_stopping_releases_its_lease_exits_in_time_and_is_replaced():
    """SIGTERM of the holder (node-0 holds term 1 from 5 s in seed 3): it merges what it can, releases its
    lease, exits within the stop deadline (rule exits_in_time) and never claims again; the next holder claims
    without waiting out a lease."""
    result = simulate(3, SHORT, faults=[Fault(Kind.TERM, 15.0, 0, length=10.0)])
    assert_held(result)
    lines = result.trace_text.splitlines()
    exited = next(line for line in lines if "node-0 exited" in line)
    assert '"released_lease": true' in exited
    claims = [(float(line.split()[0]), line.split()[1]) for line in lines if line.split()[2] == "claim"]
    assert claims[0][1] == "node-0" and len(claims) >= 2
    assert 15.0 <= claims[1][0] < 15.0 + SHORT_LEASE and claims[1][1] != "node-0"  # no lease waited out
    assert not any(who == "node-0" and 15.0 <= t < 25.0 for t, who in claims)  # never while stopping


SHORT_LEASE = 6.0  # the demo manifest's lease_ttl


def test_seed_10_a_newcomer_whose_reads_find_nobody_learns_from_pushed_updates_that_the_run_is_under_way():
    """Regression: node-0 joined at 12.3 s with DHT reads that returned only its own records; it was sent
    the run's updates (refused: it could not read their leases) but saw no proof in the DHT, so after its
    partial-read wait it claimed term 1 at version 0 beside the live holder of term 1 (one_holder_per_term):
    a fresh start of a run under way. Now a signed update it is sent counts as the proof, pushed or relayed
    (since the relay trees changed, node-0 gets that update from a relayer, not from its publisher: a
    relayed one that counted for nothing let the race back in)."""
    result = simulate(10, dataclasses.replace(FIRST_SCENARIO, kinds=SECOND_KINDS))
    assert_held(result)
    assert "proof the run is under way: fragment 1 v2 term 1 signed by node-4" in result.trace_text


def test_seed_13_holds_through_two_partitions_and_freezes():
    """Seed 13 holds every invariant. It once replayed a reconcile race: node-1 began reconciling fragment 3
    toward an old winning tip (t1 v4); its downloads took 30 s (a partition), meanwhile it applied the live
    holder's updates up to v14, and the stale reconcile then installed a v13 snapshot (versions_monotone:
    14 -> 13). Protocol changes (relay trees) have since moved this seed's trajectory off that race, which
    `tests/unit/test_reconcile_overtaken.py` now proves directly: a reconcile whose fragment moved during
    its download installs nothing."""
    result = simulate(13, dataclasses.replace(FIRST_SCENARIO, kinds=SECOND_KINDS))
    assert_held(result)
