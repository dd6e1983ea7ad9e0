"""A real run end to end: tokenizer and shards prepared offline, a small Llama, a bootstrap and two `join`s.

`test_llama_swarm_learns_and_exports_to_transformers` trains a test-sized Llama (``kind = "hf"``) with
bf16 autocast, clipping, warmup + cosine and activation checkpointing on prepared token shards, checks
that the global model's held-out eval loss falls, then exports it with ``export --format hf`` and loads
and samples it with transformers. The refusal tests start `join` on a corrupted copy of the data and on
a manifest naming a missing weights file, and check the messages. Measurements print as ``measured:``
lines (``-s``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import evaluate, load_corpus
from p2p_diloco.model.gpt import build_model
from p2p_diloco.model.prepare import prepare, train_tokenizer
from p2p_diloco.model.shards import index_digest
from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.export import ExportError, load_global_replica

pytestmark = [pytest.mark.integration, pytest.mark.soak]

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 120.0
TRAIN_SECONDS = 240.0  # upper bound; the test goes on as soon as enough updates were merged

MANIFEST = """
run_id = "real-run-test"
[diloco]
inner_steps = 8
fragments = 2
max_in_flight = 2
min_quorum = 1
batch_size = 8
inner_lr = 3e-3
outer_lr = 1.0
outer_momentum = 0.0
[model]
kind = "hf"
block_size = 64
seed = 3
{model_extra}
[model.config]
model_type = "llama"
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 64
[data]
source = "shards"
shards = "{shards}"
digest = "{digest}"
[train]
precision = "bf16"
grad_clip = 1.0
lr_schedule = "cosine"
warmup_steps = 10
decay_steps = 2000
activation_checkpointing = true
loss_every = 4
[timing]
heartbeat_period = 0.5
heartbeat_ttl = 2.0
lease_ttl = 3.0
claim_grace = 1.0
lease_margin = 0.5
term_rounds = 1000
rejoin_grace = 30.0
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 512-token BPE tokenizer and shards of Python's bundled text, prepared offline."""
    folder = tmp_path_factory.mktemp("data")
    tokenizer = train_tokenizer([], folder / "tokenizer.json", vocab_size=512, builtin=True)
    index = prepare([], folder / "shards", tokenizer=str(tokenizer), builtin=True, shard_tokens=60_000)
    return folder / "shards", index_digest(index)


def write_manifest(path: Path, shards: Path, digest: str, model_extra: str = "") -> RunManifest:
    path.write_text(MANIFEST.format(shards=shards, digest=digest, model_extra=model_extra))
    return RunManifest.load(path)


def join_cmd(cli, manifest: Path, tmp: Path, name: str, peers: list[str], *extra: str) -> list[str]:
    identity = tmp / f"{name}.key"
    write_identity(identity, force=True)
    return cli(
        "join", str(manifest), "--initial-peers", *peers, "--identity", str(identity),
        "--state-dir", str(tmp / f"state-{name}"), "--listen", LOOPBACK_LISTEN,
        "--persist-every", "1", "--progress-every", "5", "--display", "plain", *extra,
    )  # fmt: skip


def global_eval_loss(manifest: RunManifest, state_dir: Path, eval_data) -> tuple[float, list[int]]:
    replica, _ = load_global_replica(manifest, state_dir)
    model = build_model(manifest.model)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in replica.export_params().items():
            params[name].copy_(value)
    return evaluate(model, eval_data, block_size=manifest.model.block_size, max_batches=4), list(
        replica.versions()
    )


@pytest.mark.slow
def test_llama_swarm_learns_and_exports_to_transformers(spawn, cli, start_bootstrap, tmp_path, dataset):
    shards, digest = dataset
    manifest_path = tmp_path / "llama.toml"
    manifest = write_manifest(manifest_path, shards, digest)
    eval_data = load_corpus(manifest.data).eval
    initial = evaluate(build_model(manifest.model), eval_data, block_size=64, max_batches=4)

    bootstrap = start_bootstrap()
    peers = [spawn(join_cmd(cli, manifest_path, tmp_path, name, bootstrap.addresses)) for name in ("a", "b")]
    for peer in peers:
        peer.wait_for_lines("joined run real-run-test", timeout=START_TIMEOUT)
    started = time.monotonic()
    state_a = tmp_path / "state-a"
    loss, versions = initial, [0, 0]
    while time.monotonic() - started < TRAIN_SECONDS:
        time.sleep(5)
        for peer in peers:
            assert peer.popen.poll() is None, f"a peer exited:\n{peer.stderr_tail()}"
        try:
            loss, versions = global_eval_loss(manifest, state_a, eval_data)
        except ExportError:
            continue  # no replica persisted yet
        if sum(versions) >= 30 and loss < initial - 1.0:
            break
    elapsed = time.monotonic() - started
    print(f"measured: eval loss {initial:.3f} -> {loss:.3f} after {elapsed:.0f} s, versions {versions}")
    assert sum(versions) >= 10, f"too few merged updates: {versions}"
    assert loss < initial - 0.5, f"global eval loss did not fall: {initial:.3f} -> {loss:.3f}"

    out = tmp_path / "hf-export"
    export = spawn(
        cli("export", str(manifest_path), "--state-dir", str(state_a), "--out", str(out), "--format", "hf")
    )
    assert export.wait(timeout=120) == 0, export.stderr_tail()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    prompt = tokenizer("The with statement", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    text = tokenizer.decode(generated[0])
    print(f"measured: exported model generates {text!r}")
    assert text.startswith("The with statement")


def test_join_refuses_a_corrupt_data_copy_and_a_missing_weights_file(spawn, cli, tmp_path, dataset):
    shards, digest = dataset
    bad_copy = tmp_path / "bad-shards"
    shutil.copytree(shards, bad_copy)
    shard = bad_copy / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    bad_data = tmp_path / "bad-data.toml"
    write_manifest(bad_data, bad_copy, digest)
    missing = tmp_path / "missing-init.toml"
    write_manifest(missing, shards, digest, model_extra='init = "weights/initial.safetensors"')
    runs = {
        "data": (bad_data, "your copy of shard 0 (train-00000.bin)"),
        "init": (missing, "weights/initial.safetensors does not exist"),
    }
    for name, (manifest_path, message) in runs.items():
        handle = spawn(join_cmd(cli, manifest_path, tmp_path, name, []))
        assert handle.wait(timeout=START_TIMEOUT) == 2, handle.stderr_tail()
        stderr = handle.stderr_path.read_text()
        assert message in stderr, stderr[-2000:]
        if name == "data":
            assert "differs from the run's: re-download it" in stderr
