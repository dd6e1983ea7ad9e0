"""One outer step on one fragment: outer Nesterov SGD on the (dequantized) merged gradient, computed into
fresh tensors and hashed on the way (`PendingUpdate`), so that every replica reaches the same Θ', m' and
checksum bit for bit. `GlobalReplica` applies it; the step is the core's (`protocol.diloco.outer_step`),
whose element-wise kernels live in `protocol.kernels`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from p2p_diloco.protocol import diloco, kernels
from p2p_diloco.protocol.checksum import FragmentHasher
from p2p_diloco.protocol.decisions import Action, Decision
from p2p_diloco.protocol.merge import ACCEPT, MergeTag, check_tensors

REFUSE = Action.REFUSE


# One step on one tensor: the core's (m' = mu*m + g; Θ' = Θ - lr*(g + mu*m'), no FMA; see its docstring).
nesterov_step = diloco.outer_step


@dataclass(frozen=True)
class PendingUpdate:
    """The result of one outer step on one fragment, computed but not applied (see `GlobalReplica.commit`)."""

    fragment: int
    from_version: int
    base_checksum: str  # checksum of the fragment this was computed from
    params: dict[str, Tensor]
    momentum: dict[str, Tensor]
    checksum: str  # checksum of the fragment after applying, at version from_version + 1

    @property
    def to_version(self) -> int:
        return self.from_version + 1


def check_outer_grad(outer_grad: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]]) -> Decision:
    """Names, shapes, float32 and finite values of an outer gradient (action accept/reject).
    `kernels.QuantizedTensor` values are decoded for the check."""
    return check_tensors(_decoded(outer_grad), shapes, norm_bound=None)


def outer_step(
    p: int,
    from_version: int,
    base_checksum: str,
    state: Mapping[str, tuple[Tensor, Tensor]],
    outer_grad: Mapping[str, Tensor],
    *,
    lr: float,
    momentum: float,
) -> PendingUpdate | Decision:
    """Fragment `p` after one outer step from `state` (name -> (Θ, m), in the plan's order: the checksum's
    order) at `from_version`; a refusal (REFUSE with its tag) if the gradient does not fit or the step
    overflows. Nothing is changed in place."""
    # Finiteness of the gradient is left to the step: a NaN or inf in g makes Θ' non-finite, and only
    # then is the gradient scanned, so the reason stays that of `check_outer_grad`. A gradient still in
    # int8 form (`kernels.QuantizedTensor`, from `decode_tensors(lazy=True)`) is checked by its shape
    # here and decoded inside the step.
    shapes = {name: tuple(theta.shape) for name, (theta, _) in state.items()}
    check = check_tensors(_placeholders(outer_grad), shapes, norm_bound=None, finite=False)
    if check.action != ACCEPT:
        return Decision(REFUSE, check.tag, check.detail)
    new_params: dict[str, Tensor] = {}
    new_momentum: dict[str, Tensor] = {}
    mu, rate = kernels.float32_scalar(momentum), kernels.float32_scalar(lr)
    to_version = from_version + 1
    hasher = FragmentHasher(to_version)
    for name, (param, moment) in state.items():  # plan order: the checksum's order
        new_params[name], new_momentum[name] = kernels.fresh(param.shape), kernels.fresh(param.shape)
        hasher.begin(name, tuple(param.shape))
        finite = diloco.outer_step_into(
            param,
            moment,
            outer_grad[name],
            new_params[name],
            new_momentum[name],
            mu=mu,
            rate=rate,
            on_theta=hasher.update,  # Θ' hashed a piece at a time while in cache
        )
        if not finite:
            check = check_outer_grad(outer_grad, shapes)
            if check.action != ACCEPT:
                return Decision(REFUSE, check.tag, check.detail)
            return Decision(REFUSE, MergeTag.NON_FINITE, f"outer step on fragment {p} overflows in {name}")
        hasher.update(_raw(new_momentum[name]))
    return PendingUpdate(
        fragment=p,
        from_version=from_version,
        base_checksum=base_checksum,
        params=new_params,
        momentum=new_momentum,
        checksum=hasher.hexdigest(),
    )


def _placeholders(grad: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """`grad` with each `kernels.QuantizedTensor` replaced by a float32 tensor of its shape on the meta
    device (no data): for the checks of names, shapes and dtype."""
    if not any(isinstance(g, kernels.QuantizedTensor) for g in grad.values()):
        return grad
    return {
        name: torch.empty(g.shape, device="meta") if isinstance(g, kernels.QuantizedTensor) else g
        for name, g in grad.items()
    }


def _decoded(grad: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """`grad` with each `kernels.QuantizedTensor` decoded."""
    if not any(isinstance(g, kernels.QuantizedTensor) for g in grad.values()):
        return grad
    return {name: g.decode() if isinstance(g, kernels.QuantizedTensor) else g for name, g in grad.items()}


def _raw(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.detach().reshape(-1).numpy()).cast("B")
