"""Synchronous DiLoCo for real: a bootstrap and two `p2p-diloco baseline-worker --mode diloco` processes.

Both train a tiny model for H = 4 inner steps per round and all-reduce their outer gradients through
hivemind. They start from epoch-0 checkpoints whose global models differ in one weight (as after two
peers each stepped alone at one epoch): in the first round the one whose outer state has the greater
digest drops the round and loads the other's state before it steps. Checked then: every round was
averaged in a group of two and both peers stepped to the same global model, which differs from what
either would have reached with its own outer gradient alone (so the all-reduce really averaged); one worker is SIGKILLed (its whole process group) and restarted with the
same identity and state dir, finds the other ahead, loads its state and averages with it again; both
exit 0 on SIGTERM, and the accounting over both logs is consistent. Every wait has a deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from p2p_diloco.baseline.checkpoint import CHECKPOINT_FILE, save_checkpoint
from p2p_diloco.baseline.diloco import outer_state_digest
from p2p_diloco.config import RunManifest
from p2p_diloco.model import build_model
from p2p_diloco.model.gpt import make_inner_optimizer
from p2p_diloco.node.state import read_events
from tests.support.baseline_workers import accounting, prepare_workers, stop_workers, worker_args

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY_MANIFEST = """
run_id = "diloco-itest"
[diloco]
inner_steps = 4
batch_size = 8
outer_lr = 0.7
outer_momentum = 0.9
[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
"""
START_TIMEOUT = 90.0  # imports, DHT, averager and tracker on a loaded 2-core machine
STOP_TIMEOUT = 30.0


def rounds(state: Path, after: float = 0.0) -> dict[int, dict]:
    """Averaged global steps by epoch."""
    return {
        e["epoch"]: e
        for e in read_events(state)
        if e.get("event") == "global_step" and e["outcome"] == "averaged" and e["t"] > after
    }


def model_moves(state: Path) -> list[dict]:
    """The events that change (or refuse to change) a worker's global model, in order."""
    return [
        e for e in read_events(state) if e["event"] in ("global_models_differ", "reloaded", "global_step")
    ]


def diverged_checkpoints(manifest_path: Path, dirs: dict[str, Path]) -> str:
    """Epoch-0 checkpoints whose global models differ in one weight (as after two peers each stepped
    alone at one epoch); the name of the worker whose outer state has the greater digest (it must
    reload)."""
    manifest = RunManifest.load(manifest_path)
    digests = {}
    for nudge, (name, state) in enumerate(dirs.items()):
        model = build_model(manifest.model)
        with torch.no_grad():
            next(iter(model.parameters())).view(-1)[0] += 1e-3 * nudge
        momentum = [torch.zeros_like(p) for p in model.parameters()]
        inner = make_inner_optimizer(model, manifest.diloco.inner_lr, manifest.diloco.inner_weight_decay)
        optimizer = {"mode": "diloco", "inner": inner.state_dict(), "momentum": momentum}
        state.mkdir(parents=True, exist_ok=True)
        save_checkpoint(state / CHECKPOINT_FILE, manifest, model, optimizer, epoch=0)
        digests[name] = outer_state_digest(model, momentum)
    assert len(set(digests.values())) == len(digests)
    return max(digests, key=digests.__getitem__)


def test_two_diloco_workers_average_outer_gradients_and_survive_a_kill(
    tmp_path, bootstrap_node, spawn, cli, wait_for
):
    manifest_path, dirs, keys = prepare_workers(tmp_path, TINY_MANIFEST)
    reloader = diverged_checkpoints(manifest_path, dirs)

    def start(name: str):
        return spawn(
            cli(*worker_args(manifest_path, bootstrap_node, keys[name], dirs[name], "--mode", "diloco"))
        )

    procs = {name: start(name) for name in dirs}
    for proc in procs.values():
        proc.wait_for_lines("diloco worker joined", timeout=START_TIMEOUT)
    wait_for(
        lambda: all(len(rounds(d)) >= 3 for d in dirs.values()),
        START_TIMEOUT,
        "both workers to average 3 rounds",
    )
    first, second = rounds(dirs["w1"]), rounds(dirs["w2"])
    for epoch in sorted(set(first) & set(second)):
        a, b = first[epoch], second[epoch]
        assert a["group_size"] == b["group_size"] == 2
        assert a["digest"] == b["digest"], f"the global models differ after round {epoch}"
        assert a["local_digest"] != b["local_digest"], "both peers computed the same outer gradient"
        assert a["digest"] not in (a["local_digest"], b["local_digest"]), "the outer step did not average"

    # the first round's members held different models: the one with the greater digest dropped the
    # round and loaded the other's state before it stepped; the other stepped
    for name, state in dirs.items():
        moves = model_moves(state)
        if name == reloader:  # (met again at epoch 0 if the other's first all-reduce failed: differ again)
            differ = moves[0]
            then = next(e for e in moves if e["event"] != "global_models_differ")
            assert (differ["event"], differ["epoch"], differ["action"]) == (
                "global_models_differ",
                0,
                "reload",
            )
            assert then["event"] == "reloaded" and then["epoch"] >= 1, moves[:3]
        else:
            assert moves[0]["event"] == "global_step" and moves[0]["outcome"] == "averaged", moves[:2]
            assert not any(e["event"] == "global_models_differ" for e in moves), name

    for name, state in dirs.items():
        alone = [
            e for e in read_events(state) if e.get("event") == "global_step" and e["outcome"] != "averaged"
        ]
        assert not alone, f"{name} stepped without the other while both were up: {alone[:3]}"

    # crash w2 like a machine would: the whole group, no clean shutdown
    procs["w2"].kill_group()
    killed_at = time.time()
    epoch_at_kill = max(first)
    time.sleep(2)  # w1 goes on alone meanwhile
    procs["w2"] = start("w2")
    procs["w2"].wait_for_lines("diloco worker joined", timeout=START_TIMEOUT)
    wait_for(
        lambda: len(set(rounds(dirs["w1"], killed_at)) & set(rounds(dirs["w2"], killed_at))) >= 2,
        START_TIMEOUT,
        "both workers to average 2 rounds together after the restart",
    )
    starts = [e for e in read_events(dirs["w2"]) if e["event"] == "start"]
    assert len(starts) == 2
    after1, after2 = rounds(dirs["w1"], killed_at), rounds(dirs["w2"], killed_at)
    shared = sorted(set(after1) & set(after2))
    assert shared[0] > epoch_at_kill, "the restarted worker began again from an old epoch"
    for epoch in shared:
        assert after1[epoch]["digest"] == after2[epoch]["digest"], f"global models differ at epoch {epoch}"
    reloaded = [e for e in read_events(dirs["w2"]) if e["event"] == "reloaded" and e["t"] > killed_at]
    for name, state in dirs.items():  # a member whose model differed from its round's reloads before it steps
        moves = model_moves(state)
        for differ, after in zip(moves, moves[1:], strict=False):
            if differ["event"] == "global_models_differ":
                assert after["event"] in ("reloaded", "global_models_differ"), (
                    f"{name} after {differ}: {after}"
                )
    restored = starts[1]["restored_epoch"]
    assert reloaded or restored is not None, "neither the checkpoint nor a peer's state was loaded"

    stop_workers(procs, STOP_TIMEOUT)

    # the saved global models moved away from the initial weights
    manifest = RunManifest.load(manifest_path)
    origin = {n: p.detach() for n, p in build_model(manifest.model).named_parameters()}
    saved = {n: torch.load(d / CHECKPOINT_FILE, weights_only=False) for n, d in dirs.items()}
    for blob in saved.values():
        assert blob["optimizer"]["mode"] == "diloco"
        moved = sum(float((blob["parameters"][k] - origin[k]).norm()) for k in origin)
        assert moved > 0.1, f"the global model barely moved ({moved})"
    if saved["w1"]["epoch"] == saved["w2"]["epoch"]:
        for k in origin:
            assert torch.equal(saved["w1"]["parameters"][k], saved["w2"]["parameters"][k]), k

    logs, report = accounting(dirs)
    assert 0 < report["goodput"] <= report["compute_fraction"] <= 1.0
    assert 0 < report["blocked_fraction"] and report["compute_fraction"] + report["blocked_fraction"] <= 1.0
    for name in dirs:
        assert report["per_peer"][name]["bytes_sent"] > 0
    print(
        f"measured: goodput {report['goodput']:.4f} compute {report['compute_fraction']:.4f} "
        f"blocked {report['blocked_fraction']:.3f} over {report['wall_seconds']:.1f} s, rounds "
        f"w1 {max(rounds(dirs['w1']))} w2 {max(rounds(dirs['w2']))}"
    )
