"""sim.union_bench: the benchmark's union aggregation is exactly `union_merge` of the round's sparse deltas
(then the manifest's outer step), and its patch of the swarm is undone on exit."""

from __future__ import annotations

import dataclasses

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.sync_round import Contribution
from p2p_diloco.protocol.union_merge import SparseContribution, union_merge
from p2p_diloco.sim.union_bench import UnionMerger, sparse_entries, union_aggregation
from p2p_diloco.swarm import synchronizer, updates
from p2p_diloco.swarm.merging import Merger

SHAPES = {"a": (4, 8), "b": (16,)}


def _sparse(gen: torch.Generator, shape: tuple[int, ...], keep: int) -> torch.Tensor:
    flat = torch.zeros(torch.Size(shape).numel())
    at = torch.randperm(flat.numel(), generator=gen)[:keep]
    flat[at] = torch.randn(keep, generator=gen)
    return flat.reshape(shape)


def test_sparse_entries_are_the_nonzero_entries_in_order():
    t = torch.tensor([[0.0, 1.5], [0.0, -2.0]])
    entries = sparse_entries({"t": t})["t"]
    assert entries.shape == (2, 2)
    assert entries.indices.tolist() == [1, 3]
    assert entries.values.tolist() == [1.5, -2.0]
    assert torch.equal(entries.to_dense(), t)


def test_union_merger_update_is_the_union_merge_then_the_outer_step():
    manifest = RunManifest.load("peers/demo.toml")
    manifest = dataclasses.replace(
        manifest, diloco=dataclasses.replace(manifest.diloco, outer_lr=1.0, outer_momentum=0.0)
    )
    plan = plan_fragments(list(SHAPES.items()), 1)
    initial = {n: torch.zeros(s) for n, s in SHAPES.items()}
    replica = GlobalReplica(plan, initial)
    merger = UnionMerger("holder", manifest, replica, [SHAPES], (), lambda sender: 1.0, None)
    gen = torch.Generator().manual_seed(3)
    deltas = {f"learner-{i}": {n: _sparse(gen, s, 5) for n, s in SHAPES.items()} for i in range(3)}
    contributions = [
        Contribution(
            sender=s, anchor_version=0, tokens=64 * (i + 1), steps=4, received_at=0.0, payload=d, seq=i
        )
        for i, (s, d) in enumerate(deltas.items())
    ]
    expected = union_merge(
        [
            SparseContribution(c.sender, c.seq, c.weight, sparse_entries(deltas[c.sender]))
            for c in contributions
        ],
        SHAPES,
    ).tensors
    record, pending, grad = merger.merge(0, list(contributions), live=3, term=1)
    for name in SHAPES:
        assert torch.equal(grad[name], expected[name])
        # nothing re-sparsified: every index some learner sent is in the update
        sent = sum(deltas[s][name] != 0 for s in deltas)
        assert torch.equal(grad[name] != 0, sent > 0)
    assert record.seqs == (0, 1, 2)
    assert [name for name, _ in record.contributors] == list(deltas)
    assert pending.checksum == record.checksum


def test_union_aggregation_patches_the_swarm_only_within_the_block():
    check = updates.UpdateChecks.check_payload
    with union_aggregation():
        assert synchronizer.Merger is UnionMerger
        assert updates.UpdateChecks.check_payload is not check
    assert synchronizer.Merger is Merger
    assert updates.UpdateChecks.check_payload is check
