"""What a replica checks in an update's content (swarm/updates.py): codec, finite values, RMS
against recent updates, contributors."""

from __future__ import annotations

import dataclasses

import torch

from p2p_diloco.config import TrustConfig
from p2p_diloco.protocol.direction import fragment_norm
from p2p_diloco.protocol.messages import UpdateRecord, UpdateTag
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.swarm import updates as uc
from p2p_diloco.wire.codecs.codec import Codec, encode_tensors
from tests.support.manifests import tiny_manifest

QM = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
MANIFEST = tiny_manifest("checks")


def checks(manifest=MANIFEST) -> uc.UpdateChecks:  # noqa: ANN001
    return uc.UpdateChecks(manifest, 2, RobustGuard.from_manifest(manifest))


def record(payload: bytes, contributors=(("a", 1.0),)) -> UpdateRecord:  # noqa: ANN001
    return UpdateRecord("checks", MANIFEST.manifest_hash, 0, 0, 1, "leader", contributors, "c", payload)


def grad(scale: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), scale)}


def test_the_payload_must_be_in_the_manifests_codec():
    c = checks()
    assert c.check_payload(record(encode_tensors(grad(0.1), codec=Codec.INT8))) is None
    tag, _ = c.check_payload(record(encode_tensors(grad(0.1), codec=Codec.FP32)))
    assert tag == UpdateTag.WRONG_CODEC
    assert c.check_payload(record(b"not a tensor frame"))[0] == UpdateTag.WRONG_CODEC


def test_values_must_be_finite_and_no_larger_than_adamw_can_move():
    c = checks()
    assert c.check_values(0, {"w": torch.tensor([1.0, float("nan")])})[0] == UpdateTag.NOT_FINITE
    assert c.check_values(0, grad(0.9 * c.max_rms)) is None
    tag, detail = c.check_values(0, grad(100 * c.max_rms))  # a destructive update
    assert tag == UpdateTag.TOO_LARGE and "w RMS" in detail


def test_value_check_hands_the_fragment_norm_to_the_direction_reference():
    c = checks()
    update = {"w": torch.randn(64) * 0.1 * c.max_rms, "b": torch.randn(3, 5) * 0.1 * c.max_rms}
    found = c.value_check(0, update)
    assert found.problem is None
    assert found.norm == fragment_norm(update)  # the same float64 sums: bit-identical reference
    given, computed = RobustGuard.from_manifest(MANIFEST), RobustGuard.from_manifest(MANIFEST)
    given.observe_update(0, update, norm=found.norm)
    computed.observe_update(0, update)
    for name, t in given._references.get(0).items():
        assert torch.equal(t, computed._references.get(0)[name])
    assert c.value_check(0, grad(100 * c.max_rms)).norm is None  # refused: nothing to reuse


def test_contributors_must_be_learners_with_weights_the_schedule_allows():
    listed = dataclasses.replace(MANIFEST, trust=TrustConfig(learners=(QM,)))
    c = checks(listed)
    assert c.check_contributors(record(b"", ((QM, 1.0),))) is None
    assert c.check_contributors(record(b"", (("stranger", 1.0),)))[0] == UpdateTag.UNKNOWN_CONTRIBUTOR
    heavy = c.max_weight * 4
    assert c.check_contributors(record(b"", ((QM, heavy),)))[0] == UpdateTag.IMPLAUSIBLE_WEIGHT


def test_an_open_run_refuses_a_contributor_weight_no_honest_delta_reaches_and_names_it():
    """A run that lets anyone learn checks an update's contributors by the heaviest weight alone; one
    heavy weight among honest ones is still refused, naming that contributor."""
    c = checks()
    assert MANIFEST.anyone_may_learn and c.robust.config.enabled
    honest = (("a", 1.0), ("b", c.max_weight))
    assert c.check_contributors(record(b"", honest)) is None
    tag, detail = c.check_contributors(record(b"", (*honest, ("c", c.max_weight * 4))))
    assert tag == UpdateTag.IMPLAUSIBLE_WEIGHT and detail.startswith("c's weight")
