"""Sim tier: the swarm-scale measurement (`sim.bottle.scale`, `scripts/bench_swarm.py --sim-peers`) at its
smallest size, through the same code that writes `sim_peers.json` at 16, 64 and 256 peers."""

from __future__ import annotations

import json

import pytest

from p2p_diloco.sim.bottle.scale import sim_peers_main

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
    sim_peers_main([6], tmp_path, warmup=10.0, window=12.0, quiet=25.0, say=lambda line: None)
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
