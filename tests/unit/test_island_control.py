"""Islands (`node.island`): torchrun arguments and environment, checksums, rank 0's dirty-fragment
bookkeeping and counters (with a recording stand-in for the process group), and the control protocol
over a real 2-process gloo group (forked processes on 127.0.0.1)."""

from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta

import pytest
import torch

from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.data import load_corpus
from p2p_diloco.node.island import (
    CMD_STOP,
    CMD_TRAIN,
    Island,
    IslandEnv,
    backend_for,
    island_env,
    params_checksum,
    params_digest,
    process_gone,
    rank_device,
    torchrun_argv,
)
from p2p_diloco.node.island_learner import IslandLearner, finish_island
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.effects import Adopt, Reload
from tests.support.manifests import tiny_manifest, tiny_training

CFG = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)


def test_torchrun_argv_removes_nproc_and_keeps_the_rest():
    argv = ["join", "m.toml", "--nproc", "4", "--identity", "k", "--nproc=4", "--state-dir", "s"]
    cmd = torchrun_argv(4, argv, python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                   "-m", "p2p_diloco", "join", "m.toml", "--identity", "k", "--state-dir", "s"]  # fmt: skip
    with pytest.raises(ConfigError, match="--nproc"):
        torchrun_argv(0, argv)


def test_island_env_from_torchrun_variables():
    assert island_env({}) is None
    assert island_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) is None  # one rank: no island
    assert island_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == IslandEnv(1, 2, 1)
    with pytest.raises(ConfigError, match="RANK=2"):
        island_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="integers"):
        island_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_rank_device_and_backend():
    env = IslandEnv(rank=1, world_size=2, local_rank=1)
    assert rank_device("cuda", env, device_count=2) == "cuda:1" and rank_device("cpu", env) == "cpu"
    with pytest.raises(ConfigError, match="--device cuda"):
        rank_device("cuda:0", env)
    with pytest.raises(ConfigError, match="mps"):
        rank_device("mps", env)
    assert backend_for("cuda:1") == "nccl" and backend_for("cpu") == "gloo"


