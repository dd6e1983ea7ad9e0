"""Sim tier: the swarm-scale measurement (`sim.bottle.scale`, `scripts/bench_swarm.py --sim-peers`) at its
smallest size, through the same code that writes `sim_peers.json` at 16, 64 and 256 peers."""

from __future__ import annotations

import dataclasses
import json

import pytest

from p2p_diloco.sim.bottle.scale import ScaleRun, SizeResult, pool_plays, sim_peers_main

pytestmark = pytest.mark.sim

FIELDS = (
    "peers",
    "shards",
    "wall_seconds_per_virtual_second_per_peer",
    "busiest_peer_bytes_per_round",
    "holder_inbound_bytes_per_round",
    "propagation_p50_s",
    "propagation_p99_s",
    "terms_held_twice",
    "replicas_equal",
)


def test_smallest_size_writes_every_field_and_holds(tmp_path):
    sim_peers_main(
        [6], tmp_path, warmup=10.0, window=12.0, quiet=25.0, min_window_cpu=0.0, say=lambda line: None
    )
    report = json.loads((tmp_path / "sim_peers.json").read_text())
    (row,) = report["sizes"]
    assert all(key in row for key in FIELDS), sorted(set(FIELDS) - set(row))
    assert row["completed"] and row["violation"] is None, row["violation"]
    assert (row["peers"], row["shards"]) == (6, 1)
    assert row["terms_held_twice"] == 0
    assert row["replicas_equal"] is True
    assert row["wall_seconds_per_virtual_second_per_peer"] > 0
    assert row["busiest_peer_bytes_per_round"] >= row["holder_inbound_bytes_per_round"] > 0
    assert 0 < row["propagation_p50_s"] <= row["propagation_p99_s"]
    assert (tmp_path / "sim_peers.png").stat().st_size > 0
    assert row["detail"]["plays"] == 1
    assert row["detail"]["run"]["young_per_peer"] == 700


def _played(cpu: float, wall: float) -> SizeResult:
    """A size's result with only what pooling reads set (the rest as a finished run would leave it)."""
    unset = {f.name: None for f in dataclasses.fields(SizeResult) if f.default is dataclasses.MISSING}
    return dataclasses.replace(
        SizeResult(**unset),
        peers=16,
        completed=True,
        window_seconds=20.0,
        window_wall_seconds=wall,
        window_cpu_seconds=cpu,
        window_gc_seconds=0.1,
        window_rounds=4.5,
        busiest_peer_bytes_per_round=300.0,
        propagation=[0.1],
    )


def test_plays_pool_their_windows_and_keep_the_first_plays_traffic():
    pooled = pool_plays([_played(6.4, 6.6), _played(4.8, 5.0)])
    assert pooled.plays == 2
    assert pooled.window_cpu_seconds == pytest.approx(11.2) and pooled.window_seconds == 40.0
    assert pooled.cpu_per_virtual_per_peer == pytest.approx(11.2 / 40.0 / 16)
    assert pooled.wall_per_virtual_per_peer == pytest.approx(11.6 / 40.0 / 16)
    assert pooled.rounds_per_play == pytest.approx(4.5)
    assert pooled.cpu_per_round_per_peer == pytest.approx(11.2 / 9.0 / 16)
    assert pooled.cpu_by_play == pytest.approx([6.4 / 20 / 16, 4.8 / 20 / 16])
    assert pooled.busiest_peer_bytes_per_round == 300.0


def test_a_quorum_of_zero_is_sized_with_the_swarm_as_the_shards_are():
    """`ScaleRun.min_quorum`: None keeps the manifest's K, a number sets it, 0 sets K = S."""
    assert ScaleRun(peers=64).manifest().diloco.min_quorum == 1
    assert ScaleRun(peers=64, min_quorum=3).manifest().diloco.min_quorum == 3
    assert ScaleRun(peers=64, min_quorum=0).manifest().diloco.min_quorum == ScaleRun(peers=64).s == 4
