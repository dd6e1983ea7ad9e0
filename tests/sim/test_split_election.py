"""Sim tier, issue #40's split election: one shard term claimed and published by two peers.

The property: at most one peer publishes an update of any (shard, term) (`Rule.ONE_PUBLISHER_PER_TERM`,
checked on every publication), and once quiet every replica is bit-identical (`Rule.REPLICAS_IDENTICAL`).

Claim windows are `claim_grace` (2 s) apart: they assume a claim's lease write is readable before the next
window opens. Here it is not. Right as its window's claim is decided, the claimant's DHT calls slow down by
2.5 s for that one store (`Kind.DHT_SLOW`, 0.05 s long: only the store starts in it), so the next-ranked
candidate reads no lease in its own window, 1 s later, and claims the same term, as 8 real paced peers did
under load. Before the fix both claimants merged and published that term (seed 1, S = 1: node-0 and node-2
published term 1 at 6.39 s and 6.98 s; S = 2: node-1 and node-3 published shard 1's term 1), a tie
`Rule.ONE_HOLDER_PER_TERM` tolerated because each side saw the other's lease for less than its read delay.
Now a claimant merges nothing until a read shows its claim and no other claim of its term, and the one whose
read shows the other claim first yields (`protocol.election`, "confirmation"): here the slow claimant, whose
read comes back only after its store.

The manifest turns `[robust]` off: with it, a peer that never held a term holds its first rounds for a
direction reference (`warmup_wait`, 10 s), longer than the tie lasts, so neither claimant would publish.
Seeded and replayable: `simulate(seed, SCENARIO[shards], manifest=..., faults=...)` gives the same trace.
"""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.sim.bottle.faults import Fault, Kind
from p2p_diloco.sim.bottle.run import Scenario, sim_manifest, simulate

pytestmark = pytest.mark.sim

STORE_SECONDS = 2.5  # the slow claim's store: above claim_grace (2 s), the rank window
# shards -> (seed, nodes, the claimant whose store is slow, when its claim is decided (s), its shard)
CASES = {1: (1, 3, 0, 5.04, 0), 2: (1, 4, 1, 6.04, 1)}


def split_election(shards: int):  # noqa: ANN201 - sim.bottle.run.Result
    seed, nodes, slow, claim_at, _ = CASES[shards]
    base = sim_manifest(shards)
    manifest = dataclasses.replace(base, robust=dataclasses.replace(base.robust, enabled=False))
    scenario = Scenario(nodes=nodes, shards=shards, fault_window=12.0, faults=0, settle=8.0, quiet=20.0)
    # the claimant's read ends at claim_at - 0.02 s; its store starts at claim_at, inside the fault
    faults = [Fault(Kind.DHT_SLOW, round(claim_at - 0.01, 3), slow, length=0.05, amount=STORE_SECONDS)]
    return simulate(seed, scenario, manifest=manifest, faults=faults)


@pytest.mark.parametrize("shards", sorted(CASES))
def test_a_claim_stored_slower_than_the_rank_window_never_gives_a_term_two_publishers(shards):
    result = split_election(shards)
    assert result.ok, f"{result.violation}\nfaults: {[f.describe() for f in result.faults]}"
    lines = result.trace_text.splitlines()
    _, _, slow, _, shard = CASES[shards]
    # the race happened (two claims of the shard's first term), and the slow claimant yielded
    first = [line for line in lines if f' claim {{"shard": {shard}, "term": 1}}' in line]
    assert len(first) == 2, first
    assert any(f"node-{slow} note" in line and "yielded" in line for line in lines), "no yield"
    assert all(v > 0 for v in result.versions), result.versions  # and the run went on
