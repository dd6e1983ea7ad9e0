"""The loss check: what one learner's delta would do to the global model's held-out loss.

Before a round is merged, the synchronizer asks `LossProbe` for each delta: the global model takes the
delta alone as an outer step (``theta - outer_lr * delta`` on that fragment) and is evaluated on a fixed
set of held-out windows; the answer is the relative change of the loss. An honest delta lowers it or
leaves it about level; a delta that drags the model back toward its initial weights, or anywhere else it
should not go, raises it, whatever its norm and direction look like (as Templar's Gauntlet scores peers).
The synchronizer refuses deltas above `[robust] loss_tolerance` (`swarm.synchronizer`).

The probe holds one extra copy of the model, reloaded from the replica when the global versions change;
each call costs one forward pass over `windows` held-out windows. On in public runs by default
(`RunManifest.loss_check_on`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

import torch
from torch import Tensor, nn

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import TokenData, evaluate
from p2p_diloco.protocol.replica import GlobalReplica


class LossProbe:
    def __init__(
        self,
        model: nn.Module,
        eval_data: Tensor | TokenData,
        *,
        block_size: int,
        outer_lr: float,
        global_params: Callable[[], Mapping[str, Tensor]],
        global_version: Callable[[], Hashable],
        windows: int = 16,
    ):
        self.model = model
        self.eval_data = eval_data
        self.block_size = block_size
        self.outer_lr = outer_lr
        self.global_params = global_params
        self.global_version = global_version
        self.windows = windows
        self.params = dict(model.named_parameters())
        self._loaded: Hashable = None
        self._base = 0.0
        self.calls = 0

    def _loss(self) -> float:
        return evaluate(
            self.model, self.eval_data, block_size=self.block_size, batch_size=self.windows, max_batches=1
        )

    @torch.no_grad()
    def __call__(self, delta: Mapping[str, Tensor]) -> float:
        """Relative change of the held-out loss if the global model took `delta` as an outer step."""
        version = self.global_version()
        if version != self._loaded:
            for name, value in self.global_params().items():
                self.params[name].copy_(value)
            self._base = self._loss()
            self._loaded = version
        saved = {name: self.params[name].detach().clone() for name in delta}
        try:
            for name, d in delta.items():
                self.params[name].sub_(
                    self.outer_lr * d.to(self.params[name].device, self.params[name].dtype)
                )
            loss = self._loss()
        finally:
            for name, value in saved.items():
                self.params[name].copy_(value)
        self.calls += 1
        return (loss - self._base) / max(abs(self._base), 1e-12)


def loss_probe_for(
    manifest: RunManifest, replica: GlobalReplica, eval_data: Tensor | TokenData
) -> LossProbe | None:
    """The manifest's loss check for a peer holding `replica`, or None when it is off."""
    if not manifest.loss_check_on:
        return None
    from p2p_diloco.model.gpt import build_model

    fragments = range(len(replica.versions()))
    return LossProbe(
        build_model(manifest.model),
        eval_data,
        block_size=manifest.model.block_size,
        outer_lr=manifest.diloco.outer_lr,
        global_params=lambda: {n: t for p in fragments for n, t in replica.params_view(p).items()},
        global_version=replica.versions,
        windows=manifest.robust.loss_windows,
    )
