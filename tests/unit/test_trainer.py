"""The inner step (model/trainer.py): accumulation equals one big batch, the LR schedule, precision, clipping."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from p2p_diloco.config import DilocoConfig, ModelConfig, RunManifest, TrainConfig
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.model.trainer import InnerTrainer, lr_at, make_trainer


class FixedSampler:
    """Always the same batch of 8 sequences."""

    def __init__(self, batch: int = 8, block: int = 16, vocab: int = 256):
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, vocab, (batch, block + 1), generator=g)
        self.x, self.y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def next_batch(self):
        return self.x, self.y


def hf_model():
    cfg = ModelConfig(
        kind="hf",
        block_size=16,
        config={
            "model_type": "llama",
            "vocab_size": 256,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 16,
        },
    )
    return build_model(cfg)


@pytest.mark.parametrize(
    "make", [lambda: build_model(ModelConfig(block_size=16)), hf_model], ids=["gpt", "hf"]
)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_accumulation_gives_the_same_delta_as_one_batch(make, opt):
    """One batch of 8 and 4 micro-batches of 2 give the same delta (float tolerance; AdamW divides by the
    gradient's running RMS, so near-zero gradients amplify rounding: a looser absolute tolerance)."""
    base = make()
    deltas, losses = [], []
    for micro in (0, 2):
        model = copy.deepcopy(base)
        if opt == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        else:
            optimizer = make_inner_optimizer(model, 1e-3, 0.1)
        trainer = InnerTrainer(
            TrainConfig(grad_clip=1.0), model, optimizer, FixedSampler(),
            micro_batch=micro,
        )  # fmt: skip
        steps = [trainer.step() for _ in range(3)]
        assert all(tokens == 8 * 16 for _, tokens in steps)
        losses.append(steps[0][0])
        deltas.append(
            {n: (p0 - p).detach() for (n, p0), p in zip(base.named_parameters(), model.parameters())}
        )
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    atol = 1e-6 if opt == "sgd" else 2e-5
    for name in deltas[0]:
        assert deltas[0][name].abs().max() > 0
        torch.testing.assert_close(deltas[0][name], deltas[1][name], rtol=1e-3, atol=atol)


def test_lr_schedule_warmup_cosine_and_constant():
    cfg = TrainConfig(lr_schedule="cosine", warmup_steps=10, decay_steps=100, min_lr_ratio=0.1)
    assert lr_at(0, 1.0, cfg) == pytest.approx(0.1)
    assert lr_at(9, 1.0, cfg) == pytest.approx(1.0)
    assert lr_at(10, 1.0, cfg) == pytest.approx(1.0)
    assert lr_at(60, 1.0, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, 1.0, cfg) == pytest.approx(0.1)
    assert lr_at(10_000, 1.0, cfg) == pytest.approx(0.1)
    values = [lr_at(s, 1.0, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert lr_at(5, 2.0, TrainConfig()) == 2.0
    assert lr_at(1, 2.0, TrainConfig(warmup_steps=4)) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="decay_steps > 0"):
        TrainConfig(lr_schedule="cosine")


def test_trainer_sets_the_optimizer_lr_and_reads_loss_every_n_steps():
    model = build_model(ModelConfig(block_size=16))
    optimizer = make_inner_optimizer(model, 1e-3, 0.1)
    cfg = TrainConfig(warmup_steps=4, loss_every=3)
    trainer = InnerTrainer(cfg, model, optimizer, FixedSampler())
    losses = [trainer.step()[0] for _ in range(6)]
    assert [loss is None for loss in losses] == [False, True, False, True, True, False]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert trainer.last_lr == pytest.approx(1e-3)


def test_bf16_autocast_trains_and_keeps_fp32_weights():
    model = hf_model()
    optimizer = make_inner_optimizer(model, 3e-3, 0.0)
    trainer = InnerTrainer(
        TrainConfig(precision="bf16", activation_checkpointing=True),
        model,
        optimizer,
        FixedSampler(),
    )
    first = trainer.step()[0]
    for _ in range(15):
        last = trainer.step()[0]
    assert last < first
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.hf.is_activation_checkpointing


def test_bad_train_settings_are_refused():
    model = build_model(ModelConfig(block_size=16))
    optimizer = make_inner_optimizer(model, 1e-3, 0.1)
    assert InnerTrainer(TrainConfig(precision="fp16"), model, optimizer, FixedSampler()).precision == "bf16"
    with pytest.raises(ConfigError, match=re.escape("[train] precision = 'int4': must be one of")):
        TrainConfig(precision="int4")
    with pytest.raises(
        ConfigError, match=re.escape("[train] activation_checkpointing = true: is for kind = 'hf'")
    ):
        RunManifest(run_id="x", train=TrainConfig(activation_checkpointing=True))
    manifest = RunManifest(run_id="x", diloco=DilocoConfig(batch_size=8))
    with pytest.raises(ConfigError, match="must divide the manifest's batch_size 8"):
        make_trainer(manifest, model, optimizer, FixedSampler(), micro_batch=3)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (fp16 autocast and GradScaler)"
)
def test_fp16_on_cuda_trains():
    model = hf_model().to("cuda")
    optimizer = make_inner_optimizer(model, 3e-3, 0.0)
    trainer = InnerTrainer(
        TrainConfig(precision="fp16", grad_clip=1.0), model, optimizer, FixedSampler(),
        micro_batch=4, device="cuda",
    )  # fmt: skip
    first = trainer.step()[0]
    for _ in range(20):
        last = trainer.step()[0]
    assert last < first


def test_learner_steps_through_its_trainer_and_counts_exact_tokens_with_micro_batches():
    from p2p_diloco.model.data import BatchSampler, load_corpus
    from p2p_diloco.protocol.fragments import plan_fragments
    from p2p_diloco.protocol.replica import GlobalReplica
    from p2p_diloco.swarm.learner import Learner

    cfg = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)
    manifest = RunManifest(
        run_id="t", model=cfg, diloco=DilocoConfig(inner_steps=4, fragments=2, batch_size=4),
        train=TrainConfig(loss_every=2, warmup_steps=3),
    )  # fmt: skip
    model = build_model(cfg)
    plan = plan_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], 2)
    replica = GlobalReplica(plan, dict(model.named_parameters()))
    train = load_corpus(manifest.data).train
    sampler = BatchSampler(train, block_size=8, batch_size=4, shard=0, num_shards=1, seed=0)
    optimizer = make_inner_optimizer(model, 1e-2, 0.0)
    learner = Learner("me", manifest, plan, replica, model, optimizer, sampler)
    learner.trainer = make_trainer(manifest, model, optimizer, sampler, micro_batch=1)  # what a node does
    losses = [learner.train_step() for _ in range(3)]
    assert learner.trainer.steps == 3 and learner.tokens_trained == 3 * 4 * 8
    assert all(w.tokens == 3 * 4 * 8 and w.steps == 3 for w in learner.work)
    assert losses[0] != losses[1]  # steps 1 and 2 read the loss (the first step and every loss_every)
    assert losses[2] == losses[1]  # step 3's loss was not read: the last read value stays
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # warmup done: the optimizer's own lr


