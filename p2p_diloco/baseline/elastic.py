"""`hivemind.Optimizer` set up as the lock-step baseline, and observed so its work can be accounted.

Owns: the hivemind run ID of a manifest's baseline (`hivemind_run_id`), the learner's AdamW rebuilt as an
optimizer factory over the same parameter groups and hyper-parameters as `model.make_inner_optimizer`
(`optimizer_factory`, which also times every local AdamW step), and `ObservedOptimizer`: a
`hivemind.Optimizer` that records what each global step did (`GlobalStepRecord`: the group its gradients
were averaged in, how many peers hivemind saw), how often state was reloaded from peers and how many
parameter-averaging rounds it asked for. hivemind itself reports none of this except in log lines.

Settings (`ElasticSettings`) follow the brief of a lock-step data-parallel baseline: gradients averaged
at every global step (`use_local_updates=False`), no delayed optimizer step or gradient averaging,
parameters averaged in the background every `average_state_every` global steps (hivemind's default of 1;
it repairs peers whose round failed), plain fp32 or fp16 wire (hivemind's 8-bit codecs are broken on
numpy >= 2.4, FINDINGS.md).

The progress tracker's DHT records are signed with the peer's identity key: the DHT node of
`net.dht_store.create_dht` already holds an `RSASignatureValidator` for that key, hivemind keeps only the
first such validator, and a tracker left with its default process-wide key would write records that
the node cannot sign, which are then refused.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hivemind
import torch
from hivemind.compression import Float16Compression, NoCompression
from hivemind.utils.crypto import RSAPrivateKey
from torch import nn

from p2p_diloco.config import DilocoConfig, RunManifest
from p2p_diloco.model.gpt import make_inner_optimizer

COMPRESSIONS = {"fp32": (NoCompression, 4), "fp16": (Float16Compression, 2)}


def hivemind_run_id(manifest: RunManifest, system: str = "baseline") -> str:
    """``<run_id>-<manifest hash>-<system>`` with '.' replaced (hivemind prefixes may not contain it)."""
    return f"{manifest.run_id}-{manifest.manifest_hash}-{system}".replace(".", "_")


@dataclass(frozen=True)
class ElasticSettings:
    run_id: str
    target_batch_size: int
    batch_size_per_step: int
    matchmaking_time: float
    averaging_timeout: float
    load_state_timeout: float
    average_state_every: int
    peer_expiration: float  # seconds a peer's progress record stays in the DHT without a refresh
    compression: str = "fp32"
    verbose: bool = False  # hivemind logs its rounds at INFO

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)}, got {self.compression!r}")

    @property
    def bytes_per_value(self) -> int:
        return COMPRESSIONS[self.compression][1]


class OptimizerTimer:
    """Seconds spent inside `optimizer.step()` of the optimizers it is attached to (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._started: dict[int, float] = {}

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._seconds

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        def before(_opt: Any, _args: Any, _kwargs: Any) -> None:
            with self._lock:
                self._started[threading.get_ident()] = time.perf_counter()

        def after(_opt: Any, _args: Any, _kwargs: Any) -> None:
            with self._lock:
                started = self._started.pop(threading.get_ident(), None)
                if started is not None:
                    self._seconds += time.perf_counter() - started

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)


def optimizer_factory(
    model: nn.Module, diloco: DilocoConfig, timer: OptimizerTimer
) -> tuple[list[dict[str, Any]], Callable[[Sequence[dict[str, Any]]], torch.optim.Optimizer]]:
    """(param groups, factory) reproducing `make_inner_optimizer` for hivemind, which builds the optimizer
    itself over its offloaded copies of the parameters. The factory's optimizers are timed by `timer`."""
    template = make_inner_optimizer(model, diloco.inner_lr, diloco.inner_weight_decay)
    cls = type(template)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in template.defaults.items() if k in accepted}
    groups = [
        {k: v for k, v in group.items() if k == "params" or v != template.defaults.get(k)}
        for group in template.param_groups
    ]

    def factory(param_groups: Sequence[dict[str, Any]]) -> torch.optim.Optimizer:
        optimizer = cls(param_groups, **defaults)
        timer.attach(optimizer)
        return optimizer

    return groups, factory


@dataclass(frozen=True)
class GlobalStepRecord:
    """One global optimizer step: the epoch it produced, the peers hivemind saw, the averaging group."""

    epoch: int
    peers_seen: int
    group_size: int  # 0: no gradient averaging round was run or it failed


