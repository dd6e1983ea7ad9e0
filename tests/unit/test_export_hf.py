"""`p2p-diloco export --format hf`: a folder transformers loads, tied embeddings included; clear refusals."""

from __future__ import annotations

import pytest
import torch
from test_export import TINY, state_dir_with_replica  # tests/unit is on sys.path (rootdir imports)

from p2p_diloco.errors import ConfigError
from p2p_diloco.node.export import export_hf, model_plan

GPT2 = {
    "run_id": "unit-export-hf",
    "diloco": {"fragments": 2},
    "model": {
        "kind": "hf",
        "block_size": 16,
        "config": {
            "model_type": "gpt2",
            "vocab_size": 256,
            "n_embd": 32,
            "n_layer": 1,
            "n_head": 2,
            "n_positions": 16,
        },
    },
}


def test_hf_export_of_a_tied_gpt2_loads_in_transformers_with_the_replica_weights(tmp_path):
    manifest, replica, directory = state_dir_with_replica(tmp_path, GPT2)
    assert model_plan(manifest).names(0) == replica.plan.names(0)
    assert "hf.lm_head.weight" not in replica.export_params()  # tied to the token embedding
    out = export_hf(manifest, directory, tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    params = dict(model.named_parameters())
    for name, value in replica.export_params().items():
        assert torch.equal(params[name.removeprefix("hf.")], value), name
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    with pytest.raises(ConfigError, match="exists; pass --force"):
        export_hf(manifest, directory, out)
    export_hf(manifest, directory, out, force=True)


def test_hf_export_refuses_a_gpt_run(tmp_path):
    manifest, _, directory = state_dir_with_replica(tmp_path, TINY)
    with pytest.raises(ConfigError, match="--format hf needs a run with .model. kind = 'hf'"):
        export_hf(manifest, directory, tmp_path / "hf")
