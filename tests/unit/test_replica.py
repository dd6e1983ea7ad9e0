"""GlobalReplica: the outer Nesterov step, bit-identical replicas, version ordering, checksums,
fetched fragments, persistence and adoption into a live model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2p_diloco.node.replica_store import load_replica, save_replica
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.merge import MergeTag
from p2p_diloco.protocol.outer_step import nesterov_step
from p2p_diloco.protocol.replica import (
    APPLY,
    LOAD,
    REFUSE,
    GlobalReplica,
    ReplicaTag,
)

LR, MU = 0.7, 0.9
PLAN = FragmentPlan(fragments=(("emb", "head.b"), ("blocks.0.w",)))
SHAPES = {"emb": (5, 3), "head.b": (3,), "blocks.0.w": (4, 4)}


def initial(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def grads(fragment: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return {name: torch.randn(SHAPES[name], generator=gen) * 0.1 for name in PLAN.names(fragment)}


def apply(replica: GlobalReplica, fragment: int, seed: int, expected: str | None = None):
    version = replica.versions()[fragment]
    return replica.apply(
        fragment, version, grads(fragment, seed), lr=LR, momentum=MU, expected_checksum=expected
    )


def assert_identical(a: GlobalReplica, b: GlobalReplica) -> None:
    assert a.digest() == b.digest()
    assert a.versions() == b.versions()
    for p in range(PLAN.num_fragments):
        va, pa, ma = a.snapshot(p)
        vb, pb, mb = b.snapshot(p)
        assert va == vb
        assert all(torch.equal(pa[n], pb[n]) and torch.equal(ma[n], mb[n]) for n in pa)


def test_initial_state() -> None:
    init = initial()
    replica = GlobalReplica(PLAN, {**init, "buffer.mask": torch.ones(2)})  # extra names are ignored
    assert replica.versions() == (0, 0)
    version, params, momentum = replica.snapshot(0)
    assert version == 0 and set(params) == {"emb", "head.b"}
    assert torch.equal(params["emb"], init["emb"]) and torch.equal(momentum["emb"], torch.zeros(5, 3))
    init["emb"].add_(1.0)  # the replica holds its own copy
    assert not torch.equal(replica.params_of(0)["emb"], init["emb"])
    with pytest.raises(ValueError, match="lack"):
        GlobalReplica(PLAN, {"emb": torch.zeros(5, 3)})


def test_nesterov_matches_torch_sgd() -> None:
    replica = GlobalReplica(PLAN, initial())
    reference = {name: torch.nn.Parameter(t.clone()) for name, t in initial().items()}
    opt = torch.optim.SGD(list(reference.values()), lr=LR, momentum=MU, nesterov=True)
    for step in range(6):
        for p in range(PLAN.num_fragments):
            g = grads(p, step)
            for name, tensor in g.items():
                reference[name].grad = tensor.clone()  # SGD's grad is the outer gradient itself
            assert apply(replica, p, step).action == APPLY
        opt.step()
    assert replica.versions() == (6, 6)
    exported = replica.export_params()
    for name, param in reference.items():
        torch.testing.assert_close(exported[name], param.detach(), rtol=1e-5, atol=1e-6)


def test_first_step_by_hand() -> None:
    replica = GlobalReplica(PLAN, initial())
    g = grads(1, 0)
    apply(replica, 1, 0)
    _, params, momentum = replica.snapshot(1)
    assert torch.equal(momentum["blocks.0.w"], g["blocks.0.w"])  # 0*mu + g is exact
    expected = initial()["blocks.0.w"] - LR * (1 + MU) * g["blocks.0.w"]
    torch.testing.assert_close(params["blocks.0.w"], expected, rtol=1e-6, atol=1e-6)


def test_step_is_bit_exact_against_separately_rounded_numpy() -> None:
    gen = torch.Generator().manual_seed(3)
    theta, m, g = (torch.randn(4096, generator=gen) for _ in range(3))
    new_theta, new_m = nesterov_step(theta, m, g, lr=LR, momentum=MU)
    f32 = np.float32
    th, mm, gg = theta.numpy(), m.numpy(), g.numpy()
    ref_m = (mm * f32(MU)).astype(f32) + gg
    ref_theta = th - ((gg + (ref_m * f32(MU))) * f32(LR))
    assert ref_m.dtype == np.float32 and ref_theta.dtype == np.float32
    assert np.array_equal(new_m.numpy(), ref_m)
    assert np.array_equal(new_theta.numpy(), ref_theta)


def test_two_replicas_fed_the_same_updates_are_bit_identical() -> None:
    a, b = GlobalReplica(PLAN, initial()), GlobalReplica(PLAN, initial())
    assert_identical(a, b)
    for step in range(5):
        for p in (0, 1, 0):
            if p == 0 and step % 2:
                continue
            pending = a.compute_update(p, grads(p, step), lr=LR, momentum=MU)  # the synchronizer's view
            assert a.commit(pending).action == APPLY
            decision = apply(b, p, step, expected=pending.checksum)
            assert decision.action == APPLY and decision.tag == ReplicaTag.APPLIED
            assert a.checksum(p) == b.checksum(p) == pending.checksum
    assert_identical(a, b)
    apply(b, 1, 99)
    assert a.digest() != b.digest()


def test_compute_update_does_not_mutate() -> None:
    replica = GlobalReplica(PLAN, initial())
    before = replica.digest()
    pending = replica.compute_update(0, grads(0, 0), lr=LR, momentum=MU)
    assert replica.digest() == before and replica.versions() == (0, 0)
    assert pending.from_version == 0 and pending.to_version == 1
    assert pending.checksum != replica.checksum(0)


def test_duplicate_and_out_of_order_updates_are_refused() -> None:
    replica = GlobalReplica(PLAN, initial())
    assert replica.apply(0, 0, grads(0, 0), lr=LR, momentum=MU, expected_checksum=None).action == APPLY
    after_first = replica.digest()
    duplicate = replica.apply(0, 0, grads(0, 0), lr=LR, momentum=MU, expected_checksum=None)
    assert duplicate.action == REFUSE and duplicate.tag == ReplicaTag.DUPLICATE_UPDATE
    gap = replica.apply(0, 2, grads(0, 2), lr=LR, momentum=MU, expected_checksum=None)
    assert gap.action == REFUSE and gap.tag == ReplicaTag.OUT_OF_ORDER
    assert replica.versions() == (1, 0) and replica.digest() == after_first
    stale = replica.compute_update(1, grads(1, 0), lr=LR, momentum=MU)
    apply(replica, 1, 5)
    assert replica.commit(stale).tag == ReplicaTag.DUPLICATE_UPDATE


def test_checksum_mismatch_leaves_replica_unchanged() -> None:
    replica = GlobalReplica(PLAN, initial())
    apply(replica, 0, 0)
    before_digest, before = replica.digest(), replica.snapshot(0)
    wrong = replica.compute_update(0, grads(0, 7), lr=LR, momentum=MU).checksum  # another gradient's result
    decision = apply(replica, 0, 1, expected=wrong)
    assert decision.action == REFUSE and decision.tag == ReplicaTag.CHECKSUM_MISMATCH
    assert replica.digest() == before_digest and replica.versions() == (1, 0)
    version, params, momentum = replica.snapshot(0)
    assert version == before[0] and all(torch.equal(params[n], before[1][n]) for n in params)
    assert all(torch.equal(momentum[n], before[2][n]) for n in momentum)


def test_commit_refuses_a_pending_update_computed_from_other_state() -> None:
    a, b = GlobalReplica(PLAN, initial(0)), GlobalReplica(PLAN, initial(1))
    pending = a.compute_update(0, grads(0, 0), lr=LR, momentum=MU)
    assert b.commit(pending).tag == ReplicaTag.CHECKSUM_MISMATCH
    assert b.versions() == (0, 0)


@pytest.mark.parametrize(
    ("grad", "tag"),
    [
        ({"emb": torch.zeros(5, 3)}, MergeTag.MISSING_TENSOR),
        ({"emb": torch.zeros(3, 5), "head.b": torch.zeros(3)}, MergeTag.WRONG_SHAPE),
        ({"emb": torch.zeros(5, 3, dtype=torch.float64), "head.b": torch.zeros(3)}, MergeTag.WRONG_DTYPE),
        ({"emb": torch.full((5, 3), float("nan")), "head.b": torch.zeros(3)}, MergeTag.NON_FINITE),
        (
            {"emb": torch.full((5, 3), 3e38), "head.b": torch.zeros(3)},
            MergeTag.NON_FINITE,
        ),  # the step overflows
    ],
)
def test_bad_outer_gradients_are_refused(grad, tag: str) -> None:
    replica = GlobalReplica(PLAN, initial())
    before = replica.digest()
    decision = replica.apply(0, 0, grad, lr=LR, momentum=MU, expected_checksum=None)
    assert decision.action == REFUSE and decision.reason.startswith(tag), decision.reason
    assert replica.digest() == before and replica.versions() == (0, 0)
    with pytest.raises(ValueError, match=tag):
        replica.compute_update(0, grad, lr=LR, momentum=MU)


def test_load_fragment_checks() -> None:
    source, fresh = GlobalReplica(PLAN, initial()), GlobalReplica(PLAN, initial())
    for step in range(3):
        apply(source, 1, step)
    version, params, momentum = source.snapshot(1)
    checksum = source.checksum(1)

    tampered = {n: t.clone() for n, t in params.items()}
    tampered["blocks.0.w"][0, 0] += 1e-3
    bad = fresh.load_fragment(1, version, tampered, momentum, checksum)
    assert bad.action == REFUSE and bad.tag == ReplicaTag.CHECKSUM_MISMATCH and fresh.versions() == (0, 0)
    assert fresh.load_fragment(1, version + 1, params, momentum, checksum).reason.startswith(
        ReplicaTag.CHECKSUM_MISMATCH
    )
    wrong_shape = fresh.load_fragment(1, version, {"blocks.0.w": torch.zeros(4, 5)}, momentum, checksum)
    assert wrong_shape.tag == MergeTag.WRONG_SHAPE
    missing = fresh.load_fragment(1, version, {}, momentum, checksum)
    assert missing.action == REFUSE and missing.tag == MergeTag.WRONG_SHAPE

    loaded = fresh.load_fragment(1, version, params, momentum, checksum)
    assert loaded.action == LOAD and loaded.tag == ReplicaTag.LOADED
    assert fresh.versions() == (0, 3)
    assert_identical(source, fresh)
    # the same version again is fine (refetch); an older one only when forced (losing-branch reconciliation)
    assert fresh.load_fragment(1, version, params, momentum, checksum).action == LOAD
    old_version, old_params, old_momentum = GlobalReplica(PLAN, initial()).snapshot(1)
    old_checksum = GlobalReplica(PLAN, initial()).checksum(1)
    older = fresh.load_fragment(1, old_version, old_params, old_momentum, old_checksum)
    assert older.action == REFUSE and older.tag == ReplicaTag.OLDER_THAN_REPLICA
    assert (
        fresh.load_fragment(1, old_version, old_params, old_momentum, old_checksum, force=True).action == LOAD
    )
    assert fresh.versions() == (0, 0)
    # updates continue from the loaded state, in lockstep with the source
    params["blocks.0.w"].zero_()  # the replica copied what it loaded
    fresh.load_fragment(1, version, *source.snapshot(1)[1:], checksum)
    apply(source, 1, 10)
    assert apply(fresh, 1, 10, expected=source.checksum(1)).action == APPLY


def test_checksum_covers_version_and_momentum() -> None:
    a, b = GlobalReplica(PLAN, initial()), GlobalReplica(PLAN, initial())
    _, params, momentum = a.snapshot(0)
    assert b.load_fragment(0, 4, params, momentum, a.checksum(0)).reason.startswith(
        ReplicaTag.CHECKSUM_MISMATCH
    )
    momentum["emb"][0, 0] = 1.0
    assert b.load_fragment(0, 0, params, momentum, a.checksum(0)).reason.startswith(
        ReplicaTag.CHECKSUM_MISMATCH
    )


def test_copies_handed_out_cannot_change_the_replica() -> None:
    replica = GlobalReplica(PLAN, initial())
    before = replica.digest()
    replica.params_of(0)["emb"].add_(1.0)
    replica.export_params()["blocks.0.w"].add_(1.0)
    replica.snapshot(1)[2]["blocks.0.w"].add_(1.0)
    pending = replica.compute_update(0, grads(0, 0), lr=LR, momentum=MU)
    replica.commit(pending)
    pending.params["emb"].add_(1.0)
    assert replica.checksum(0) == pending.checksum
    fresh = GlobalReplica(PLAN, initial())
    assert fresh.checksum(1) == replica.checksum(1) and fresh.digest() == before
    # the cached checksum still describes the real bytes
    recomputed = GlobalReplica(PLAN, initial())
    recomputed.load_fragment(0, 1, *replica.snapshot(0)[1:], replica.checksum(0))
    assert recomputed.checksum(0) == replica.checksum(0)


def test_a_frozen_replica_keeps_its_moment_while_the_replica_moves_on(tmp_path) -> None:
    replica = GlobalReplica(PLAN, initial())
    apply(replica, 0, 0)
    twin = GlobalReplica(PLAN, initial())
    apply(twin, 0, 0)
    frozen = replica.frozen()
    apply(replica, 0, 1)
    apply(replica, 1, 0)
    assert replica.versions() == (2, 1) and frozen.versions() == (1, 0)
    assert_identical(frozen, twin)  # what the twin fed the same first update holds, bit for bit
    save_replica(frozen, tmp_path / "replica")  # what the peer persists from another thread
    assert_identical(load_replica(tmp_path / "replica", PLAN), twin)