def test_adamw8bit_falls_back_to_adamw_off_cuda():
    model = build_model(ModelConfig(block_size=16))
    optimizer = make_inner_optimizer(model, 1e-3, 0.1)
    trainer = InnerTrainer(TrainConfig(optimizer="adamw8bit"), model, optimizer, FixedSampler())
    assert trainer.optimizer is optimizer
    with pytest.raises(ConfigError, match=re.escape("[train] optimizer = 'lion': must be one of")):
        TrainConfig(optimizer="lion")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' 8-bit optimizers need a CUDA device")
def test_adamw8bit_on_cuda_trains():
    import bitsandbytes as bnb

    model = hf_model().to("cuda")
    optimizer = make_inner_optimizer(model, 3e-3, 0.1)
    trainer = InnerTrainer(
        TrainConfig(optimizer="adamw8bit", precision="bf16"), model, optimizer, FixedSampler(), device="cuda"
    )
    assert isinstance(trainer.optimizer, bnb.optim.AdamW8bit)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]
    first = trainer.step()[0]
    for _ in range(20):
        last = trainer.step()[0]
    assert last < first


def test_join_micro_batch_flag_must_divide_the_batch(tmp_path):
    from p2p_diloco.cli import build_parser
    from p2p_diloco.net.identity import write_identity
    from p2p_diloco.node.join import options_from_args

    (tmp_path / "run.toml").write_text('run_id = "t"\n[diloco]\nbatch_size = 8\n')
    write_identity(tmp_path / "peer.key")
    base = [
        "join",
        str(tmp_path / "run.toml"),
        "--identity",
        str(tmp_path / "peer.key"),
        "--state-dir",
        str(tmp_path / "s"),
    ]
    assert options_from_args(build_parser().parse_args([*base, "--micro-batch", "2"])).micro_batch == 2
    assert options_from_args(build_parser().parse_args(base)).micro_batch == 0
    with pytest.raises(ConfigError, match="--micro-batch must divide the manifest's batch_size 8"):
        options_from_args(build_parser().parse_args([*base, "--micro-batch", "3"]))
