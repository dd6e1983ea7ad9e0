"""The baseline's optimizer factory, hivemind run ID and checkpoint file (no network)."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.baseline.checkpoint import load_checkpoint, save_checkpoint
from p2p_diloco.baseline.elastic import ElasticSettings, OptimizerTimer, hivemind_run_id, optimizer_factory
from p2p_diloco.config import DilocoConfig, ModelConfig, RunManifest
from p2p_diloco.model import build_model, make_inner_optimizer

TINY = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)


def manifest(run_id: str = "base", **model) -> RunManifest:
    return RunManifest(run_id=run_id, model=ModelConfig(**{**TINY.__dict__, **model}))


def test_run_id_is_per_manifest_and_has_no_dots():
    a, b = manifest("run.v1"), manifest("run.v1", n_embd=32)
    assert "." not in hivemind_run_id(a)
    assert hivemind_run_id(a).endswith("-baseline")
    assert hivemind_run_id(a) != hivemind_run_id(b)


def test_settings_refuse_an_unknown_compression():
    with pytest.raises(ValueError, match="compression"):
        ElasticSettings("r", 16, 8, 1.0, 5.0, 30.0, 1, 10.0, compression="int8")


def test_factory_reproduces_the_learners_adamw_and_times_its_steps():
    model = build_model(TINY)
    diloco = DilocoConfig(inner_lr=1e-3, inner_weight_decay=0.05)
    reference = make_inner_optimizer(model, diloco.inner_lr, diloco.inner_weight_decay)
    timer = OptimizerTimer()
    groups, factory = optimizer_factory(model, diloco, timer)
    assert [[id(p) for p in g["params"]] for g in groups] == [
        [id(p) for p in g["params"]] for g in reference.param_groups
    ]
    built = factory(groups)
    assert type(built) is type(reference)
    for mine, theirs in zip(built.param_groups, reference.param_groups, strict=True):
        for key in ("lr", "betas", "eps", "weight_decay", "foreach"):
            assert mine[key] == theirs[key], key
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert timer.seconds == 0.0
    built.step()
    assert timer.seconds > 0.0


def test_checkpoint_round_trip_and_refusals(tmp_path):
    m = manifest()
    model = build_model(m.model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    path = tmp_path / "baseline.pt"
    save_checkpoint(path, m, model, {"state": {"local_epoch": 7}, "param_groups": []}, epoch=7)

    loaded, why = load_checkpoint(path, m, build_model(m.model))
    assert why == "" and loaded is not None and loaded.epoch == 7
    for name, p in model.named_parameters():
        assert torch.equal(loaded.parameters[name], p.detach())
    assert loaded.optimizer["state"]["local_epoch"] == 7

    other_run, why = load_checkpoint(path, manifest("other"), build_model(m.model))
    assert other_run is None and "belongs to run" in why
    wider = manifest(n_embd=32)
    mismatch, why = load_checkpoint(path, m, build_model(wider.model))
    assert mismatch is None and "do not match" in why
    path.write_bytes(b"torn")
    torn, why = load_checkpoint(path, m, model)
    assert torn is None and why.startswith("unreadable")
    assert load_checkpoint(tmp_path / "absent.pt", m, model) == (None, "no checkpoint")
