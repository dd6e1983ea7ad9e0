"""Building an update from a closed round: merge the screened contributions, encode the outer gradient,
compute the outer step once on the replica, and the unsigned `UpdateRecord` the synchronizer publishes
(`MergeOutcome`). Sparse codecs merge by union (`merge_union`, `swarm.sparse_rounds`): the record lists the
learner-signed deltas and bundles their frames, and every replica merges them itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import diloco
from p2p_diloco.protocol.decisions import Decision
from p2p_diloco.protocol.kernels import QuantizedTensor
from p2p_diloco.protocol.loss_score import LossScores, capped
from p2p_diloco.protocol.merge import merge_deltas
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.outer_step import PendingUpdate
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.standing import Earned, Standing
from p2p_diloco.protocol.sync_round import Contribution
from p2p_diloco.swarm.sparse_rounds import entry_of, merge_signed, weight_cap
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.delta_bundle import encode_bundle


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
        standing: Standing,
        scores: LossScores | None = None,
    ):
        self.peer_id = peer_id
        self.manifest = manifest
        self.replica = replica
        self.expected = expected  # per fragment: each tensor's shape (the synchronizer's, shared)
        self.embedding_names = frozenset(embedding_names)
        self.standing = standing  # `Standing.earned`: weight is earned, a newcomer's grows over its merges
        # `LossScores.factor`: a key whose checked deltas made the loss worse weighs less (`loss_score`)
        self.cap = scores.factor if scores is not None else None

    def merge(
        self, p: int, contributions: list[Contribution], *, live: int, term: int
    ) -> tuple[UpdateRecord, PendingUpdate, dict[str, torch.Tensor | QuantizedTensor]]:
        """Merge (by union for sparse codecs: `merge_union`), encode and compute the update of `p`. Sorts
        `contributions` by sender and drops their payloads once merged, in place: the float32 deltas are freed
        before the outer step."""
        if self.manifest.wire.codec.sparse:
            return self.merge_union(p, contributions, live=live, term=term)
        contributions.sort(key=lambda c: c.sender)
        earned = self._earned([(c.sender, diloco.merge_weight(c.tokens, c.steps)) for c in contributions])
        weights = list(earned.weights)
        merged = merge_deltas(
            [c.payload for c in contributions],
            weights,
            rule=self.manifest.diloco.merge_rule,
            embedding_names=self.embedding_names,
        )
        contributions[:] = [dataclasses.replace(c, payload=None) for c in contributions]
        # merge_deltas' tensors are fresh: scaled in place, by the contributors the round counts (weight is
        # earned: a round of new keys counts less than its number) over the live learners, or over its number
        over = live if self.manifest.diloco.outer_scaling == "contributors" else len(contributions)
        diloco.scale_to_live(list(merged.values()), earned.counted, over)
        wire = self.manifest.wire
        payload = encode_tensors(merged, codec=wire.codec, block_size=wire.block_size)
        del merged  # the update is its encoding from here on
        # Everyone applies the decoded (quantized) gradient, the holder included, so replicas agree.
        decoded = decode_tensors(
            payload, expected_shapes=self.expected[p], max_bytes=wire.max_message_bytes, lazy=True
        )
        cfg = self.manifest.diloco
        pending = self.replica.compute_update(p, decoded, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        contributors = tuple((c.sender, float(w)) for c, w in zip(contributions, weights))
        record = self._record(p, term, contributors, tuple(c.seq for c in contributions), pending, payload)
        return record, pending, decoded

    def _earned(self, claims: list[tuple[str, float]]) -> Earned:
        """The round's merge weights: `Standing.earned`, each at most its key's loss-score cap (`capped`)."""
        earned = self.standing.earned(claims)
        return earned if self.cap is None else capped(earned, claims, self.cap)

    def _record(
        self,
        p: int,
        term: int,
        contributors: tuple[tuple[str, float], ...],
        seqs: tuple[int, ...],
        pending: PendingUpdate,
        payload: bytes,
        **union: object,
    ) -> UpdateRecord:
        """The unsigned record of `p`'s update from the replica's current version (`union`: the listing
        and live count of a sparse round)."""
        return UpdateRecord(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=p,
            from_version=self.replica.versions()[p],
            term=term,
            leader=self.peer_id,
            contributors=contributors,
            seqs=seqs,
            checksum=pending.checksum,
            payload=payload,
            **union,  # type: ignore[arg-type]
        )

    def merge_union(
        self, p: int, contributions: list[Contribution], *, live: int, term: int
    ) -> tuple[UpdateRecord, PendingUpdate, dict[str, torch.Tensor | QuantizedTensor]]:
        """The update of a sparse round: exactly the union merge of its signed deltas, listing them with
        their earned weights and bundling their frames (no outer residual). Weights: the signed tokens (at
        most H steps' worth, `weight_cap`) as `Standing.earned` leaves them; every replica merges with the
        listed weights and refuses one above the signed tokens, while the history behind the earned part is
        this holder's (a replica that installed a snapshot lacks it, and every replica must merge alike)."""
        max_bytes = self.manifest.wire.max_message_bytes
        entries = sorted(
            (entry_of(c.sender, c.frame, max_bytes) for c in contributions),
            key=lambda e: (e.learner, e.header.seq),
        )
        contributions[:] = [dataclasses.replace(c, payload=None) for c in contributions]
        cap = weight_cap(self.manifest)
        claims = [
            (e.learner, float(e.header.tokens if cap is None else min(e.header.tokens, cap))) for e in entries
        ]
        weights = [max(1, int(w)) for w in self._earned(claims).weights]
        grad = merge_signed(entries, self.expected[p], manifest=self.manifest, live=live, weights=weights)
        cfg = self.manifest.diloco
        pending = self.replica.compute_update(p, grad, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        listed = tuple(dataclasses.replace(e.listed, weight=w) for e, w in zip(entries, weights))
        contributors = tuple((d.learner, float(d.weight)) for d in listed)
        bundle = encode_bundle([e.frame for e in entries])
        seqs = tuple(d.seq for d in listed)
        record = self._record(p, term, contributors, seqs, pending, bundle, deltas=listed, live=live)
        return record, pending, dict(grad)


def dense(tensors: Mapping[str, torch.Tensor | QuantizedTensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every int8 one decoded to float32 (the others as they are)."""
    return {n: t.decode() if isinstance(t, QuantizedTensor) else t for n, t in tensors.items()}
