"""Run manifests: loading, validation messages that name the key, and the hash that separates runs."""

from __future__ import annotations

import pytest

from p2p_diloco.config import DilocoConfig, RunManifest
from p2p_diloco.errors import ConfigError


def test_demo_manifest_loads_with_every_section():
    m = RunManifest.load("peers/demo.toml")
    assert m.run_id == "demo" and m.diloco.fragments == 4 and m.robust.enabled
    assert len(m.manifest_hash) == 16


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"diloco": {"fragments": 4}}, "run_id"),
        ({"run_id": "x", "dilocoo": {}}, "unknown top-level keys"),
        ({"run_id": "x", "diloco": {"H": 3}}, "unknown keys in [diloco]"),
        (
            {"run_id": "x", "diloco": {"inner_steps": 2, "fragments": 4}},
            "[diloco] inner_steps = 2: must be >= fragments (P = 4)",
        ),
        ({"run_id": "x", "wire": {"codec": "int4"}}, "[wire] codec = 'int4' (a string): must be one of"),
        ({"run_id": "x", "robust": {"cooldown": 0}}, "robust.cooldown"),
        ({"run_id": "bad id!"}, "run_id = 'bad id!': must be 1-64 characters"),
        ({"run_id": "x", "allowlist": "Qm"}, "allowlist = 'Qm' (a string): must be a list of strings"),
    ],
)
def test_bad_manifests_say_what_to_fix(raw, words):
    with pytest.raises(ConfigError, match=None) as info:
        RunManifest.from_dict(raw)
    assert words in str(info.value)


def test_missing_or_broken_manifest_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        RunManifest.load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("run_id = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        RunManifest.load(bad)


def test_hash_covers_every_knob_but_not_bootstrap_addresses():
    base = RunManifest(run_id="x")
    assert RunManifest(run_id="x", diloco=DilocoConfig(outer_lr=0.5)).manifest_hash != base.manifest_hash
    assert (
        RunManifest.from_dict({"run_id": "x", "robust": {"enabled": False}}).manifest_hash
        != base.manifest_hash
    )
    assert (
        RunManifest(run_id="x", bootstrap=("/ip4/1.2.3.4/tcp/1/p2p/Qm",)).manifest_hash == base.manifest_hash
    )
