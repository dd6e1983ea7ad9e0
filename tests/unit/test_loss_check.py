"""The loss check (model/probe.py, swarm/synchronizer.py): a delta that would raise the global model's
held-out loss is refused before the merge, one that lowers it passes; on by default in public runs only."""

from __future__ import annotations

import dataclasses

import torch

from p2p_diloco.config import RunManifest, TrustConfig
from p2p_diloco.model.data import load_corpus
from p2p_diloco.model.probe import loss_probe_for
from p2p_diloco.protocol.robust_config import RobustConfig
from tests.support.manifests import tiny_manifest, tiny_training

QM = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
ON = tiny_manifest("probe", robust=RobustConfig(loss_check="on"))


def held_out_gradient(manifest: RunManifest, probe) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The gradient of the probe's own held-out loss: as an outer step it must lower that loss."""
    model = probe.model
    model.zero_grad()
    data = probe.eval_data
    block = manifest.model.block_size
    windows = torch.stack([data[i : i + block + 1] for i in range(0, 16 * block, block)]).long()
    _, loss = model(windows[:, :-1], windows[:, 1:])
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_a_harmful_delta_raises_the_loss_and_a_descent_step_lowers_it():
    t = tiny_training(ON)
    corpus = load_corpus(ON.data)
    probe = loss_probe_for(ON, t.replica, corpus.eval)
    assert probe is not None
    noise = {
        n: torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 3
        for n, p in t.model.named_parameters()
    }
    assert probe(noise) > ON.robust.loss_tolerance
    grad = held_out_gradient(ON, probe)
    probe(noise)  # loads the global model
    assert probe(grad) < 0
    before = {n: p.detach().clone() for n, p in probe.model.named_parameters()}
    probe(noise)
    assert all(torch.equal(before[n], p) for n, p in probe.model.named_parameters())  # left as it was


def test_the_check_is_on_in_public_runs_and_off_in_private_ones_unless_asked():
    private = tiny_manifest("p")
    public = dataclasses.replace(private, trust=TrustConfig(authority=QM, synchronizers=(QM,)))
    assert not private.loss_check_on and public.loss_check_on
    off = dataclasses.replace(public, robust=RobustConfig(loss_check="off"))
    assert not off.loss_check_on and ON.loss_check_on
    t = tiny_training(private)
    assert loss_probe_for(private, t.replica, load_corpus(private.data).eval) is None
