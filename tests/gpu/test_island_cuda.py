"""An island of 2 ranks with its model on CUDA (node/island.py): DDP inner steps, the control protocol and
the cross-rank checksum keep the ranks bit-identical.

Backend: with two GPUs, NCCL on cuda:0 and cuda:1, what `join --nproc 2 --device cuda` runs. On ONE GPU the
two ranks share cuda:0 and use gloo (which all-reduces CUDA tensors through host memory): NCCL refuses two
ranks on one device ("Duplicate GPU detected"), and `rank_device` would give rank 1 cuda:1, which does not
exist. `join --nproc 2 --device cuda` therefore needs 2 GPUs; this test runs the same Island, DDP and
trainer code with the backend swapped.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta

import pytest
import torch

from p2p_diloco.node.island import CMD_STOP, CMD_TRAIN, Island, IslandEnv, params_digest
from tests.support.manifests import tiny_manifest, tiny_training

pytestmark = pytest.mark.gpu

STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, backend: str, results) -> None:  # noqa: ANN001
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    import p2p_diloco.node.island as island_module
    from p2p_diloco.model.trainer import make_trainer

    device = f"cuda:{rank}" if backend == "nccl" else "cuda:0"
    island_module.backend_for = lambda _device: backend  # gloo where NCCL cannot (module docstring)
    island = Island(IslandEnv(rank, 2, rank), device, timeout=timedelta(seconds=120))
    out: dict = {}
    try:
        island.start()
        manifest = tiny_manifest("gpu-island")
        t = tiny_training(manifest, num_shards=2)
        if rank == 1:
            with torch.no_grad():  # rank 1 starts elsewhere on purpose: DDP must broadcast rank 0's weights
                for p in t.model.parameters():
                    p.add_(0.5)
        t.model.to(device)
        params = dict(t.model.named_parameters())
        initial = {n: p.detach().cpu().clone() for n, p in params.items()}
        ddp = island.wrap(t.model)
        out["after_wrap"] = params_digest(params)
        trainer = make_trainer(manifest, ddp, t.optimizer, t.sampler, device=device)
        everything = list(range(t.plan.num_fragments))
        losses = []
        for step in range(STEPS):
            _, _, dirty = island.exchange_control(
                CMD_TRAIN, step, everything if step == 0 else [], len(everything)
            )
            if dirty:
                out.setdefault("synced", []).append(island.sync_fragments(params, t.plan, dirty))
            losses.append(trainer.step()[0])
        out["final_equal"] = island.sync_fragments(params, t.plan, [])
        out["stop"] = island.exchange_control(CMD_STOP, STEPS, [], len(everything))[0]
        out["digest"] = params_digest(params)
        out["finite"] = all(bool(torch.isfinite(p).all()) for p in params.values())
        out["moved"] = sum(float((p.detach().cpu() - initial[n]).abs().sum()) for n, p in params.items())
        out["on_device"] = all(str(p.device) == device for p in params.values())
        out["mismatches"] = island.mismatches
        out["losses"] = [loss for loss in losses if loss is not None]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        island.close()
        results.put((rank, out))


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: fewer than 2 GPUs here"
            ),
        ),
    ],
)
def test_an_island_of_two_ranks_on_cuda_trains_and_stays_bit_identical(backend):
    ctx = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, backend, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    r0, r1 = got[0], got[1]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["after_wrap"] == r1["after_wrap"]  # DDP gave rank 1 rank 0's weights
    assert r0["synced"] == r1["synced"] == [True]
    assert r0["final_equal"] is True and r1["final_equal"] is True
    assert r0["digest"] == r1["digest"]
    assert r1["stop"] == CMD_STOP
    assert r0["finite"] and r1["finite"] and r0["on_device"] and r1["on_device"]
    assert r0["moved"] > 0 and r0["mismatches"] == r1["mismatches"] == 0
