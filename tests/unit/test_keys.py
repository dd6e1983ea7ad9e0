"""DHT keys and protocol IDs: every name carries the run and manifest, and they never collide."""

from __future__ import annotations

import itertools

import pytest

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.wire import keys

H1, H2 = "0123456789abcdef", "fedcba9876543210"
BUILDERS = [
    keys.heartbeat_key,
    keys.lease_key,
    keys.update_log_key,
    keys.snapshot_key,
    keys.eval_key,
    keys.stats_key,
]


def all_names(run_id: str, manifest_hash: str) -> list[str]:
    names = [build(run_id, manifest_hash) for build in BUILDERS]
    return names + [keys.protocol_id(run_id, manifest_hash, op) for op in keys.TRANSPORT_OPS]


def test_every_name_contains_run_id_and_manifest_hash():
    for name in all_names("demo-run", H1):
        assert "demo-run" in name and H1 in name


def test_names_differ_across_records_runs_and_manifests():
    groups = [all_names(run, h) for run, h in itertools.product(["a", "b"], [H1, H2])]
    flat = [name for group in groups for name in group]
    assert len(flat) == len(set(flat))


def test_key_shape_is_namespace_underscore_record():
    assert keys.heartbeat_key("demo", H1) == f"p2p_diloco/demo/{H1}_heartbeat"
    assert keys.lease_key("demo", H1).startswith(keys.namespace("demo", H1) + "_")
    assert keys.protocol_id("demo", H1, keys.OP_DELTA) == f"/p2p-diloco/demo/{H1}/delta/1"


def test_real_manifest_hash_is_accepted():
    manifest = RunManifest(run_id="demo")
    assert manifest.manifest_hash in keys.lease_key(manifest.run_id, manifest.manifest_hash)


@pytest.mark.parametrize(
    "run_id, manifest_hash, match",
    [
        ("bad/run", H1, "run_id"),
        ("", H1, "run_id"),
        ("demo", "XYZ", "manifest hash"),
        ("demo", H1.upper(), "manifest"),
    ],
)
def test_bad_inputs_are_refused(run_id, manifest_hash, match):
    with pytest.raises(ConfigError, match=match):
        keys.heartbeat_key(run_id, manifest_hash)


def test_unknown_record_or_op_is_refused():
    with pytest.raises(ValueError, match="unknown record"):
        keys.record_key("demo", H1, "gossip")
    with pytest.raises(ValueError, match="unknown transport op"):
        keys.protocol_id("demo", H1, "gossip")
