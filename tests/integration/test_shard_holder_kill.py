"""Synchronizer shards with real processes: 6 `join` peers, S = 4 (`[diloco] synchronizer_shards`), one
shard's holder SIGKILLed, then another shard's holder frozen.

The fragments of the other shards keep advancing while that shard fails over (the versions timeline the
peers report, read as `p2p-diloco status` reads it), and the shard gets a new holder and term. A frozen
holder (SIGSTOP: alive but silent) of another shard is waited out and its shard claimed the ordinary way;
thawed, it steps down. After the peers stop training every replica is identical and no update was
applied twice."""

from __future__ import annotations

import os
import signal
import time

import pytest

from p2p_diloco.protocol import shards
from tests.support.real_swarm import (
    START_TIMEOUT,
    Swarm,
    assert_no_update_applied_twice,
    claims_of,
    step_downs,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.soak]

NAMES = ("p0", "p1", "p2", "p3", "p4", "p5")
SHARDS = 4
FRAGMENTS = 4
STEP = "0.3"  # seconds per inner step at least (the last --min-step-time wins)
# slower than the other real-swarm tests: 6 peers (18 processes with their DHT and p2pd) share the cores
TIMING = {
    "heartbeat_period": 1.0,
    "heartbeat_ttl": 4.0,
    "lease_ttl": 6.0,
    "claim_grace": 2.0,
    "lease_margin": 1.0,
}


def held(status: dict) -> dict[int, tuple[str, int]]:
    """shard -> (holder, term) of every shard with a live holder."""
    return {
        row["shard"]: (row["synchronizer"]["peer_id"], row["synchronizer"]["term"])
        for row in status.get("shards", [])
        if row["synchronizer"] is not None
    }


def versions(status: dict) -> list[int]:
    return [f["version"] for f in status["fragments"]]


