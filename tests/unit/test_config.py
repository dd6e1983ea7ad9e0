"""Run manifests: loading, validation messages that name the key, and the hash that separates runs."""

from __future__ import annotations

import dataclasses
import re

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
        ({"run_id": "x", "robust": {"cooldown": 0}}, "[robust] cooldown = 0: must be > 0"),
        ({"run_id": "bad id!"}, "run_id = 'bad id!': must be 1-64 characters"),
        ({"run_id": "x", "allowlist": "Qm"}, "allowlist = 'Qm' (a string): must be a list of strings"),
    ],
)
def test_bad_manifests_say_what_to_fix(raw, words):
    with pytest.raises(ConfigError, match=None) as info:
        RunManifest.from_dict(raw)
    assert words in str(info.value)


def test_each_problem_is_one_line_naming_the_key_path_the_value_what_is_allowed_and_the_fix():
    raw = {
        "run_id": "x",
        "diloco": {"fragments": 0, "grace_gamma": 1, "blend_alpha": "0.5", "merge_rule": "max"},
    }
    with pytest.raises(ConfigError) as info:
        RunManifest.from_dict(raw, where="run.toml")
    assert str(info.value).splitlines() == [  # types first: a range is not checked on a wrong type
        "run.toml: [diloco] merge_rule = 'max' (a string): must be one of 'rda', 'mean'; fix merge_rule under [diloco]",
        "run.toml: [diloco] blend_alpha = '0.5' (a string): must be a number; "
        "write blend_alpha = 0.5 under [diloco], without quotes",
    ]
    del raw["diloco"]["blend_alpha"], raw["diloco"]["merge_rule"]
    with pytest.raises(ConfigError) as info:
        RunManifest.from_dict(raw, where="run.toml")
    assert str(info.value).splitlines() == [
        "run.toml: [diloco] fragments = 0: must be >= 1 (P, parts of the model synchronized in turn); "
        "set fragments under [diloco] to a value >= 1",
        "run.toml: [diloco] grace_gamma = 1: must be in [0, 1) (gamma of the adaptive grace window); "
        "set grace_gamma under [diloco] to a value in [0, 1)",
    ]


def test_sections_are_frozen_dataclasses_that_validate_on_replace():
    config = DilocoConfig(inner_steps=8, fragments=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.fragments = 3  # type: ignore[misc]
    assert dataclasses.replace(config, fragments=4).steps_per_fragment == 2
    with pytest.raises(
        ConfigError, match=re.escape("[diloco] inner_steps = 8: must be >= fragments (P = 16)")
    ):
        dataclasses.replace(config, fragments=16)
    assert dataclasses.asdict(RunManifest(run_id="x", diloco=config))["diloco"]["fragments"] == 2
    # an integer written for a float key stays an integer: the manifest hash sees what was written
    assert RunManifest.from_dict({"run_id": "x", "diloco": {"outer_lr": 1}}).diloco.outer_lr.__class__ is int


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
