"""Sim tier: DHT reads that return only a peer's own records (issue 29 item 3, `protocol.claim_guard`).

Unpaced, 8 real peers on 2 cores starved their own DHT requests and went through 17 terms in 150 s with up
to 6 peers claiming one term. Here some peers' reads return only their own records for a while (a
`Starvation`, injected into the in-memory store): they must not claim on such a read, no two peers claim
one term, at most one peer holds a term at any time, and once the reads recover the swarm holds one term.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from p2p_diloco.protocol.election import ElectionTag
from p2p_diloco.swarm.inprocess import InProcessSwarm, Starvation, SwarmSpec

pytestmark = pytest.mark.sim

STARVED = (0, 1, 2, 3)  # four of six peers, the first holder among them or not
START, END, DURATION = 20.0, 35.0, 50.0  # longer than any record read before START stays stored


def test_peers_whose_reads_return_only_themselves_claim_no_term(manifest, corpus):
    steady = dataclasses.replace(manifest, timing=dataclasses.replace(manifest.timing, term_rounds=10_000))
    spec = SwarmSpec(
        manifest=steady,
        learners=6,
        duration=DURATION,
        eval_every=100,
        starved=(Starvation(STARVED, START, END),),
    )
    lines: list[str] = []
    swarm = InProcessSwarm(spec, corpus=corpus, log=lines.append)
    holding: list[tuple[float, dict[str, int]]] = []

    def sample() -> None:
        held = {p.peer_id: p.sync.term for p in swarm.peers.values() if p.sync is not None}
        holding.append((swarm.clock.now(), held))
        swarm.loop.call_later(0.25, sample)

    swarm.loop.call_at(0.0, sample)
    report = swarm.run()

    claims = Counter(term for _, _, term in report.terms)
    assert all(n == 1 for n in claims.values()), report.terms  # no two peers claimed one term
    for t, held in holding:
        assert len(held) <= 1, (t, held)  # one holder at any moment: nobody claimed beside the live one
    # The guard acted: starved peers would have claimed the next term on reads of themselves alone.
    waits = [line for line in lines if f"wait: {ElectionTag.INCOMPLETE_READ}" in line]
    assert {line.split("]")[0][1:] for line in waits} <= {f"learner-{i}" for i in STARVED}, waits
    assert waits, "no starved peer would have claimed: the scenario tests nothing"
    # After the starvation the swarm holds one term, and every peer follows its holder.
    settled = [held for t, held in holding if t >= END + manifest.timing.lease_ttl]
    assert settled and all(len(held) == 1 for held in settled), settled[:3]
    (holder,) = settled[-1]
    assert {p.membership.holder for p in swarm.peers.values()} == {holder}
    assert report.digests_equal