def test_a_killed_shard_holder_stalls_only_its_shard(
    spawn, cli, wait_for, start_bootstrap, dht_peers, tmp_path
):
    bootstrap = start_bootstrap()
    observer = dht_peers(initial_peers=bootstrap.addresses, client_mode=True)
    diloco = {"fragments": FRAGMENTS, "inner_steps": 8, "synchronizer_shards": SHARDS}
    swarm = Swarm(
        spawn, cli, wait_for, tmp_path, bootstrap, observer, names=NAMES, diloco=diloco, timing=TIMING
    )
    for name in NAMES:
        swarm.join(
            name, "--min-step-time", STEP
        )  # paced: 6 peers on 2 cores must not starve their heartbeats
    before = swarm.wait_status(
        lambda s: len(held(s)) == SHARDS and len(s["peers"]) == len(NAMES) and min(versions(s) or [0]) >= 2,
        START_TIMEOUT + 60,
        "every shard held and every fragment merged twice",
    )
    holders = held(before)
    # the shards spread: 6 candidates, at most ceil(4 / 6) = 1 shard each (a claim race may briefly give 2)
    assert len({holder for holder, _ in holders.values()}) >= SHARDS - 1, holders
    shard = next(s for s, (h, _) in holders.items() if sum(x == h for x, _ in holders.values()) == 1)
    mine = set(shards.fragments_of(shard, SHARDS, FRAGMENTS))
    # the holder names the shard's successor in every renewal: two renewals in a row naming the same peer,
    # so the successor has read one and watches the holder (on a loaded machine the ranking, and so the
    # named successor, can change between renewals: the pair is looked for as long as it takes)
    renewals: list = []

    def renewed_naming_one_successor():  # noqa: ANN202
        lease = swarm.live_lease(with_successor=True, shard=shard)
        if lease is None or (renewals and lease.expires_at <= renewals[-1].expires_at):
            return None
        renewals.append(lease)
        same = len(renewals) >= 2 and (lease.holder, lease.term, lease.successor) == (
            renewals[-2].holder,
            renewals[-2].term,
            renewals[-2].successor,
        )
        return lease if same else None

    lease = swarm.wait_for(
        renewed_naming_one_successor, 60, f"two renewals of shard {shard}'s lease naming the same successor"
    )
    victim_id, term = lease.holder, lease.term  # a claim race may have moved the shard since `before`
    assert victim_id in {j.peer_id for j in swarm.peers.values()}, (lease, holders)
    victim = swarm.by_id(victim_id)
    killed_at = time.monotonic()
    victim.handle.kill_group()
    # heartbeats report versions up to a period late: what the dead holder published shows within `settle`
    settle = 2 * swarm.manifest.timing.heartbeat_period
    timeline: list[tuple[float, list[int]]] = []

    def frozen() -> dict[int, int]:
        return {p: max(v[p] for t, v in timeline if t <= settle) for p in mine}

    def resumed(status: dict) -> bool:
        timeline.append((time.monotonic() - killed_at, versions(status)))
        new = held(status).get(shard)
        if timeline[-1][0] <= settle or new is None or new[1] <= term:
            return False
        return all(timeline[-1][1][p] > v for p, v in frozen().items())

    after = swarm.wait_status(resumed, 60.0, f"shard {shard} failed over and merged again")
    assert held(after)[shard][0] != victim_id
    # its named successor saw the holder's connections refused and claimed at once, for this shard only
    claim = min((c for j in swarm.live() for c in claims_of(j, term, shard)), key=lambda c: c["t"])
    assert claim["reason"].startswith("succession"), claim
    others = [p for p in range(FRAGMENTS) if p not in mine]
    # before the shard merged again (its resumption is read from heartbeats, at least `settle` after the
    # kill) the other shards' fragments moved on
    before = timeline[:-1]
    start = before[0][1]
    moved = [t for t, v in before if any(v[p] > start[p] for p in others)]
    print(
        f"measured: shard {shard} merged again {timeline[-1][0]:.2f} s after the kill; others moved at {moved[:3]}"
    )
    assert moved, timeline

    # a frozen holder of another shard (connections hang, not refused): silence is not death, so its
    # shard is claimed only once its lease has run out, and the thawed zombie steps down
    timing = swarm.manifest.timing
    holders = held(swarm.wait_status(lambda s: len(held(s)) == SHARDS, 30, "every shard held again"))
    alone = [
        s for s, (h, _) in holders.items() if s != shard and sum(x == h for x, _ in holders.values()) == 1
    ]
    frozen_shard = (alone or [s for s in holders if s != shard])[0]
    zombie_id, frozen_term = holders[frozen_shard]
    zombie = swarm.by_id(zombie_id)
    downs = step_downs(zombie)
    frozen_at = time.time()
    os.killpg(zombie.handle.pid, signal.SIGSTOP)  # python, its DHT child and p2pd
    try:
        others = [j for j in swarm.live() if j is not zombie]
        taken = swarm.wait_for(
            lambda: next((c for j in others for c in claims_of(j, frozen_term, frozen_shard)), None),
            timing.lease_ttl + timing.lease_margin + 3 * timing.claim_grace + 30,
            f"another peer to claim shard {frozen_shard} after the frozen holder's lease",
        )
        assert not taken["reason"].startswith("succession"), taken
        print(f"measured: shard {frozen_shard}'s holder frozen -> claimed by another peer "
              f"{taken['t'] - frozen_at:.2f} s (lease_ttl {timing.lease_ttl} s)")  # fmt: skip
    finally:
        os.killpg(zombie.handle.pid, signal.SIGCONT)
    swarm.wait_for(lambda: step_downs(zombie) > downs, 30, "the thawed zombie to step down")

    settled = swarm.quiesce(len(NAMES) - 1, timeout=90.0)
    assert held(settled)[frozen_shard][1] > frozen_term
    assert len({p["digest"] for p in settled["peers"]}) == 1
    swarm.stop_all()
    assert_no_update_applied_twice(swarm)