def _group_size(control: Any) -> int:
    """Members of a finished gradient-averaging round, 0 if it did not finish successfully."""
    if control is None or not control.done() or control.cancelled():
        return 0
    try:
        if control.exception(timeout=0) is not None:
            return 0
        return len(control.result(timeout=0))
    except BaseException:  # noqa: BLE001 - any failure of the round means "not averaged"
        return 0


class ObservedOptimizer(hivemind.Optimizer):
    """`hivemind.Optimizer` that records its global steps and state reloads (module docstring).

    `last_global_step` is set by every global step; the caller clears it before `step()` to tell
    whether one happened. `reloads` counts `load_state_from_peers` calls, `state_rounds_requested` the
    parameter-averaging rounds hivemind started (they run in the background; success is not known).
    """

    def __init__(self, **kwargs: Any):
        self.last_global_step: GlobalStepRecord | None = None
        self.reloads = 0
        self.state_rounds_requested = 0
        self._round_group_size = 0
        super().__init__(**kwargs)
        self._count_state_rounds()

    def _count_state_rounds(self) -> None:
        """Wrap the state averager's `step` (called by hivemind.Optimizer, in this process) to count the
        parameter-averaging rounds asked for; hivemind only logs them."""
        original = self.state_averager.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("averaging_round"):
                self.state_rounds_requested += 1
            return original(*args, **kwargs)

        self.state_averager.step = step  # type: ignore[method-assign]

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        peers_seen = self.tracker.global_progress.num_peers
        self._round_group_size = 0
        super()._update_global_epoch(grad_scaler)
        self.last_global_step = GlobalStepRecord(
            epoch=self.local_epoch, peers_seen=peers_seen, group_size=self._round_group_size
        )

    def _maybe_schedule_gradient_averaging(self) -> None:
        # Alone, hivemind would pre-schedule a round every step and cancel it at the global step; a round
        # cancelled during matchmaking leaves errors behind in the averager ("aclose(): asynchronous
        # generator is already running"). With no other peer there is no group to look for.
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        self._round_group_size = _group_size(maybe_step_control)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        self.reloads += 1
        super().load_state_from_peers(**kwargs)


def make_optimizer(
    settings: ElasticSettings,
    dht: hivemind.DHT,
    model: nn.Module,
    diloco: DilocoConfig,
    private_key: RSAPrivateKey,
    timer: OptimizerTimer,
) -> ObservedOptimizer:
    """The baseline's `ObservedOptimizer` over `model` (module docstring for the settings)."""
    groups, factory = optimizer_factory(model, diloco, timer)
    compression = COMPRESSIONS[settings.compression][0]
    return ObservedOptimizer(
        dht=dht,
        run_id=settings.run_id,
        target_batch_size=settings.target_batch_size,
        batch_size_per_step=settings.batch_size_per_step,
        params=groups,
        optimizer=factory,
        matchmaking_time=settings.matchmaking_time,
        averaging_timeout=settings.averaging_timeout,
        load_state_timeout=settings.load_state_timeout,
        use_local_updates=False,
        offload_optimizer=True,
        delay_optimizer_step=False,
        delay_grad_averaging=False,
        delay_state_averaging=True,
        average_state_every=settings.average_state_every,
        grad_compression=compression(),
        state_averaging_compression=compression(),
        load_state_compression=NoCompression(),
        # below the matchmaking time, as hivemind recommends: a request deadlock (A asks B while B asks A)
        # is broken by this timeout, and one longer than the matchmaking window fails the round instead
        averager_opts={"request_timeout": settings.matchmaking_time / 2},
        tracker_opts={"private_key": private_key, "metadata_expiration": settings.peer_expiration},
        verbose=settings.verbose,
    )


def state_bytes(optimizer: ObservedOptimizer) -> int:
    """Bytes of the state a peer downloads in `load_state_from_peers` (parameters and optimizer tensors)."""
    _, tensors, _ = optimizer.state_averager.get_current_state()
    return sum(t.numel() * t.element_size() for t in tensors)


def offloaded_parameters(optimizer: ObservedOptimizer) -> list[torch.Tensor]:
    """The optimizer's own copies of the parameters (hivemind offloads them), in param-group order, which
    is the order of `optimizer.state_averager.main_parameters` (not the model's)."""
    return [p for group in optimizer.opt.param_groups for p in group["params"]]
