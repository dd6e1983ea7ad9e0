"""Sim tier: a 2 | 2 partition longer than the lease TTL; both sides train, then every replica converges.

Rule under test: protocol/reconcile.py (docs/partitions.md): the branch with more updates wins. The runs are deterministic (fake clock, seed).
Two scenarios: equal speeds (the losing side ends at versions at or above the winner's: "diverged"), and a
slower losing side (its versions end below the winner's, so replay finds the fork: "fork proven").
"""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import load_corpus
from p2p_diloco.protocol.reconcile import LOG_RECONCILED, ReconcileTag
from p2p_diloco.swarm.inprocess import InProcessSwarm, Partition, SwarmSpec

pytestmark = pytest.mark.sim

SPLIT, HEAL, END = 15.0, 45.0, 80.0
GROUPS = ((0, 1), (2, 3))
RECOVERY_BOUND = 10.0  # fake seconds from heal to identical digests
SCENARIOS = {
    "equal speeds": ((1.0, 1.0, 1.0, 1.0), ReconcileTag.DIVERGED),
    "slow losing side": (
        (1.0, 1.0, 2.0, 2.0),
        ReconcileTag.FORK_PROVEN,
    ),  # learner-2 (rendezvous rank 1) holds first
}


@pytest.fixture(scope="module")
def manifest(manifest) -> RunManifest:
    # No rotation during the run, so the side that keeps the first holder stays on term 1.
    return dataclasses.replace(manifest, timing=dataclasses.replace(manifest.timing, term_rounds=10_000))


class Probe:
    """Samples every replica's digest and versions on the fake clock."""

    def __init__(self, swarm: InProcessSwarm, every: float = 0.25):
        self.swarm, self.every = swarm, every
        self.samples: list[tuple[float, dict[int, str], dict[int, tuple[int, ...]]]] = []
        swarm.loop.call_at(0.0, self.sample)

    def sample(self) -> None:
        peers = self.swarm.peers
        self.samples.append(
            (
                self.swarm.clock.now(),
                {i: p.replica.digest() for i, p in peers.items()},
                {i: p.replica.versions() for i, p in peers.items()},
            )
        )
        self.swarm.loop.call_later(self.every, self.sample)

    def at(self, t: float):
        return max((s for s in self.samples if s[0] <= t), key=lambda s: s[0])

    def first_converged_after(self, t: float) -> float | None:
        for now, digests, _ in self.samples:
            if now >= t and len(digests) == 4 and len(set(digests.values())) == 1:
                return now
        return None


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def partitioned(manifest, request):
    corpus = load_corpus(manifest.data)
    step_times, _ = SCENARIOS[request.param]
    spec = SwarmSpec(
        manifest=manifest,
        learners=4,
        step_times=step_times,
        duration=END,
        eval_every=END,
        partitions=(Partition(GROUPS, SPLIT, HEAL),),
    )
    lines: list[str] = []
    swarm = InProcessSwarm(spec, corpus=corpus, log=lines.append)
    probe = Probe(swarm)
    report = swarm.run()
    return swarm, probe, report, lines, request.param


def side_of(swarm: InProcessSwarm, peer_id: str) -> int:
    index = int(peer_id.split("-")[1])
    return next(g for g, members in enumerate(GROUPS) if index in members)


def test_partition_longer_than_lease_both_sides_progress(partitioned, manifest):
    swarm, probe, report, _, _ = partitioned
    assert HEAL - SPLIT > 2 * manifest.timing.lease_ttl
    first_holder = report.terms[0][1]
    # The side without the holder elected a new term during the split.
    split_claims = [(t, who, term) for t, who, term in report.terms if SPLIT < t < HEAL]
    assert split_claims and all(
        side_of(swarm, who) != side_of(swarm, first_holder) for _, who, _ in split_claims
    )
    # Availability first: on both sides every replica's versions advanced during the split.
    _, _, before = probe.at(SPLIT)
    _, digests, after = probe.at(HEAL - 0.01)
    for i in range(4):
        assert sum(after[i]) > sum(before[i]) + 5, (i, before[i], after[i])
    # ... and the two sides really are two histories.
    assert digests[GROUPS[0][0]] != digests[GROUPS[1][0]]


def test_after_heal_every_replica_converges_to_the_winning_branch(partitioned):
    swarm, probe, report, lines, scenario = partitioned
    converged = probe.first_converged_after(HEAL)
    assert converged is not None and converged - HEAL <= RECOVERY_BOUND, converged
    print(f"{scenario}: identical digests {converged - HEAL:.2f} fake s after the heal")
    # The branch with more updates won (protocol/reconcile.py), not the one with more terms: here the first
    # holder's side, which did fewer updates during the split, lost and each of its peers logged a
    # reconciliation.
    loser = side_of(swarm, report.terms[0][1])
    _, _, at_split_end = probe.at(HEAL - 0.01)
    for p in range(len(at_split_end[0])):
        losing = max(at_split_end[i][p] for i in GROUPS[loser])
        assert losing <= min(at_split_end[i][p] for i in GROUPS[1 - loser]), (p, at_split_end)
    for peer in swarm.peers.values():
        logged = [line for line in lines if line.startswith(f"[{peer.peer_id}] {LOG_RECONCILED}:")]
        if side_of(swarm, peer.peer_id) == loser:
            assert logged and peer.repair.reconciliations, peer.peer_id
            # Each scenario exercises its path: a lost branch at or past the winner's version, or a
            # replay of the winner's log that does not match (the losing side is behind).
            assert any(f"({SCENARIOS[scenario][1]}:" in line for line in logged), logged
        else:
            assert not logged and not peer.repair.reconciliations, (peer.peer_id, logged)
    # The old holder stepped down; exactly one synchronizer remains, of the highest term.
    last_claim = report.terms[-1]
    holders = [p.peer_id for p in swarm.peers.values() if p.sync is not None]
    assert holders == [last_claim[1]] and last_claim[0] < HEAL, (holders, report.terms)
    assert all(p.term_seen == max(term for _, _, term in report.terms) for p in swarm.peers.values())
    # Training goes on after the heal, and the run ends with identical replicas.
    _, _, at_heal = probe.at(converged)
    _, _, at_end = probe.at(END)
    assert all(sum(at_end[i]) > sum(at_heal[i]) + 5 for i in range(4)), (at_heal, at_end)
    assert report.digests_equal
