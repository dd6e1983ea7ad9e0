"""One inner step for consumer GPUs: autocast, gradient accumulation, clipping, LR schedule, lazy loss reads.

Owns `InnerTrainer` (built by `make_trainer` from the manifest's ``[train]`` section, the model, the
inner optimizer and the sampler; the learner calls `step()`), and `lr_at` (the inner LR schedule, applied
as a factor to the lr each optimizer group was built with).

A step is always one `diloco.batch_size` batch from the sampler, whatever the micro-batch: the batch
is split into `batch_size / micro_batch` equal micro-batches, each loss divided by their number before
backward, so the summed gradient is the gradient of the whole batch's mean loss (up to float rounding)
and the tokens and steps a delta claims stay exact. Then the gradient is clipped to `grad_clip`
(global norm; fp16 gradients are unscaled first) and the optimizer steps at `lr_at(step)`.

Precision: ``fp32``; ``bf16`` autocasts forward and loss to bfloat16 (CPU and CUDA; weights, gradients
and AdamW state stay fp32, so deltas and replicas are unchanged); ``fp16`` autocasts to float16 with a
`torch.amp.GradScaler` (CUDA only: other devices autocast to bf16 instead, logged; a step whose
gradients overflow is skipped by the scaler but still counted, as its batch was consumed). The loss is read
from the device (a host sync) only every `loss_every` steps; other steps return None. The step counter
restarts with the process, so a restarted peer warms up again (a short warmup is harmless there).

``[train] optimizer = "adamw8bit"`` swaps the inner AdamW for bitsandbytes' `AdamW8bit` (its moments
kept blockwise-quantized to 8 bits on the GPU, same parameter groups, lr, betas, eps and weight decay)
on CUDA devices; elsewhere bitsandbytes' 8-bit optimizers do not run and the peer keeps torch AdamW
(logged), which is harmless: inner optimizers are local to each learner. The CUDA paths (fp16 with its
scaler, bf16 on CUDA, AdamW8bit) are written to bitsandbytes' and torch's documented APIs but were NOT
run on a GPU when written (their tests skip without CUDA).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch
from torch import Tensor, nn

from p2p_diloco.config import InnerOptimizer, LRSchedule, Precision, RunManifest, TrainConfig
from p2p_diloco.errors import ConfigError

log = logging.getLogger(__name__)


def eight_bit_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """bitsandbytes' `AdamW8bit` over `optimizer`'s parameter groups and hyper-parameters (fresh state).

    CUDA only; untested here (module docstring)."""
    import bitsandbytes as bnb

    groups = [
        {k: v for k, v in group.items() if k in ("params", "lr", "weight_decay")}
        for group in optimizer.param_groups
    ]
    defaults = optimizer.defaults
    return bnb.optim.AdamW8bit(
        groups, lr=defaults["lr"], betas=defaults.get("betas", (0.9, 0.999)), eps=defaults.get("eps", 1e-8)
    )


def lr_at(step: int, base_lr: float, cfg: TrainConfig) -> float:
    """Inner LR of local step `step` (0-based): linear warmup over `warmup_steps` (from base/warmup to
    base), then constant, or cosine from base to `min_lr_ratio * base` over `decay_steps`, then flat."""
    if step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == LRSchedule.CONSTANT:
        return base_lr
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    return base_lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class InnerTrainer:
    """Runs inner steps of `model` with `optimizer` on `sampler`'s batches (module docstring)."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: Any,
        *,
        micro_batch: int = 0,
        device: str = "cpu",
    ):
        self.cfg = cfg
        self.model = model
        self.device_type = torch.device(device).type
        if cfg.optimizer == InnerOptimizer.ADAMW_8BIT:
            if self.device_type == "cuda":
                optimizer = eight_bit_optimizer(optimizer)
            else:
                log.warning(
                    "train.optimizer = 'adamw8bit' runs on CUDA only: this %s peer uses AdamW", device
                )
        self.optimizer = optimizer
        self.sampler = sampler
        # the schedule scales each group's lr as the optimizer was built (make_inner_optimizer: inner_lr)
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.device = device
        self.micro_batch = micro_batch
        self.steps = 0
        self.last_lr = self.base_lrs[0] if self.base_lrs else 0.0
        self.precision = cfg.precision
        if self.precision == Precision.FP16 and self.device_type != "cuda":
            log.warning("train.precision = 'fp16' runs on CUDA only: this %s peer autocasts to bf16", device)
            self.precision = Precision.BF16
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == Precision.FP16 else None
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        if cfg.activation_checkpointing:
            inner = getattr(model, "module", model)  # a DDP wrapper's model
            enable = getattr(inner, "enable_activation_checkpointing", None)
            if enable is None:
                raise ConfigError(
                    "train.activation_checkpointing needs a model with enable_activation_checkpointing() "
                    "(kind = 'hf' models have it)"
                )
            enable()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == Precision.FP32:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == Precision.BF16 else torch.float16
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def _splits(self, batch: int) -> int:
        micro = self.micro_batch or batch
        if micro > batch or batch % micro:
            raise ConfigError(f"micro-batch {micro} must divide the step's batch of {batch} sequences")
        return batch // micro

    def step(self, model: nn.Module | None = None) -> tuple[float | None, int]:
        """One inner step: returns (the batch's mean loss, or None on steps the loss is not read; tokens).

        `model`: what runs forward and backward this step (an island passes its DDP wrapper of the same
        parameters); default the trainer's model. Under DDP every micro-batch but the last runs in
        `no_sync()`, so each rank all-reduces once a step whatever its micro-batch."""
        model = self.model if model is None else model
        scale = lr_at(self.steps, 1.0, self.cfg)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * scale
        self.last_lr = self.base_lrs[0] * scale if self.base_lrs else 0.0
        x, y = self.sampler.next_batch()
        splits = self._splits(x.shape[0])
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total: Tensor | None = None
        no_sync = getattr(model, "no_sync", None)
        for i, (xs, ys) in enumerate(zip(x.chunk(splits), y.chunk(splits))):
            xs = xs.to(self.device, non_blocking=True)
            ys = ys.to(self.device, non_blocking=True)
            last = i == splits - 1
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                with self._autocast():
                    _, loss = model(xs, ys)
                scaled = loss.float() / splits
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            detached = scaled.detach()
            total = detached if total is None else total + detached
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.steps += 1
        read = total is not None and (self.steps % self.cfg.loss_every == 0 or self.steps == 1)
        return (float(total) if read else None), int(x.numel())


def make_trainer(
    manifest: RunManifest,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: Any,
    *,
    micro_batch: int = 0,
    device: str = "cpu",
) -> InnerTrainer:
    """The `InnerTrainer` of a run: its ``[train]`` section, this peer's micro-batch (`join --micro-batch`,
    0 = whole batch) and device. The schedule scales the lr `optimizer` was built with (`diloco.inner_lr`
    from `make_inner_optimizer`)."""
    batch = manifest.diloco.batch_size
    if micro_batch < 0 or (micro_batch and batch % micro_batch):
        raise ConfigError(f"--micro-batch must divide the manifest's batch_size {batch}, got {micro_batch}")
    return InnerTrainer(
        manifest.train,
        model,
        optimizer,
        sampler,
        micro_batch=micro_batch,
        device=device,
    )
