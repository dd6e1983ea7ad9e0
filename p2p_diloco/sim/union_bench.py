"""Union aggregation in the in-process swarm, for `scripts/bench_quality.py`'s `*_union*` variants.

Issue #30 makes a sparse round's update exactly the union merge of the accepted sparse deltas
(`protocol.union_merge`: clipped to the round's median norm, averaged where indices overlap, nothing
re-sparsified, no outer residual), and every replica computes that merge and the outer step itself from
the deltas the update record lists. Until the swarm does that (helper "sw", `swarm/`), this module lets the
benchmark measure the *training quality* of that rule with the real peers, learners and synchronizer:

- `UnionMerger` stands in for `swarm.merging.Merger`: it rebuilds each contribution's sparse entries from
  its decoded delta (the nonzero entries: a sparse codec sends no zero value unless a whole chunk's kept
  magnitudes are zero), merges them with `union_merge`, applies the manifest's outer scaling, and publishes
  the merged outer gradient losslessly (an fp32 frame) in place of the listed deltas every replica would
  fetch and merge itself. The outer step (lr, momentum) is the manifest's, computed once as today.
- `union_aggregation()` installs it for the duration of a `with` block (and lets the learners' update
  checks take the fp32 frame), restoring both on exit.

The bytes a replica would fetch are the listed deltas themselves; `scripts/bench_quality.py` counts them
for the down direction (the record's header plus every listed delta frame), not the fp32 stand-in.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

import torch

from p2p_diloco.protocol.kernels import QuantizedTensor
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.outer_step import PendingUpdate
from p2p_diloco.protocol.sync_round import Contribution
from p2p_diloco.protocol.union_merge import SparseContribution, SparseTensor, union_merge
from p2p_diloco.swarm import synchronizer, updates
from p2p_diloco.swarm.merging import Merger
from p2p_diloco.wire.codec import decode_tensors, encode_tensors

STAND_IN_CODEC = "fp32"  # the merged gradient travels losslessly in the sim


def sparse_entries(tensors: Mapping[str, torch.Tensor]) -> dict[str, SparseTensor]:
    """The nonzero entries of each decoded (dense float32) tensor, as `union_merge` takes them."""
    out = {}
    for name, t in tensors.items():
        flat = t.detach().reshape(-1).to(torch.float32)
        idx = torch.nonzero(flat, as_tuple=True)[0].to(torch.int64)
        out[name] = SparseTensor(tuple(t.shape), idx, flat[idx].clone())
    return out


class UnionMerger(Merger):
    """`Merger` whose update is the union merge of the round's sparse deltas (module docstring)."""

    def merge(
        self, p: int, contributions: list[Contribution], *, live: int, term: int
    ) -> tuple[UpdateRecord, PendingUpdate, dict[str, torch.Tensor | QuantizedTensor]]:
        contributions.sort(key=lambda c: c.sender)
        weights = [c.weight * self.ramp(c.sender) for c in contributions]
        shapes = self.expected[p]
        merged = union_merge(
            [
                SparseContribution(c.sender, c.seq, float(w), sparse_entries(c.payload))
                for c, w in zip(contributions, weights)
            ],
            shapes,
        ).tensors
        contributions[:] = [dataclasses.replace(c, payload=None) for c in contributions]
        if self.manifest.diloco.outer_scaling == "contributors" and len(contributions) < live:
            scale = torch.tensor(len(contributions) / live, dtype=torch.float32)
            for t in merged.values():
                t.mul_(scale)
        wire = self.manifest.wire
        payload = encode_tensors(merged, codec=STAND_IN_CODEC, block_size=wire.block_size)
        decoded = decode_tensors(payload, expected_shapes=shapes, max_bytes=wire.max_message_bytes, lazy=True)
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


@contextlib.contextmanager
def union_aggregation() -> Iterator[None]:
    """Within the block, synchronizers built merge by `UnionMerger` and update checks take its fp32 frame
    whatever the manifest's codec (the frame stands in for the listed deltas; module docstring)."""
    original_merger = synchronizer.Merger
    original_check = updates.UpdateChecks.check_payload

    def check_payload(self: updates.UpdateChecks, record: UpdateRecord) -> tuple[str, str] | None:
        return self.check_contributors(record)

    synchronizer.Merger = UnionMerger  # type: ignore[misc]
    updates.UpdateChecks.check_payload = check_payload  # type: ignore[method-assign]
    try:
        yield
    finally:
        synchronizer.Merger = original_merger  # type: ignore[misc]
        updates.UpdateChecks.check_payload = original_check  # type: ignore[method-assign]
