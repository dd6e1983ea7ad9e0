"""What a replica checks in an update's content before it touches the replica (after the record's
signature, its leader's lease and its place in the fragment's history were checked by `Peer`/`Repair`).

A leaseholder is trusted to merge, not to write anything it likes: a replica refuses an update whose
payload is not in the manifest's codec (an fp32 frame where the run says int8 carries arbitrary values),
holds a non-finite value, whose outer-gradient RMS is far above those of the updates this replica
applied recently (`[robust] reject_factor` times their median, once `min_history` are known), or whose
contributors include peers that may not learn or weights no learner can earn under the schedule (steps
capped at `max_steps_factor` x H, tokens per step fixed by the manifest). The synchronizer runs the same
checks on its own updates, so every replica that applied the same history reaches the same verdict.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping

import torch
from torch import Tensor

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.wire.codec import frame_codec

WRONG_CODEC = "wrong codec"
NOT_FINITE = "not finite"
RMS_OUTLIER = "update rms outlier"
UNKNOWN_CONTRIBUTOR = "unknown contributor"
IMPLAUSIBLE_WEIGHT = "implausible weight"
RMS_HISTORY = 16


class UpdateChecks:
    def __init__(self, manifest: RunManifest, num_fragments: int, robust: RobustGuard):
        self.manifest = manifest
        self.robust = robust
        self.rms: list[deque[float]] = [deque(maxlen=RMS_HISTORY) for _ in range(num_fragments)]
        tps = robust.tokens_per_step * (1 + robust.config.token_tolerance)
        self.max_weight = robust.max_steps * tps * tps * (1 + 1e-6)

    def check_payload(self, record: UpdateRecord) -> tuple[str, str] | None:
        """Before decoding: the payload's codec must be the manifest's."""
        codec = frame_codec(record.payload)
        if codec != self.manifest.wire.codec:
            return WRONG_CODEC, f"payload is {codec}, the manifest says {self.manifest.wire.codec}"
        return self.check_contributors(record)

    def check_contributors(self, record: UpdateRecord) -> tuple[str, str] | None:
        for peer, weight in record.contributors:
            if not self.manifest.may_learn(peer):
                return UNKNOWN_CONTRIBUTOR, f"{peer} may not learn in this run"
            if self.robust.config.enabled and weight > self.max_weight:
                return IMPLAUSIBLE_WEIGHT, f"{peer}'s weight {weight:.3g} > {self.max_weight:.3g} allowed"
        return None

    def check_values(self, fragment: int, grad: Mapping[str, Tensor]) -> tuple[str, str] | None:
        """After decoding: finite values, and an RMS within bounds of the recently applied updates'."""
        total, count = 0.0, 0
        for name, tensor in grad.items():
            if not bool(torch.isfinite(tensor).all()):
                return NOT_FINITE, f"{name} holds NaN or inf"
            total += float(torch.linalg.vector_norm(tensor, dtype=torch.float64)) ** 2
            count += tensor.numel()
        rms = math.sqrt(total / max(count, 1))
        recent = self.rms[fragment]
        cfg = self.robust.config
        if cfg.enabled and len(recent) >= cfg.min_history:
            bound = cfg.reject_factor * statistics.median(recent)
            if rms > bound:
                return (
                    RMS_OUTLIER,
                    f"rms {rms:.3g} > {cfg.reject_factor} x median of recent updates {bound:.3g}",
                )
        return None

    def observe(self, fragment: int, grad: Mapping[str, Tensor]) -> None:
        """An update was applied: remember its RMS."""
        total = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in grad.values())
        count = sum(t.numel() for t in grad.values())
        self.rms[fragment].append(math.sqrt(total / max(count, 1)))
