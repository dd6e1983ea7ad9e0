"""Issue #43 item 5: a damaged replica file costs only its fragment. The others keep their versions, the
damaged one restarts from the initial weights at v0 (catch-up then fetches it alone), the reason is said
on the console, and the `replica_unusable` event carries a real time."""

from __future__ import annotations

import time

import torch

from p2p_diloco.model.gpt import build_model
from p2p_diloco.node.replica_store import fragment_file
from p2p_diloco.node.state import StateDir, read_events
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica
from tests.support.manifests import tiny_manifest

MANIFEST = tiny_manifest("replica-damage")


def trained_replica() -> GlobalReplica:
    params = {n: p.detach().clone() for n, p in build_model(MANIFEST.model).named_parameters()}
    shapes = [(n, tuple(t.shape)) for n, t in params.items()]
    plan = plan_fragments(shapes, MANIFEST.diloco.fragments, MANIFEST.diloco.fragment_pattern)
    replica = GlobalReplica(plan, params)
    for p in range(plan.num_fragments):
        for _ in range(p + 2):
            grad = {n: torch.full_like(params[n], 0.01) for n in plan.names(p)}
            replica.apply(p, replica.version(p), grad, lr=0.7, momentum=0.9, expected_checksum=None)
    return replica


def test_a_truncated_fragment_file_is_refetched_alone(tmp_path, capsys):
    replica = trained_replica()
    state = StateDir(tmp_path, MANIFEST)
    state.save(replica, "QmMe", now=1.0, in_sync=True, previous=0.0)
    state.close()
    file = fragment_file(tmp_path / "replica", 1)
    file.write_bytes(file.read_bytes()[:100])

    state = StateDir(tmp_path, MANIFEST)
    before = time.time()
    loaded = state.load_replica(replica.plan)
    assert loaded is not None
    assert loaded.versions() == (replica.version(0), 0)
    assert loaded.checksum(0) == replica.checksum(0)
    fresh = GlobalReplica(replica.plan, dict(build_model(MANIFEST.model).named_parameters()))
    assert loaded.checksum(1) == fresh.checksum(1)  # the initial weights at v0, as a fresh peer has them
    assert "replica fragment 1 damaged" in capsys.readouterr().err
    (event,) = [e for e in read_events(tmp_path) if e["event"] == "replica_unusable"]
    assert event["fragment"] == 1 and event["t"] is not None and event["t"] >= before
    assert state.store.save(loaded) == 1  # only the damaged file is written again
    state.close()
