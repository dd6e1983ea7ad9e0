"""Sim tier: a generic adversary of K unlisted keys against a public run (issue #27).

The run: 4 honest learners on a public manifest (`[trust]` authority, two listed synchronizers,
`learners = "any"`), on the fake clock. The adversary (`tests/support/sim_adversary.py`): K keys that no
manifest lists, each playing a set of strategies hypothesis draws from forged heartbeats and branch tips
(all keys reporting one forged tip), forged leases, poisoned self-consistent snapshots, update logs of
replayed and forged records, pushed replays and forgeries, hostile deltas and far-future eval histories.

Runs: K = 64 keys playing every strategy, for seeds 0-2 (explicit examples), then 3 hypothesis draws over
seeds 0-2 (each run and its quiet twin cost ~8 s: CI's time budget bounds the count).

Property (trust flows only from the run authority): with the adversary present, every honest replica
ends bit-identical to the same seeded run without it (digest of every replica equal to the quiet run's);
no honest peer ever follows an unlisted key as synchronizer; every update any honest peer applied was led
by a listed synchronizer; and an evaluator reading the run's eval histories holds no stranger's point.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from p2p_diloco.config import ModelConfig, RunManifest, TrustConfig
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec
from p2p_diloco.wire.keys import eval_key
from p2p_diloco.wire.observe import admit_histories, decode_eval_history
from tests.support.sim_adversary import STRATEGIES, SimAdversary

pytestmark = [pytest.mark.sim, pytest.mark.slow]

LEARNERS = 4
DURATION = 40.0
HONEST = tuple("Qm" + "h" * 40 + c * 4 for c in "ABCD")


@functools.cache
def public_manifest() -> RunManifest:
    base = RunManifest.load("peers/demo.toml")
    return dataclasses.replace(
        base,
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
        # The default fanout: a relay tree over 4 honest peers and K fresh keys; the fresh keys rank below
        # every peer a signed record names (`swarm.relay`), so they cannot delay an honest peer's update.
        diloco=dataclasses.replace(base.diloco, inner_steps=8, batch_size=8),
        trust=TrustConfig(authority=HONEST[0], synchronizers=HONEST[:2]),
        robust=dataclasses.replace(base.robust, loss_check="off"),  # refused long before; saves time
    )


def spec(seed: int) -> SwarmSpec:
    return SwarmSpec(
        manifest=public_manifest(),
        learners=LEARNERS,
        duration=DURATION,
        eval_every=DURATION,
        eval_batches=2,
        seed=seed,
        peer_ids=HONEST,
    )


@functools.cache
def quiet_digests(seed: int) -> tuple[str, ...]:
    swarm = InProcessSwarm(spec(seed))
    swarm.run()
    return tuple(sorted(peer.replica.digest() for peer in swarm.peers.values()))


@settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@example(seed=0, k=64, picks=[frozenset(STRATEGIES)] * 64)
@example(seed=1, k=64, picks=[frozenset(STRATEGIES)] * 64)
@example(seed=2, k=64, picks=[frozenset(STRATEGIES)] * 64)
@given(
    seed=st.integers(min_value=0, max_value=2),
    k=st.sampled_from([2, 8, 64]),
    picks=st.lists(st.frozensets(st.sampled_from(STRATEGIES), min_size=1), min_size=64, max_size=64),
)
def test_unlisted_keys_change_nothing_an_honest_replica_holds(seed, k, picks):
    swarm = InProcessSwarm(spec(seed))
    adversary = SimAdversary(swarm, picks[:k], seed=seed)
    adversary.install()
    swarm.run()
    adversary.watch()
    honest = list(swarm.peers.values())
    assert adversary.followed == set(), "an honest peer followed an unlisted key"
    for peer in honest:
        leaders = {r.leader for p in range(len(peer.replica.versions())) for r in peer.book.log.records(p)}
        assert leaders <= set(HONEST[:2]), leaders
    assert all(v >= 3 for v in honest[0].replica.versions()), honest[0].replica.versions()
    assert tuple(sorted(peer.replica.digest() for peer in honest)) == quiet_digests(seed)
    m = swarm.manifest
    stored = swarm.kv.get(eval_key(m.run_id, m.manifest_hash), swarm.clock.now())
    decoded = {w: decode_eval_history(v.value, m.diloco.fragments) for w, v in stored.items()}
    admitted = admit_histories(decoded, may_evaluate=m.may_evaluate, now=swarm.clock.now(), max_skew=60.0)
    assert not any(p.evaluator in adversary.ids for h in admitted.records.values() for p in h.points)
