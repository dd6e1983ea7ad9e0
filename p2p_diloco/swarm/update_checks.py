"""What a replica checks in an update's content before it touches the replica (after the record's
signature, its leader's lease and its place in the fragment's history were checked by `Peer`/`Repair`).

A leaseholder is trusted to merge, not to write anything it likes: a replica refuses an update whose
payload is not in the manifest's codec (an fp32 frame where the run says int8 carries arbitrary values),
holds a non-finite value, has a tensor whose RMS is above what AdamW can move in the most steps a delta
may count (the bound the synchronizer's delta screen uses, so a merge of screened deltas stays below
it), or whose contributors include peers that may not learn or weights no learner can earn under the
schedule (steps capped at `max_steps_factor` x H, tokens per step fixed by the manifest). The checks
depend on the update and the manifest only, so every replica reaches the same verdict; the synchronizer
runs them on its own updates too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import kernels
from p2p_diloco.protocol.messages import UpdateRecord, UpdateTag
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.wire.codec import frame_codec


class UpdateChecks:
    def __init__(self, manifest: RunManifest, num_fragments: int, robust: RobustGuard):
        self.manifest = manifest
        self.robust = robust
        tps = robust.tokens_per_step * (1 + robust.config.token_tolerance)
        self.max_weight = robust.max_steps * tps * tps * (1 + 1e-6)
        self.max_rms = robust.config.prior_factor * manifest.diloco.inner_lr * robust.max_steps

    def check_payload(self, record: UpdateRecord) -> tuple[str, str] | None:
        """Before decoding: the payload's codec must be the manifest's."""
        codec = frame_codec(record.payload)
        if codec != self.manifest.wire.codec:
            return UpdateTag.WRONG_CODEC, f"payload is {codec}, the manifest says {self.manifest.wire.codec}"
        return self.check_contributors(record)

    def check_contributors(self, record: UpdateRecord) -> tuple[str, str] | None:
        for peer, weight in record.contributors:
            if not self.manifest.may_learn(peer):
                return UpdateTag.UNKNOWN_CONTRIBUTOR, f"{peer} may not learn in this run"
            if self.robust.config.enabled and weight > self.max_weight:
                return (
                    UpdateTag.IMPLAUSIBLE_WEIGHT,
                    f"{peer}'s weight {weight:.3g} > {self.max_weight:.3g} allowed",
                )
        return None

    def check_values(
        self, fragment: int, grad: Mapping[str, Tensor | kernels.QuantizedTensor]
    ) -> tuple[str, str] | None:
        """After decoding: finite values, and no tensor whose RMS exceeds what AdamW can move in the most
        steps a delta may count (`[robust] prior_factor` x inner_lr x max_steps): a merge of screened
        deltas never does, a destructive update (random weights, a huge step) does by orders of magnitude.
        A tensor still in int8 form is finite by construction (its decoding checked the block scales)."""
        return self.value_check(fragment, grad).problem

    def value_check(self, fragment: int, grad: Mapping[str, Tensor | kernels.QuantizedTensor]) -> ValueCheck:
        """`check_values`, with the fragment's L2 norm it computed on the way (None where the robust
        checks are off), which the direction reference reuses instead of a second pass."""
        squares = 0.0
        for name, tensor in grad.items():
            if not isinstance(tensor, kernels.QuantizedTensor) and not kernels.all_finite(tensor):
                return ValueCheck((UpdateTag.NOT_FINITE, f"{name} holds NaN or inf"))
            if not self.robust.config.enabled or tensor.numel() == 0:
                continue
            tensor_squares = kernels.sum_squares64(tensor)
            squares += tensor_squares
            rms = math.sqrt(tensor_squares) / math.sqrt(tensor.numel())
            if rms > self.max_rms:
                detail = f"{name} RMS {rms:.3g} > {self.max_rms:.3g} (prior_factor x inner_lr x max steps)"
                return ValueCheck((UpdateTag.TOO_LARGE, detail))
        return ValueCheck(None, math.sqrt(squares) if self.robust.config.enabled else None)


@dataclass(frozen=True)
class ValueCheck:
    problem: tuple[str, str] | None  # (tag, detail) of the first problem found, None when the values pass
    norm: float | None = None  # the fragment's L2 norm (float64 sums), when computed
