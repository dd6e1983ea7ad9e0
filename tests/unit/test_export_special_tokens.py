"""`export --format hf` sets the model config's special token ids from the run's tokenizer (GPT-2's 50256
outside a small vocabulary, Qwen2's missing eos) and carries the manifest's dropout; a pretrained run
exports from its own config."""

from __future__ import annotations

import json

from test_export import state_dir_with_replica  # tests/unit is on sys.path (rootdir imports)

from p2p_diloco.model.prepare import prepare, train_tokenizer
from p2p_diloco.model.shards import index_digest
from p2p_diloco.node.export import SPECIAL_TOKEN_IDS, export_hf
from tests.support.hub_files import tiny_gpt2

GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 16}
QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}


def run(model: dict, data: dict | None = None) -> dict:
    raw = {
        "run_id": "unit-export-tokens",
        "diloco": {"fragments": 2},
        "model": {"kind": "hf", "block_size": 16, **model},
    }
    return {**raw, "data": data} if data else raw


def exported(tmp_path, raw: dict) -> tuple[dict, dict]:
    manifest, _, directory = state_dir_with_replica(tmp_path, raw)
    out = export_hf(manifest, directory, tmp_path / "hf")
    return json.loads((out / "config.json").read_text()), json.loads(
        (out / "generation_config.json").read_text()
    )


def test_a_bytes_run_of_gpt2_exports_no_special_ids_outside_its_vocabulary(tmp_path):
    config, generation = exported(tmp_path, run({"config": GPT2}))
    for key in SPECIAL_TOKEN_IDS:
        assert config.get(key) is None and generation.get(key) is None, key
    assert (config["attn_pdrop"], config["resid_pdrop"], config["embd_pdrop"]) == (0.0, 0.0, 0.0)


def test_a_qwen2_run_on_shards_exports_the_tokenizers_end_of_text_id(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = train_tokenizer([], tmp_path / "tok.json", vocab_size=300, builtin=True)
    index = prepare([], tmp_path / "data", tokenizer=str(tokenizer), builtin=True, eval_fraction=0.25)
    data = {"source": "shards", "shards": str(tmp_path / "data"), "digest": index_digest(index)}
    config, generation = exported(tmp_path, run({"config": QWEN2}, data))
    assert index["tokenizer"]["eos_id"] == 0
    for key in SPECIAL_TOKEN_IDS:
        assert config[key] == 0 and generation[key] == 0, key
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (loaded.eos_token_id, loaded.bos_token_id, loaded.pad_token_id) == (0, 0, 0)


def test_a_pretrained_run_exports_from_its_folder_with_the_manifest_dropout(tmp_path):
    tiny_gpt2(tmp_path / "tiny")
    config, _ = exported(tmp_path, run({"pretrained": str(tmp_path / "tiny"), "dropout": 0.05}))
    assert config["n_embd"] == 32 and config["attn_pdrop"] == 0.05
    assert config.get("eos_token_id") is None