def test_checksum_sees_every_bit_and_the_order():
    a = torch.randn(100, generator=torch.Generator().manual_seed(0))
    b = torch.randn(7, 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    base = int(params_checksum([a, b]))
    assert int(params_checksum([a.clone(), b.clone()])) == base
    flipped = a.clone()
    flipped.view(torch.int32)[17] ^= 1  # the lowest mantissa bit of one element
    assert int(params_checksum([flipped, b])) != base
    assert int(params_checksum([b, a])) != base
    swapped = a.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert int(params_checksum([swapped, b])) != base
    assert params_digest({"a": a, "b": b}) == params_digest({"b": b.clone(), "a": a.clone()})
    assert params_digest({"a": flipped, "b": b}) != params_digest({"a": a, "b": b})


def test_process_gone_and_one_host():
    assert not process_gone(os.getpid())
    child = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    child.start()
    child.join()  # reaped: its pid no longer exists
    assert process_gone(child.pid)
    island = Island(IslandEnv(0, 2, 0), "cpu")
    assert island.one_host({"LOCAL_WORLD_SIZE": "2"}) and not island.one_host({"LOCAL_WORLD_SIZE": "1"})


# ---- rank 0's learner, with a recording stand-in for the process group ------------------------------


class RecordingIsland:
    """Stands in for `Island` on rank 0: records the control messages and broadcasts."""

    def __init__(self, world_size: int, equal: bool = True):
        self.world_size = world_size
        self.broken = False
        self.equal = equal
        self.controls: list[tuple[int, int, list[int]]] = []
        self.synced: list[list[int]] = []
        self.digests: list[int] = []

    def wrap(self, model):
        return model

    def exchange_control(self, command, step, dirty, num_fragments):
        self.controls.append((command, step, list(dirty)))
        return command, step, list(dirty)

    def sync_fragments(self, params, plan, dirty):
        self.synced.append(list(dirty))
        return self.equal

    def write_digest(self, state_dir, step, params):
        self.digests.append(step)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(RunManifest(run_id="t").data)


def make_island_learner(corpus, island, tmp_path):
    manifest = tiny_manifest("t")
    t = tiny_training(manifest, num_shards=2, corpus=corpus)
    model, plan, replica, sampler, optimizer = t.model, t.plan, t.replica, t.sampler, t.optimizer
    learner = IslandLearner(
        island, "me", manifest, plan, replica, model, optimizer, sampler, state_dir=tmp_path
    )
    learner.replica = replica  # the test plays the peer's part
    return learner


def test_island_learner_broadcasts_what_rank_0_changed_outside_the_optimizer(corpus, tmp_path):
    island = RecordingIsland(world_size=3)
    learner = make_island_learner(corpus, island, tmp_path)
    learner.train_step()  # the start loaded the replica into the model: every fragment goes out first
    assert island.controls == [(CMD_TRAIN, 0, [0, 1])] and island.synced == [[0, 1]]
    learner.train_step()
    assert island.controls[-1] == (CMD_TRAIN, 1, []) and len(island.synced) == 1  # nothing changed

    p = 1
    old = learner.replica.params_of(p)
    grad = {n: torch.full_like(t, 0.5) for n, t in old.items()}
    pending = learner.replica.compute_update(p, grad, lr=0.7, momentum=0.9)
    learner.replica.apply(p, 0, grad, lr=0.7, momentum=0.9, expected_checksum=None)
    record = UpdateRecord(
        "t", "x", p, pending.from_version, 1, "sync", (("other", 1.0),), pending.checksum, b""
    )
    learner.inbox.put(Adopt(record, old, learner.replica.params_view(p), 1))
    learner.inbox.put(Reload({0: (0, learner.replica.params_view(0))}))  # e.g. a snapshot repair
    learner.train_step()
    assert island.controls[-1] == (CMD_TRAIN, 2, [0, 1]) and island.synced[-1] == [0, 1]

    finish_island(learner)
    finish_island(learner)  # idempotent
    assert island.controls[-1] == (CMD_STOP, 3, []) and island.digests == [3]


def test_island_learner_counts_every_rank_in_tokens_and_delta_steps(corpus, tmp_path):
    learner = make_island_learner(corpus, RecordingIsland(world_size=3), tmp_path)
    for _ in range(20):
        learner.train_step()
        due = learner.take_due(now=float(learner.step))
        if due is not None:
            break
    assert due is not None
    header = due.header
    per_rank_batch = 2 * 8
    assert header.steps == 3 * learner.step  # rank-steps: tokens/steps stays batch x block
    assert header.tokens == header.steps * per_rank_batch
    assert learner.tokens_trained == 3 * learner.step * per_rank_batch


def test_a_mismatch_rebroadcasts_every_fragment_next_step(corpus, tmp_path):
    island = RecordingIsland(world_size=2, equal=False)
    learner = make_island_learner(corpus, island, tmp_path)
    learner.train_step()
    island.equal = True
    learner.train_step()
    assert island.synced == [[0, 1], [0, 1]]


# ---- the control protocol over a real gloo group of two processes ---------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    island = Island(IslandEnv(rank, 2, rank), "cpu", timeout=timedelta(seconds=30))
    island.start()
    try:
        gen = torch.Generator().manual_seed(rank)  # different on purpose: rank 0's values must win
        params = {"w": torch.randn(5, 4, generator=gen), "b": torch.zeros(4)}
        plan = plan_fragments([(n, tuple(t.shape)) for n, t in params.items()], 2)
        everything = list(range(plan.num_fragments))
        out = {"seed": island.share_seed(1234 if rank == 0 else 0)}
        command, step, dirty = island.exchange_control(CMD_TRAIN, 7, everything, plan.num_fragments)
        out["first"] = (command, step, dirty, island.sync_fragments(params, plan, dirty))
        out["digest"] = params_digest(params)
        fragment_of_b = plan.fragment_of("b")
        if rank == 1:
            params["w"][0, 0] += 1.0  # drift outside the broadcast fragments: the check must see it
        command, step, dirty = island.exchange_control(CMD_TRAIN, 8, [fragment_of_b], plan.num_fragments)
        out["drift"] = (dirty, island.sync_fragments(params, plan, dirty))
        out["stop"] = island.exchange_control(CMD_STOP, 9, [], plan.num_fragments)[0]
        out["mismatches"] = island.mismatches
        results.put((rank, out))
    finally:
        island.close()


def test_control_protocol_over_gloo_keeps_ranks_identical_and_detects_drift():
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    r0, r1 = got[0], got[1]
    assert r0["seed"] == r1["seed"] == 1234
    assert r1["first"] == (CMD_TRAIN, 7, [0, 1], True) == r0["first"]
    assert r0["digest"] == r1["digest"]
    assert r0["drift"][1] is False and r1["drift"][1] is False
    assert r0["mismatches"] == r1["mismatches"] == 1
    assert r1["stop"] == CMD_STOP
