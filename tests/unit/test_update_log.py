"""The bounded update log (swarm/update_log.py) and `[limits]` (config.py): bytes and count bounds, the
latest update always kept, a requester whose updates dropped out gets nothing (and fetches a snapshot)."""

from __future__ import annotations

import re

import pytest

from p2p_diloco.config import LimitsConfig, RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.update_log import UpdateLog, record_bytes


def record(fragment: int, from_version: int, payload_bytes: int) -> UpdateRecord:
    return UpdateRecord(
        run_id="r",
        manifest_hash="h",
        fragment=fragment,
        from_version=from_version,
        term=1,
        leader="QmLeader",
        contributors=(("QmA", 1.0),),
        checksum="c" * 64,
        payload=bytes(payload_bytes),
    )


def test_log_stays_within_its_byte_budget_split_by_fragment_size() -> None:
    # fragment 0 has 3x the parameters of fragment 1: it gets 3/4 of the budget
    log = UpdateLog([3000, 1000], budget_bytes=10_000, max_length=256)
    assert log.fragment_budgets == [7500, 2500]
    for v in range(50):
        log.append(record(0, v, 1000))
        log.append(record(1, v, 1000))
        assert log.bytes(0) <= 7500 and log.bytes(1) <= 2500 or len(log.records(1)) == 1
        assert log.bytes() <= 10_000 + record_bytes(record(1, 0, 1000))
    kept0 = [r.from_version for r in log.records(0)]
    assert kept0 == list(range(50 - len(kept0), 50)) and len(kept0) == 7500 // record_bytes(
        record(0, 0, 1000)
    )
    assert [r.from_version for r in log.records(1)] == [49]  # over budget alone, still the latest kept
    assert log.dropped == 100 - len(log)
    assert log.oldest_version(0) == kept0[0]
    assert [r.from_version for r in log.after(0, 48)] == [48, 49]


def test_log_is_flat_over_time_and_counts_are_bounded_too() -> None:
    log = UpdateLog([1, 1], budget_bytes=1 << 30, max_length=4)
    sizes = []
    for v in range(1000):
        log.append(record(v % 2, v // 2, 100))
        sizes.append(log.bytes())
    assert len(log) == 8 and max(sizes[100:]) == min(sizes[100:])  # flat after warm-up
    log.clear(0)
    assert log.records(0) == [] and log.oldest_version(0) is None and log.bytes(0) == 0


def test_limits_default_ties_the_budget_to_the_model_int8_size_and_refuses_bad_values() -> None:
    limits = LimitsConfig()
    assert limits.update_log_budget(125_000_000) == 250_000_000  # 2 x int8
    assert limits.update_log_budget(1000) == LimitsConfig.MIN_AUTO_UPDATE_LOG_BYTES
    assert LimitsConfig(update_log_bytes=123).update_log_budget(10**9) == 123
    with pytest.raises(ConfigError, match=re.escape("[limits] update_log_bytes = -1: must be >= 0")):
        LimitsConfig(update_log_bytes=-1)
    with pytest.raises(ConfigError, match="snapshot_chunk_bytes = 1001: must be in .* and a multiple of 4"):
        LimitsConfig(snapshot_chunk_bytes=1001)
    with pytest.raises(ConfigError, match=re.escape("[limits] snapshot_sources = 0: must be in [1, 64]")):
        LimitsConfig(snapshot_sources=0)
    manifest = RunManifest.from_dict({"run_id": "x", "limits": {"update_log_bytes": 1 << 20}})
    assert manifest.limits.update_log_bytes == 1 << 20
    # limits are each peer's own: they do not change the manifest hash
    assert manifest.manifest_hash == RunManifest.from_dict({"run_id": "x"}).manifest_hash
    with pytest.raises(ConfigError, match=r"unknown keys in \[limits\]"):
        RunManifest.from_dict({"run_id": "x", "limits": {"update_log": 1}})
