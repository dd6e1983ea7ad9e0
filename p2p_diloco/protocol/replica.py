"""`GlobalReplica`: the CPU fp32 copy of the global state (Θ, m, v per fragment) that every peer holds.

Every peer applies each published outer update itself (outer Nesterov SGD on the dequantized merged
gradient) and compares the result with the checksum in the update, so all replicas agree bit for bit.
This module owns the state, the checksums and digest, version ordering (duplicates and gaps are
refused, never silently applied), loading fragments fetched from other peers and persistence to disk;
the step itself is `protocol.outer_step`.

The fragment checksum is `protocol.checksum.fragment_checksum` (BLAKE3, format v2; v1 files still load).
The digest of the replica is blake2b over the fragment checksums in fragment order, so equal digests
mean identical replicas.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from p2p_diloco.protocol.checksum import (
    CHECKSUM_DOMAIN,
    fragment_checksum,
    fragment_checksum_v1,
)
from p2p_diloco.protocol.decisions import Action, Decision
from p2p_diloco.protocol.merge import ACCEPT, MergeTag, check_tensors
from p2p_diloco.protocol.outer_step import PendingUpdate, check_outer_grad, outer_step

if TYPE_CHECKING:
    from p2p_diloco.protocol.fragments import FragmentPlan

# Actions.
APPLY, LOAD, REFUSE = Action.APPLY, Action.LOAD, Action.REFUSE


class ReplicaTag(StrEnum):
    """Why the replica applied, loaded or refused. Gradient and snapshot checks also use the `MergeTag`s
    of `merge.check_tensors` (snapshots report missing/unexpected tensors as WRONG_SHAPE)."""

    APPLIED = "applied"
    DUPLICATE_UPDATE = "duplicate update"  # from_version < version: already applied, ignore
    OUT_OF_ORDER = "out of order"  # from_version > version: a gap, replay the missing updates or fetch
    CHECKSUM_MISMATCH = "checksum mismatch"  # the replica is unchanged; refetch the fragment from a peer
    LOADED = "loaded"
    OLDER_THAN_REPLICA = "older than replica"


class GlobalReplica:
    """Θ, m and v for every fragment of `plan`, on CPU in float32; tensors are never handed out uncopied.

    `initial` must hold every name of the plan (extra names, e.g. buffers, are ignored). Momentum starts
    at zero and every version at 0.
    """

    def __init__(self, plan: FragmentPlan, initial: Mapping[str, Tensor]):
        self.plan = plan
        seen: set[str] = set()
        for p in range(plan.num_fragments):
            for name in plan.names(p):
                if name in seen:
                    raise ValueError(f"tensor {name} appears in more than one fragment of the plan")
                seen.add(name)
        missing = sorted(seen - set(initial))
        if missing:
            raise ValueError(f"initial parameters lack {len(missing)} tensors of the plan: {missing[:5]}")
        self._params: list[dict[str, Tensor]] = []
        self._momentum: list[dict[str, Tensor]] = []
        for p in range(plan.num_fragments):
            params = {name: _cpu_fp32_copy(initial[name]) for name in plan.names(p)}
            self._params.append(params)
            self._momentum.append({name: torch.zeros_like(t) for name, t in params.items()})
        self._versions = [0] * plan.num_fragments
        # Checksum cache: valid because internal tensors are never handed out or changed in place.
        self._checksums: list[str | None] = [None] * plan.num_fragments

    @classmethod
    def from_fragments(
        cls,
        plan: FragmentPlan,
        states: Callable[[int], tuple[int, Mapping[str, Tensor], Mapping[str, Tensor], str]],
    ) -> GlobalReplica:
        """A replica built fragment by fragment from `states(p) = (version, Θ_p, m_p, checksum)` (e.g. read
        from disk one fragment at a time), each checked like `load_fragment`: the peak memory is the replica
        plus one fragment, not twice the replica. Raises ValueError with the refusal's reason."""
        replica = cls.__new__(cls)
        replica.plan = plan
        replica._params, replica._momentum = [], []
        replica._versions, replica._checksums = [], []
        for p in range(plan.num_fragments):
            version, params, momentum, checksum = states(p)
            names = plan.names(p)
            shapes = {name: tuple(params[name].shape) for name in names if name in params}
            if plan.numels and [params[n].numel() for n in names if n in params] != list(plan.numels[p]):
                raise ValueError(f"{MergeTag.WRONG_SHAPE}: fragment {p} tensor sizes differ from the plan's")
            for what, tensors in (("params", params), ("momentum", momentum)):
                if set(tensors) != set(names):
                    raise ValueError(
                        f"{MergeTag.WRONG_SHAPE}: fragment {p} {what} do not hold the plan's tensors"
                    )
                check = check_tensors(tensors, shapes, norm_bound=None)
                if check.action != ACCEPT:
                    raise ValueError(f"fragment {p} {what}: {check.reason}")
            got = fragment_checksum(names, params, momentum, version)
            if got != checksum and fragment_checksum_v1(names, params, momentum, version) != checksum:
                raise ValueError(
                    f"{ReplicaTag.CHECKSUM_MISMATCH}: fragment {p} v{version} hashes to {got[:16]}, "
                    f"expected {checksum[:16]}"
                )
            replica._params.append({name: _cpu_fp32_copy(params[name]) for name in names})
            replica._momentum.append({name: _cpu_fp32_copy(momentum[name]) for name in names})
            replica._versions.append(int(version))
            replica._checksums.append(got)
        return replica

    # ---- reading -------------------------------------------------------------------------------------

    @property
    def num_fragments(self) -> int:
        return len(self._params)

    def versions(self) -> tuple[int, ...]:
        return tuple(self._versions)

    def version(self, fragment: int) -> int:
        return self._versions[self._index(fragment)]

    def shapes(self, fragment: int) -> dict[str, tuple[int, ...]]:
        """Expected shapes of the fragment's tensors, in plan order (for `merge.validate_delta`)."""
        return {name: tuple(t.shape) for name, t in self._params[self._index(fragment)].items()}

    def checksum(self, fragment: int) -> str:
        p = self._index(fragment)
        cached = self._checksums[p]
        if cached is None:
            cached = fragment_checksum(
                self.plan.names(p), self._params[p], self._momentum[p], self._versions[p]
            )
            self._checksums[p] = cached
        return cached

    def digest(self) -> str:
        """blake2b over all fragment checksums in order: equal digests <=> identical replicas."""
        h = hashlib.blake2b(CHECKSUM_DOMAIN + b".digest", digest_size=32)
        for p in range(self.num_fragments):
            h.update(bytes.fromhex(self.checksum(p)))
        return h.hexdigest()

    def frozen(self) -> GlobalReplica:
        """This moment's replica, sharing its tensors (never changed in place): cheap to take under a lock,
        then saved or digested outside it while this one moves on."""
        twin = copy.copy(self)
        twin._params = [dict(params) for params in self._params]
        twin._momentum = [dict(momentum) for momentum in self._momentum]
        twin._versions = list(self._versions)
        twin._checksums = list(self._checksums)
        return twin

    def params_of(self, fragment: int) -> dict[str, Tensor]:
        return {name: t.clone() for name, t in self._params[self._index(fragment)].items()}

    def params_view(self, fragment: int) -> Mapping[str, Tensor]:
        """Theta_p without copies: the replica replaces its tensors and never changes them in place, so
        the values stay those of this version for whoever keeps them (a learner's anchor). Read only."""
        return dict(self._params[self._index(fragment)])

    def export_params(self) -> dict[str, Tensor]:
        return {name: t.clone() for params in self._params for name, t in params.items()}

    def snapshot(self, fragment: int) -> tuple[int, dict[str, Tensor], dict[str, Tensor]]:
        """(version, params, momentum) copies: what a peer serves to one fetching this fragment."""
        p = self._index(fragment)
        params = {name: t.clone() for name, t in self._params[p].items()}
        momentum = {name: t.clone() for name, t in self._momentum[p].items()}
        return self._versions[p], params, momentum

    # ---- outer updates -------------------------------------------------------------------------------

    def check_outer_grad(self, fragment: int, outer_grad: Mapping[str, Tensor]) -> Decision:
        """Names, shapes, float32 and finite values of an outer gradient for `fragment` (action
        accept/reject). `kernels.QuantizedTensor` values are decoded for the check."""
        return check_outer_grad(outer_grad, self.shapes(fragment))

    def compute_update(
        self, fragment: int, outer_grad: Mapping[str, Tensor], *, lr: float, momentum: float
    ) -> PendingUpdate:
        """The fragment after one outer step from its current state; the replica is not changed.

        Raises ValueError (message starting with a reason tag) if the gradient fails `check_outer_grad`
        or the step overflows to non-finite values: every replica would reach the same, so a
        synchronizer must not publish it.
        """
        result = self._step(self._index(fragment), outer_grad, lr=lr, momentum=momentum)
        if isinstance(result, Decision):
            raise ValueError(result.reason)
        return result

    def _step(
        self, p: int, outer_grad: Mapping[str, Tensor], *, lr: float, momentum: float
    ) -> PendingUpdate | Decision:
        return outer_step(
            p,
            self._versions[p],
            self.checksum(p),
            {name: (self._params[p][name], self._momentum[p][name]) for name in self.plan.names(p)},
            outer_grad,
            lr=lr,
            momentum=momentum,
        )

    def apply(
        self,
        fragment: int,
        from_version: int,
        outer_grad: Mapping[str, Tensor],
        *,
        lr: float,
        momentum: float,
        expected_checksum: str | None,
    ) -> Decision:
        """Apply the update from_version -> from_version + 1 if it is the next one and its checksum matches.

        With `expected_checksum=None` the result is not verified (for a peer's own computation).
        """
        p = self._index(fragment)
        order = self._check_order(p, from_version)
        if order is not None:
            return order
        result = self._step(p, outer_grad, lr=lr, momentum=momentum)
        if isinstance(result, Decision):
            return result
        return self._install(result, expected_checksum, copy=False)

    def commit(self, pending: PendingUpdate, *, expected_checksum: str | None = None) -> Decision:
        """Install a `PendingUpdate` (e.g. the synchronizer's own, computed once for publishing and applying).

        Refused like `apply`, and with "checksum mismatch" if the fragment changed since it was computed.
        """
        return self._install(pending, expected_checksum, copy=True)

    def _install(self, pending: PendingUpdate, expected_checksum: str | None, *, copy: bool) -> Decision:
        p = self._index(pending.fragment)
        order = self._check_order(p, pending.from_version)
        if order is not None:
            return order
        if pending.base_checksum != self.checksum(p):
            return Decision(
                REFUSE,
                ReplicaTag.CHECKSUM_MISMATCH,
                f"fragment {p} changed since the update was computed; recompute",
            )
        if expected_checksum is not None and pending.checksum != expected_checksum:
            return Decision(
                REFUSE,
                ReplicaTag.CHECKSUM_MISMATCH,
                f"fragment {p} v{pending.to_version} computed {pending.checksum[:16]}, "
                f"update says {expected_checksum[:16]}; replica unchanged, refetch the fragment",
            )
        # A caller's PendingUpdate is copied so later edits of its dicts cannot reach the replica.
        self._params[p] = {name: t.clone() if copy else t for name, t in pending.params.items()}
        self._momentum[p] = {name: t.clone() if copy else t for name, t in pending.momentum.items()}
        self._versions[p] = pending.to_version
        self._checksums[p] = pending.checksum
        return Decision(
            APPLY, ReplicaTag.APPLIED, f"fragment {p} v{pending.from_version} -> v{pending.to_version}"
        )

    def _check_order(self, p: int, from_version: int) -> Decision | None:
        current = self._versions[p]
        if from_version < current:
            return Decision(
                REFUSE,
                ReplicaTag.DUPLICATE_UPDATE,
                f"fragment {p} update from v{from_version}, replica is at v{current}",
            )
        if from_version > current:
            return Decision(
                REFUSE,
                ReplicaTag.OUT_OF_ORDER,
                f"fragment {p} update from v{from_version}, replica is at v{current}; "
                f"replay v{current}..v{from_version} or fetch the fragment",
            )
        return None

    # ---- fetched fragments ---------------------------------------------------------------------------

    def load_fragment(
        self,
        fragment: int,
        version: int,
        params: Mapping[str, Tensor],
        momentum: Mapping[str, Tensor],
        expected_checksum: str,
        *,
        force: bool = False,
        adopt: bool = False,
    ) -> Decision:
        """Replace a fragment with one fetched from a peer, after checking shapes, values and checksum.

        A version older than the replica's is refused unless `force` (reconciling after a losing branch);
        the same version is accepted (refetch after a checksum mismatch). `adopt`: the caller hands over
        its (contiguous CPU float32) tensors and keeps no reference, so they are installed without a copy.
        """
        p = self._index(fragment)
        if version < self._versions[p] and not force:
            return Decision(
                REFUSE,
                ReplicaTag.OLDER_THAN_REPLICA,
                f"fragment {p} snapshot is v{version}, replica is at v{self._versions[p]}",
            )
        shapes = self.shapes(p)
        for what, tensors in (("params", params), ("momentum", momentum)):
            check = check_tensors(tensors, shapes, norm_bound=None)
            if check.action != ACCEPT:
                tag, detail = check.tag, check.detail
                if tag in (
                    MergeTag.MISSING_TENSOR,
                    MergeTag.UNEXPECTED_TENSOR,
                ):  # a snapshot of another layout
                    tag, detail = MergeTag.WRONG_SHAPE, check.reason
                return Decision(REFUSE, tag, f"{what}: {detail}")
        names = self.plan.names(p)
        got = fragment_checksum(names, params, momentum, version)
        if got != expected_checksum:
            return Decision(
                REFUSE,
                ReplicaTag.CHECKSUM_MISMATCH,
                f"fragment {p} snapshot v{version} hashes to {got[:16]}, "
                f"expected {expected_checksum[:16]}; replica unchanged",
            )
        take = _take if adopt else _cpu_fp32_copy
        self._params[p] = {name: take(params[name]) for name in names}
        self._momentum[p] = {name: take(momentum[name]) for name in names}
        previous, self._versions[p] = self._versions[p], version
        self._checksums[p] = got
        return Decision(LOAD, ReplicaTag.LOADED, f"fragment {p} v{previous} -> v{version}")

    def fragment_state(self, fragment: int) -> tuple[int, Mapping[str, Tensor], Mapping[str, Tensor]]:
        """(version, Theta_p, m_p) without copies (read only; the tensors are never changed in place)."""
        p = self._index(fragment)
        return self._versions[p], dict(self._params[p]), dict(self._momentum[p])

    # ---- helpers -------------------------------------------------------------------------------------

    def _index(self, fragment: int) -> int:
        if not 0 <= fragment < len(self._params):
            raise IndexError(f"fragment {fragment} out of range 0..{len(self._params) - 1}")
        return fragment


def _cpu_fp32_copy(t: Tensor) -> Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()


def _take(t: Tensor) -> Tensor:
    """`t` itself if it is already a contiguous CPU float32 tensor, else a copy."""
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
        return t.detach()
    return _cpu_fp32_copy(t)
