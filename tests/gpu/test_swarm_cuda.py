"""A CPU peer and a GPU peer in one in-process swarm (swarm/inprocess.py, fake clock, real training): both
contribute and every replica ends bit-identical. The evaluator (node/evaluation.py) on CUDA: the borrowed
weights are one transient device copy, released after each evaluation, and give the CPU's loss."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.model.data import evaluate, load_corpus
from p2p_diloco.model.gpt import build_model
from p2p_diloco.node.evaluation import (
    BorrowedWeights,
    EvalMode,
    EvalOptions,
    EvalWorker,
    GlobalEvaluator,
    read_histories,
)
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec
from p2p_diloco.swarm.memory import InMemoryKeyValueStore
from p2p_diloco.swarm.peer import Peer

pytestmark = pytest.mark.gpu


def sim_manifest() -> RunManifest:
    """tests/sim/conftest.py's manifest: peers/demo.toml with a smaller model, H = 8, batch 8."""
    base = RunManifest.load("peers/demo.toml")
    return dataclasses.replace(
        base,
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
        diloco=dataclasses.replace(base.diloco, inner_steps=8, batch_size=8),
    )


class MixedSwarm(InProcessSwarm):
    """The in-process swarm with the learners in `on_gpu` training on CUDA (after every (re)start)."""

    def __init__(self, spec: SwarmSpec, on_gpu: set[int], **kwargs):  # noqa: ANN003
        self.on_gpu = on_gpu
        super().__init__(spec, **kwargs)

    def _start_peer(self, i: int, replica: GlobalReplica, incarnation: int) -> Peer:
        peer = super()._start_peer(i, replica, incarnation)
        if i in self.on_gpu:
            learner = self.learners[i]
            learner.model.to("cuda")  # moves the parameters in place: the learner's and optimizer's refs hold
            learner.device = "cuda"  # its trainer is built at its first step, on this device
        return peer


def test_a_cpu_peer_and_a_gpu_peer_end_with_bit_identical_replicas():
    torch.set_num_threads(1)
    manifest = sim_manifest()
    corpus = load_corpus(manifest.data)
    swarm = MixedSwarm(
        SwarmSpec(manifest=manifest, learners=2, duration=60.0, eval_every=30), {1}, corpus=corpus
    )
    report = swarm.run()
    assert all(p.is_cuda for p in swarm.learners[1].model.parameters())
    assert all(not p.is_cuda for p in swarm.learners[0].model.parameters())
    assert all(v >= 3 for v in report.versions), report.versions
    assert report.learners[0].steps_merged > 0 and report.learners[1].steps_merged > 0  # both contributed
    assert report.digests_equal, {i: p.replica.digest() for i, p in swarm.peers.items()}
    assert report.final_eval_loss < report.eval_curve[0][2] - 0.3
    assert report.rejections == {}


def test_borrowed_weights_on_cuda_keep_no_device_copy_and_match_the_cpu_loss():
    manifest = sim_manifest()
    data = load_corpus(manifest.data).eval
    params = {n: p.detach().clone() for n, p in build_model(manifest.model).named_parameters()}
    expected = evaluate(build_model(manifest.model), data, block_size=32, batch_size=8, max_batches=2)
    borrowed = BorrowedWeights(build_model(manifest.model).to("cuda"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        with borrowed.bound(params) as model:
            assert all(p.is_cuda for p in model.parameters())
            loss = evaluate(model, data, block_size=32, batch_size=8, max_batches=2)
        assert math.isclose(loss, expected, rel_tol=1e-4), (loss, expected)
        assert all(p.is_meta for p in borrowed.model.parameters())
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= before  # the device copy went back after the evaluation


def test_the_global_evaluator_evaluates_on_cuda():
    manifest = sim_manifest()
    corpus = load_corpus(manifest.data)
    model = build_model(manifest.model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    class Clock:
        def now(self) -> float:
            return 1000.0

    made = []

    def make_model() -> torch.nn.Module:
        made.append(build_model(manifest.model).to("cuda"))
        return made[-1]

    options = EvalOptions(mode=EvalMode.ALWAYS, every_updates=1, batches=2, batch_size=8)
    ev = GlobalEvaluator(manifest, options, peer_id="QmGpu", ledger=None)
    worker = EvalWorker(manifest, options, make_model, corpus.eval)
    fragments = manifest.diloco.fragments
    ev.absorb(read_histories(InMemoryKeyValueStore(), ev.key, manifest, Clock().now()))
    request = ev.ask(
        Clock().now(),
        versions=(0,) * fragments,
        holds_lease=True,
        term=1,
        frozen=lambda: (params, (0,) * fragments),
    )
    assert request is not None
    point = ev.finish(request, worker.evaluate(request))
    assert point is not None and len(made) == 1
    expected = evaluate(model, corpus.eval, block_size=manifest.model.block_size, batch_size=8, max_batches=2)
    assert math.isclose(point.loss, expected, rel_tol=1e-4), (point.loss, expected)
    assert all(p.is_meta for p in made[0].parameters())  # nothing of the replica kept on the device
