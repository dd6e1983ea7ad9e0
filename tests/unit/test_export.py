"""`p2p-diloco export`: the persisted replica as safetensors, bit for bit, with metadata and clear refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from p2p_diloco.cli import main
from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.node.export import ExportError, export_model, model_plan
from p2p_diloco.node.state import StateDir
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica

TINY = {
    "run_id": "unit-export",
    "diloco": {"fragments": 2},
    "model": {"n_layer": 1, "n_embd": 32, "block_size": 32},
}


def state_dir_with_replica(tmp_path, raw=TINY, *, updates: int = 2):
    """A state directory as `join` leaves it: replica with `updates` applied to fragment 0, peer state."""
    manifest = RunManifest.from_dict(raw)
    model = build_model(manifest.model)
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    plan = plan_fragments(shapes, manifest.diloco.fragments, manifest.diloco.fragment_pattern)
    replica = GlobalReplica(plan, {name: p.detach().clone() for name, p in model.named_parameters()})
    generator = torch.Generator().manual_seed(1)
    for v in range(updates):
        grad = {n: torch.randn(s, generator=generator) * 1e-2 for n, s in replica.shapes(0).items()}
        decision = replica.apply(0, v, grad, lr=0.7, momentum=0.9, expected_checksum=None)
        assert decision.action == "apply", decision
    directory = tmp_path / "state"
    state = StateDir(directory, manifest)
    state.save(replica, "QmExporter", now=100.0, in_sync=True, previous=0.0)
    state.close()
    return manifest, replica, directory


def test_export_round_trips_bit_for_bit_with_metadata(tmp_path):
    manifest, replica, directory = state_dir_with_replica(tmp_path)
    assert model_plan(manifest).names(0) == replica.plan.names(0)  # meta-device plan == join's plan
    out = tmp_path / "model.safetensors"
    metadata = export_model(manifest, directory, out)

    loaded = load_file(str(out))
    expected = replica.export_params()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].view(torch.int32), tensor.view(torch.int32)), name  # bit for bit
    with safe_open(str(out), framework="pt") as f:
        stored = f.metadata()
    assert stored == metadata
    assert stored["run_id"] == "unit-export" and stored["manifest_hash"] == manifest.manifest_hash
    assert json.loads(stored["versions"]) == [2, 0] and stored["digest"] == replica.digest()
    assert stored["peer_id"] == "QmExporter" and json.loads(stored["model"])["n_embd"] == 32
    # and the weights load into the model the manifest describes
    model = build_model(manifest.model)
    model.load_state_dict(loaded, strict=True)


def test_refuses_to_overwrite_without_force(tmp_path):
    manifest, replica, directory = state_dir_with_replica(tmp_path, updates=0)
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(ExportError, match="--force"):
        export_model(manifest, directory, out)
    assert out.read_bytes() == b"keep me"
    export_model(manifest, directory, out, force=True)
    assert set(load_file(str(out))) == set(replica.export_params())


def test_clear_errors_for_missing_corrupt_or_foreign_state(tmp_path):
    manifest, _, directory = state_dir_with_replica(tmp_path, updates=0)
    out = tmp_path / "m.safetensors"
    with pytest.raises(ExportError, match="does not exist"):
        export_model(manifest, tmp_path / "nowhere", out)
    with pytest.raises(ExportError, match="folder of --out"):
        export_model(manifest, directory, tmp_path / "no-dir" / "m.safetensors")

    other_run = RunManifest.from_dict({**TINY, "run_id": "another-run"})
    with pytest.raises(ExportError, match="belongs to run 'unit-export'"):
        export_model(other_run, directory, out)

    (directory / "peer_state.json").unlink()  # without it, the fragment plan still has to match
    bigger = RunManifest.from_dict({**TINY, "model": {**TINY["model"], "n_layer": 2}})
    with pytest.raises(ExportError, match="different fragment plan"):
        export_model(bigger, directory, out)

    (directory / "replica" / "fragment-00001.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ExportError, match="unreadable"):
        export_model(manifest, directory, out)
    for file in (directory / "replica").iterdir():
        file.unlink()
    with pytest.raises(ExportError, match="holds no replica"):
        export_model(manifest, directory, out)
    assert not out.exists()


def test_cli_export_prints_what_it_wrote_and_exits_2_with_the_reason(tmp_path, capsys):
    manifest, replica, directory = state_dir_with_replica(tmp_path, updates=1)
    manifest_path = tmp_path / "run.toml"
    manifest_path.write_text(
        'run_id = "unit-export"\n[diloco]\nfragments = 2\n[model]\nn_layer = 1\nn_embd = 32\nblock_size = 32\n'
    )
    assert RunManifest.load(manifest_path).manifest_hash == manifest.manifest_hash
    out = tmp_path / "model.safetensors"
    args = ["export", str(manifest_path), "--state-dir", str(directory), "--out", str(out)]
    assert main(args) == 0
    assert f"digest {replica.digest()[:16]}" in capsys.readouterr().out
    assert main(args) == 2
    assert "exists; pass --force" in capsys.readouterr().err
