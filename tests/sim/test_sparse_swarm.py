"""Sim tier: the sparse top-k codec in the in-process swarm keeps replicas bit-identical and trains."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("codec", ["topk-int8", "topk-int4", "topk4k-int2"])
def test_sparse_codec_swarm_trains_and_replicas_agree(manifest, corpus, codec):
    sparse = dataclasses.replace(
        manifest,
        wire=dataclasses.replace(manifest.wire, codec=codec, density=0.03),
        # Rotation every 20 rounds: each new term starts with an empty outer residual.
        timing=dataclasses.replace(manifest.timing, term_rounds=20),
    )
    report = InProcessSwarm(
        SwarmSpec(manifest=sparse, learners=3, duration=90.0, eval_every=30), corpus=corpus
    ).run()
    assert all(v >= 5 for v in report.versions), report.versions
    assert report.digests_equal
    assert report.final_eval_loss < report.eval_curve[0][2] - 0.5, report.eval_curve
    assert report.rejections == {}
    assert len(report.terms) >= 2
