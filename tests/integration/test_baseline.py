"""The lock-step baseline for real: a bootstrap and two `p2p-diloco baseline-worker` processes on 127.0.0.1.

Both train a tiny model with gradients averaged through `hivemind.Optimizer`; one is SIGKILLed (its whole
process group, p2pd included) and restarted with the same identity and state directory. Checked: global
steps averaged in groups of two, the restarted worker resumes from saved or downloaded state (not from
epoch 0) and the epoch keeps advancing, both exit 0 on SIGTERM with parameters equal up to float noise,
and the goodput accounting over both event logs is complete and consistent. Every wait has a deadline;
every process group is killed at teardown, also on failure.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from p2p_diloco.baseline.checkpoint import CHECKPOINT_FILE
from p2p_diloco.config import RunManifest
from p2p_diloco.demo.accounting import COUNTERS
from p2p_diloco.model import build_model
from p2p_diloco.node.state import read_events
from tests.support.baseline_workers import accounting, prepare_workers, stop_workers, worker_args

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY_MANIFEST = """
run_id = "baseline-itest"
[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
"""
START_TIMEOUT = 90.0  # imports, DHT, identity check and averagers on a loaded 2-core machine
STOP_TIMEOUT = 30.0


def events_of(state: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_events(state) if kind is None or e.get("event") == kind]


def averaged_epochs(state: Path, after: float = -math.inf) -> list[int]:
    return [
        e["epoch"] for e in events_of(state, "global_step") if e["outcome"] == "averaged" and e["t"] > after
    ]


def max_epoch(state: Path) -> int:
    return max((e["epoch"] for e in events_of(state, "global_step")), default=0)


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], origin) -> float:
    gap = math.sqrt(sum(float(((a[k] - b[k]) ** 2).sum()) for k in a))
    moved = math.sqrt(sum(float(((a[k] - origin[k]) ** 2).sum()) for k in a))
    assert moved > 0.1, f"parameters barely moved from their initial values ({moved})"
    return gap / moved


def test_two_workers_average_survive_a_kill_and_account_their_goodput(
    tmp_path, bootstrap_node, spawn, cli, wait_for
):
    manifest_path, dirs, keys = prepare_workers(tmp_path, TINY_MANIFEST)

    def start(name: str):
        return spawn(cli(*worker_args(manifest_path, bootstrap_node, keys[name], dirs[name])))

    procs = {name: start(name) for name in dirs}
    for proc in procs.values():
        proc.wait_for_lines("baseline worker joined", timeout=START_TIMEOUT)
    wait_for(
        lambda: all(len(averaged_epochs(d)) >= 3 for d in dirs.values()),
        START_TIMEOUT,
        "both workers to average gradients in 3 global steps",
    )

    # crash w2 like a machine would: the whole group, no clean shutdown
    procs["w2"].kill_group()
    killed_at = time.time()
    epoch_at_kill = max(max_epoch(dirs["w1"]), max_epoch(dirs["w2"]))
    procs["w2"] = start("w2")
    procs["w2"].wait_for_lines("baseline worker joined", timeout=START_TIMEOUT)
    wait_for(
        lambda: any(e > epoch_at_kill for e in averaged_epochs(dirs["w2"], after=killed_at)),
        START_TIMEOUT,
        f"the restarted worker to average a global step past epoch {epoch_at_kill}",
    )
    starts = events_of(dirs["w2"], "start")
    assert len(starts) == 2
    resumed = [e for e in events_of(dirs["w2"], "global_step") if e["t"] > killed_at]
    assert min(e["epoch"] for e in resumed) > 1, "the restarted worker began again from epoch 0"
    restored = starts[1]["restored_epoch"] is not None
    reloaded = any(e["t"] > killed_at for e in events_of(dirs["w2"], "reloaded"))
    assert restored or reloaded, "neither the checkpoint nor a peer's state was loaded"
    assert max_epoch(dirs["w1"]) > epoch_at_kill
    wait_for(
        lambda: (
            len(set(averaged_epochs(dirs["w1"], killed_at)) & set(averaged_epochs(dirs["w2"], killed_at)))
            >= 2
        ),
        START_TIMEOUT,
        "both workers to average together in 2 global steps after the restart",
    )

    stop_workers(procs, STOP_TIMEOUT)

    # Parameters, relative to how far training moved them: ~1e-8 when both ended in the same averaging
    # round; ~0.07 if one took one more local step than the other (hivemind lets a peer that sees no
    # other step alone); ~0.7 for the same model trained independently on two shards for 40 steps.
    manifest = RunManifest.load(manifest_path)
    origin = {n: p.detach() for n, p in build_model(manifest.model).named_parameters()}
    saved = {n: torch.load(d / CHECKPOINT_FILE, weights_only=False) for n, d in dirs.items()}
    gap = relative_distance(saved["w1"]["parameters"], saved["w2"]["parameters"], origin)
    assert gap < 0.1, f"final parameters differ by {gap:.3f} of their movement"
    stops = {n: events_of(d, "stopped") for n, d in dirs.items()}
    assert len(stops["w1"]) == 1 and len(stops["w2"]) == 1  # the killed life wrote none

    # accounting over both logs, the whole run
    logs, report = accounting(dirs)
    assert 0 < report["goodput"] <= report["compute_fraction"] <= 1.0
    assert 0 < report["blocked_fraction"] and report["compute_fraction"] + report["blocked_fraction"] <= 1.0
    last = {
        n: [e for e in log if e["event"] == "progress"][-1] for n, log in logs.items()
    }  # the final report of each worker's current life
    assert report["per_peer"]["w1"]["tokens"] == last["w1"]["tokens"]
    assert report["per_peer"]["w2"]["tokens"] > last["w2"]["tokens"]  # plus the killed life's
    for name in dirs:
        assert set(report["per_peer"][name]) == set(COUNTERS)
        assert report["per_peer"][name]["bytes_sent"] > 0
    print(
        f"measured: goodput {report['goodput']:.4f} compute {report['compute_fraction']:.4f} "
        f"blocked {report['blocked_fraction']:.3f} over {report['wall_seconds']:.1f} s, "
        f"{report['tokens']:.0f} tokens, epochs w1 {max_epoch(dirs['w1'])} w2 {max_epoch(dirs['w2'])}, "
        f"final parameter gap {gap:.2e}"
    )
