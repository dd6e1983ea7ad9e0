"""What `status` prints and `status --json` holds beyond peers and leases: the newest global evaluation
(issue #32: eval loss in `--json`), and the ledger's share as a fraction of the updates (it read 501.00)."""

from __future__ import annotations

import json

import pytest

from p2p_diloco.node.ledger import LedgerEntry, format_ledger, ledger_report
from p2p_diloco.node.status import format_status, swarm_status
from p2p_diloco.swarm.memory import InMemoryKeyValueStore
from p2p_diloco.wire import keys
from p2p_diloco.wire.observe import EvalHistory, EvalPoint
from p2p_diloco.wire.records import HeartbeatInfo
from tests.support.manifests import tiny_manifest

MANIFEST = tiny_manifest("status-unit")
RUN = (MANIFEST.run_id, MANIFEST.manifest_hash)
A, B = "QmAlice" + "a" * 30, "QmBob" + "b" * 32


def swarm_with_evals(now: float, *points: EvalPoint) -> InMemoryKeyValueStore:
    kv = InMemoryKeyValueStore()
    info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(4, 5), loss=2.5)
    kv.store(keys.heartbeat_key(*RUN), A, info.to_bytes(), now + 5)
    if points:
        kv.store(keys.eval_key(*RUN), A, EvalHistory(points).to_bytes(), now + 100)
    return kv


def test_status_json_has_the_newest_global_eval_loss():
    now = 1000.0
    points = (EvalPoint(now - 30, 100, (1, 1), 3.5, A, 1), EvalPoint(now - 10, 2000, (4, 5), 2.25, A, 1))
    status = json.loads(json.dumps(swarm_status(swarm_with_evals(now, *points), MANIFEST, now)))
    assert status["eval"]["loss"] == 2.25 and status["eval"]["versions"] == [4, 5]
    assert (
        status["eval"]["perplexity"] == pytest.approx(9.4877, abs=1e-3) and status["eval"]["evaluator"] == A
    )
    text = format_status(status)
    assert (
        f"global eval: loss 2.2500 (perplexity 9.49) at versions 4,5, 2,000 merged tokens, 10 s ago, by {A}"
        in text
    )


def test_status_without_an_evaluation_says_so_and_ignores_a_bad_record():
    now = 1000.0
    kv = swarm_with_evals(now)
    kv.store(keys.eval_key(*RUN), B, b"junk", now + 100)
    status = swarm_status(kv, MANIFEST, now)
    assert status["eval"] is None and status["ignored"] == {"bad eval history": 1}
    assert "global eval: none published yet" in format_status(status)


def test_ledger_share_is_a_fraction_of_the_updates():
    entries = [
        LedgerEntry(0, 1, 1, A, ((A, 8.0, 80), (B, 3.0, 30))),
        LedgerEntry(1, 1, 1, A, ((A, 5.0, 50),)),
        LedgerEntry(0, 2, 1, A, ((B, 5.0, 50),)),
        LedgerEntry(1, 2, 1, A, ((A, 5.0, 50),)),
    ]
    report = ledger_report(entries)
    rows = {row["peer_id"]: row for row in report["peers"]}
    assert rows[A]["share"] == pytest.approx((8 / 11 + 2) / 4) and rows[B]["share"] == pytest.approx(
        (3 / 11 + 1) / 4
    )
    assert sum(row["share"] for row in report["peers"]) == pytest.approx(1.0)
    assert rows[A]["updates_owned"] == pytest.approx(8 / 11 + 2) and rows[A]["updates"] == 3
    text = format_ledger(report)
    assert "  68.2%" in text and "  31.8%" in text and "share: of the updates, split by merge weight" in text
