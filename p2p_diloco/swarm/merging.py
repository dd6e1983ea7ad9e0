"""Building an update from a closed round: merge the screened contributions, encode the outer gradient
(with error feedback for sparse codecs), compute the outer step once on the replica, and the unsigned
`UpdateRecord` the synchronizer publishes (`MergeOutcome`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol.decisions import Decision
from p2p_diloco.protocol.kernels import QuantizedTensor
from p2p_diloco.protocol.merge import merge_deltas
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.outer_step import PendingUpdate
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.sync_round import Contribution
from p2p_diloco.wire.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.feedback import ErrorFeedback


@dataclass(frozen=True)
class MergeOutcome:
    """A closed round: the update to publish, and its outer step already computed (applied as is)."""

    record: UpdateRecord
    decision: Decision  # why the round closed (`SynchronizerRounds.ready`)
    pending: PendingUpdate
    outer_grad: dict[str, torch.Tensor | QuantizedTensor]  # int8 gradients stay int8 (decode_tensors lazy)


class Merger:
    """Merges one fragment's closed round into an update of `replica` (never changing the replica)."""

    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        replica: GlobalReplica,
        expected: Sequence[Mapping[str, tuple[int, ...]]],
        embedding_names: Collection[str],
        ramp: Callable[[str], float],
        outer_feedback: ErrorFeedback | None,
    ):
        self.peer_id = peer_id
        self.manifest = manifest
        self.replica = replica
        self.expected = expected  # per fragment: each tensor's shape (the synchronizer's, shared)
        self.embedding_names = frozenset(embedding_names)
        self.ramp = ramp  # `Standing.ramp`: a newcomer's weight grows over its first merges
        self.outer_feedback = outer_feedback

    def merge(
        self, p: int, contributions: list[Contribution], *, live: int, term: int
    ) -> tuple[UpdateRecord, PendingUpdate, dict[str, torch.Tensor | QuantizedTensor]]:
        """Merge, encode and compute the update of `p`. Sorts `contributions` by sender and drops their
        payloads once merged, in place: the float32 deltas are freed before the outer step."""
        contributions.sort(key=lambda c: c.sender)
        weights = [c.weight * self.ramp(c.sender) for c in contributions]
        merged = merge_deltas(
            [c.payload for c in contributions],
            weights,
            rule=self.manifest.diloco.merge_rule,
            embedding_names=self.embedding_names,
        )
        contributions[:] = [dataclasses.replace(c, payload=None) for c in contributions]
        if self.manifest.diloco.outer_scaling == "contributors" and len(contributions) < live:
            scale = torch.tensor(len(contributions) / live, dtype=torch.float32)
            for t in merged.values():  # merge_deltas returns fresh tensors: scaled in place, no copy
                t.mul_(scale)
        wire = self.manifest.wire
        if self.outer_feedback is not None:
            payload, _ = self.outer_feedback.compress(p, merged)
        else:
            payload = encode_tensors(merged, codec=wire.codec, block_size=wire.block_size)
        del merged  # the update is its encoding from here on
        # Everyone applies the decoded (quantized) gradient, the holder included, so replicas agree.
        decoded = decode_tensors(
            payload, expected_shapes=self.expected[p], max_bytes=wire.max_message_bytes, lazy=True
        )
        cfg = self.manifest.diloco
        pending = self.replica.compute_update(p, decoded, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        record = UpdateRecord(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=p,
            from_version=self.replica.versions()[p],
            term=term,
            leader=self.peer_id,
            contributors=tuple((c.sender, float(w)) for c, w in zip(contributions, weights)),
            seqs=tuple(c.seq for c in contributions),
            checksum=pending.checksum,
            payload=payload,
        )
        return record, pending, decoded


def dense(tensors: Mapping[str, torch.Tensor | QuantizedTensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every int8 one decoded to float32 (the others as they are)."""
    return {n: t.decode() if isinstance(t, QuantizedTensor) else t for n, t in tensors.items()}


def outer_feedback_for(manifest: RunManifest) -> ErrorFeedback | None:
    """The synchronizer's residual store for outer gradients: one when the codec is sparse, else None."""
    wire = manifest.wire
    if not wire.codec.sparse:
        return None
    return ErrorFeedback(wire.codec, wire.block_size, density=wire.density, decay=wire.feedback_decay)
