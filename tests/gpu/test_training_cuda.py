"""The inner step on CUDA (model/trainer.py): bf16 and fp16 autocast train and give finite deltas that point
where the fp32 step's do; `adamw8bit` (bitsandbytes) trains with 8-bit state; a learner on the GPU hands
the peer float32 deltas where its int8 encoder runs (on the GPU with bitsandbytes: `wire.codecs.placement`)."""

from __future__ import annotations

import copy

import pytest
import torch

from p2p_diloco.config import ModelConfig, TrainConfig
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.model.trainer import InnerTrainer
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.wire.codecs.feedback import ErrorFeedback
from p2p_diloco.wire.codecs.placement import delta_device
from tests.support.manifests import tiny_manifest, tiny_training
from tests.unit.test_trainer import FixedSampler, hf_model

pytestmark = pytest.mark.gpu


def run_steps(model: torch.nn.Module, cfg: TrainConfig, steps: int, *, micro_batch: int = 0):
    """`steps` inner steps on CUDA; (first loss, last loss, delta initial - final on the CPU, trainer)."""
    initial = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    model.to("cuda")
    optimizer = make_inner_optimizer(model, 3e-3, 0.1)
    trainer = InnerTrainer(cfg, model, optimizer, FixedSampler(), micro_batch=micro_batch, device="cuda")
    losses = [trainer.step()[0] for _ in range(steps)]
    read = [loss for loss in losses if loss is not None]
    delta = {n: initial[n] - p.detach().cpu() for n, p in model.named_parameters()}
    return read[0], read[-1], delta, trainer


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[n].reshape(-1).double() for n in a])
    y = torch.cat([b[n].reshape(-1).double() for n in a])
    return float(x @ y / (x.norm() * y.norm()))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_step_trains_with_finite_deltas_like_fp32(precision):
    base = hf_model()
    _, _, reference, _ = run_steps(copy.deepcopy(base), TrainConfig(precision="fp32", grad_clip=1.0), 1)
    model = copy.deepcopy(base)
    first, last, delta, trainer = run_steps(
        model, TrainConfig(precision=precision, grad_clip=1.0, loss_every=1), 25, micro_batch=4
    )
    assert trainer.precision == precision  # fp16 stays fp16 on CUDA (elsewhere it falls back to bf16)
    assert (trainer.scaler is not None) == (precision == "fp16")
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())  # master weights fp32
    assert all(torch.isfinite(d).all() for d in delta.values())
    assert sum(float(d.abs().sum()) for d in delta.values()) > 0
    assert last < first - 0.5, f"{precision}: loss {first:.3f} -> {last:.3f}"
    # one step of each from the same weights: AdamW's first step is about lr * sign(grad), so the
    # autocast step must move the weights the way the fp32 step does
    one = copy.deepcopy(base)
    _, _, first_delta, _ = run_steps(one, TrainConfig(precision=precision, grad_clip=1.0), 1)
    assert cosine(first_delta, reference) > 0.9


def test_adamw8bit_trains_with_8bit_state_and_less_memory():
    import bitsandbytes as bnb

    cfg = ModelConfig(
        kind="hf",
        block_size=16,
        config={
            "model_type": "llama", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16,
        },
    )  # fmt: skip
    state_bytes = {}
    for optimizer_name in ("adamw", "adamw8bit"):
        model = build_model(cfg)
        torch.cuda.synchronize()
        first, last, delta, trainer = run_steps(
            model, TrainConfig(optimizer=optimizer_name, precision="bf16", loss_every=1), 25
        )
        state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        state_bytes[optimizer_name] = sum(t.numel() * t.element_size() for t in state)
        assert last < first - 0.5, f"{optimizer_name}: loss {first:.3f} -> {last:.3f}"
        assert all(torch.isfinite(d).all() for d in delta.values())
        if optimizer_name == "adamw8bit":
            assert isinstance(trainer.optimizer, bnb.optim.AdamW8bit)
            assert any(t.dtype == torch.uint8 for t in state)  # moments kept in 8 bits
        del model, trainer
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    print(f"measured: optimizer state {state_bytes['adamw'] / n_params:.2f} B/param (AdamW) vs "
          f"{state_bytes['adamw8bit'] / n_params:.2f} B/param (AdamW8bit)")  # fmt: skip
    assert state_bytes["adamw8bit"] < 0.5 * state_bytes["adamw"]


def test_a_learner_on_the_gpu_takes_float32_deltas_where_its_int8_encoder_runs():
    manifest = tiny_manifest("gpu-learner")
    t = tiny_training(manifest)
    t.model.to("cuda")
    learner = Learner("me", manifest, t.plan, t.replica, t.model, t.optimizer, t.sampler, device="cuda")
    due = None
    for step in range(12):
        learner.train_step()
        due = learner.take_due(now=float(step))
        if due is not None:
            break
    assert due is not None and due.header.steps > 0
    where = delta_device("cuda", manifest.wire.codec)  # CUDA when bitsandbytes is installed (check.py does)
    assert all(d.device.type == where.type and d.dtype == torch.float32 for d in due.delta.values())
    anchor, params = learner.anchors[due.fragment][1], dict(t.model.named_parameters())
    for name, d in due.delta.items():  # the same float32 subtraction as on the CPU: the same bits
        assert torch.equal(d.cpu(), anchor[name] - params[name].detach().cpu())
    assert any(float(d.abs().max()) > 0 for d in due.delta.values())
    frame, decoded = ErrorFeedback(codec=manifest.wire.codec, block_size=manifest.wire.block_size).compress(
        due.fragment, due.delta
    )
    for name, d in due.delta.items():  # int8: within a code step of the block's absmax
        assert float((decoded[name].cpu() - d.cpu()).abs().max()) <= 0.01 * float(d.abs().max()) + 1e-12
    assert all(p.is_cuda for p in t.model.parameters())
