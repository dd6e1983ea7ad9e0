"""The contribution ledger: entries from applied updates, exactly once, across restarts, and its summaries."""

from __future__ import annotations

import json
from collections import deque

import pytest

from p2p_diloco.cli import build_parser
from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.node import ledger as ledger_module
from p2p_diloco.node.ledger import (
    LEDGER_FILE,
    ContributionLedger,
    format_ledger,
    ledger_report,
    read_ledger,
    summarize,
    tokens_per_step,
)
from p2p_diloco.node.status import cli_status, format_status
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.wire.frames import encode_update

MANIFEST = RunManifest(run_id="unit-ledger")
PER_STEP = tokens_per_step(MANIFEST)
P = MANIFEST.diloco.fragments


def weight(tokens: int, steps: int) -> float:
    """The synchronizer's merge weight: tokens * tokens / steps."""
    return tokens * tokens / steps


def update(fragment: int, from_version: int, contributors, term: int = 1, leader: str = "QmLeader") -> bytes:
    record = UpdateRecord(
        run_id=MANIFEST.run_id,
        manifest_hash=MANIFEST.manifest_hash,
        fragment=fragment,
        from_version=from_version,
        term=term,
        leader=leader,
        contributors=tuple(contributors),
        checksum="00" * 16,
        payload=b"",
    )
    return encode_update(record)


def test_follow_records_each_applied_update_once_with_derived_tokens(tmp_path):
    logs = [deque(maxlen=256) for _ in range(MANIFEST.diloco.fragments)]
    ledger = ContributionLedger(tmp_path, MANIFEST)
    a, b = ("QmA", weight(8 * PER_STEP, 8)), ("QmB", weight(3 * PER_STEP, 3))
    logs[0].append(update(0, 0, [a, b]))
    versions = [1] + [0] * (MANIFEST.diloco.fragments - 1)
    first = ledger.follow(versions, logs, now=10.0)
    assert [(e.fragment, e.version) for e in first] == [(0, 1)]
    # each fragment's update credits 1/P of the tokens behind the delta (every fragment resends them)
    assert first[0].contributors == (("QmA", a[1], 8 * PER_STEP // P), ("QmB", b[1], 3 * PER_STEP // P))
    assert ledger.follow(versions, logs, now=11.0) == []  # nothing new: nothing written

    logs[0].append(update(0, 1, [b], term=2, leader="QmB"))
    logs[0].append(update(0, 2, [a]))
    versions[0] = 3
    assert [e.version for e in ledger.follow(versions, logs, now=12.0)] == [2, 3]
    ledger.close()

    entries = read_ledger(tmp_path)
    assert [(e.version, e.term, e.leader, e.t) for e in entries] == [
        (1, 1, "QmLeader", 10.0),
        (2, 2, "QmB", 12.0),
        (3, 1, "QmLeader", 12.0),
    ]
    totals = summarize(entries)
    assert totals["QmA"].tokens == 16 * PER_STEP // P and totals["QmA"].updates == 2
    assert totals["QmB"].tokens == 6 * PER_STEP // P and totals["QmB"].updates == 2
    # shares: update 1 splits 8:3 by weight (tokens * tokens/step, equal tokens/step), 2 and 3 are whole
    assert totals["QmA"].share == pytest.approx(8 / 11 + 1)
    assert totals["QmB"].share == pytest.approx(3 / 11 + 1)


def test_restart_skips_versions_already_in_the_ledger_and_snapshot_gaps_have_no_entry(tmp_path):
    logs = [deque(maxlen=256) for _ in range(MANIFEST.diloco.fragments)]
    ledger = ContributionLedger(tmp_path, MANIFEST)
    logs[1].extend([update(1, 0, [("QmA", 1.0)]), update(1, 1, [("QmA", 1.0)])])
    versions = [0] * MANIFEST.diloco.fragments
    versions[1] = 2
    assert len(ledger.follow(versions, logs, now=1.0)) == 2
    ledger.close()

    # restart from an older persisted replica (v1): replaying v1 -> v2 is not recorded twice
    again = ContributionLedger(tmp_path, MANIFEST)
    assert again.totals["QmA"].updates == 2
    logs = [deque(maxlen=256) for _ in range(MANIFEST.diloco.fragments)]
    logs[1].append(update(1, 1, [("QmA", 1.0)]))
    assert again.follow(versions, logs, now=2.0) == []
    # a snapshot jumps to v5 (log cleared), then v5 -> v6 is applied: only v6 gets an entry
    logs[1].clear()
    logs[1].append(update(1, 5, [("QmB", 2.0)]))
    versions[1] = 6
    assert [e.version for e in again.follow(versions, logs, now=3.0)] == [6]
    again.close()
    assert [e.version for e in read_ledger(tmp_path)] == [1, 2, 6]


def test_ledger_rotates_past_its_cap_and_reads_both_files_skipping_torn_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_module, "MAX_LEDGER_BYTES", 300)
    logs = [deque(maxlen=256) for _ in range(MANIFEST.diloco.fragments)]
    ledger = ContributionLedger(tmp_path, MANIFEST)
    versions = [0] * MANIFEST.diloco.fragments
    for v in range(6):
        logs[0].append(update(0, v, [("QmA", 1.0), ("QmB", 1.0)]))
        versions[0] = v + 1
        ledger.follow(versions, logs, now=float(v))
    ledger.close()
    assert (tmp_path / f"{LEDGER_FILE}.1").exists()
    with open(tmp_path / LEDGER_FILE, "a") as f:
        f.write('{"fragment": 0, "vers')  # a line being written
    kept = [e.version for e in read_ledger(tmp_path)]
    assert kept == sorted(kept) and kept[-1] == 6 and len(kept) < 6  # the oldest rotated out


def test_report_json_text_and_status_ledger_command(tmp_path, capsys):
    logs = [deque(maxlen=256) for _ in range(MANIFEST.diloco.fragments)]
    ledger = ContributionLedger(tmp_path, MANIFEST)
    logs[0].append(update(0, 0, [("QmA", weight(2 * PER_STEP, 2)), ("QmB", weight(PER_STEP, 1))]))
    ledger.follow([1] + [0] * (MANIFEST.diloco.fragments - 1), logs, now=5.0)
    ledger.close()

    report = ledger_report(read_ledger(tmp_path), last=1)
    assert [row["peer_id"] for row in report["peers"]] == ["QmA", "QmB"]  # most tokens first
    assert report["peers"][0]["tokens"] == 2 * PER_STEP // P and report["fragments"]["0"]["last"] == 1
    assert report["recent"][0]["contributors"][1][2] == PER_STEP // P
    text = format_ledger(report)
    assert "QmA" in text and f"{2 * PER_STEP // P}" in text

    manifest_path = tmp_path / "run.toml"
    manifest_path.write_text('run_id = "unit-ledger"\n')
    parser = build_parser()
    args = parser.parse_args(
        ["status", str(manifest_path), "--state-dir", str(tmp_path), "--ledger", "--json"]
    )
    assert cli_status(args) == 0  # reads local files only: no DHT is started
    printed = json.loads(capsys.readouterr().out)
    assert printed["peers"] == report["peers"]

    with pytest.raises(ConfigError, match="--state-dir"):
        cli_status(parser.parse_args(["status", str(manifest_path), "--ledger"]))
    with pytest.raises(ConfigError, match="does not exist"):
        cli_status(
            parser.parse_args(["status", str(manifest_path), "--ledger", "--state-dir", str(tmp_path / "x")])
        )

    status = {
        "run_id": "r", "manifest_hash": "h", "peers": [], "synchronizer": None, "highest_term": 0,
        "fragments": [], "ignored": {}, "ledger": report,
    }  # fmt: skip
    assert "contribution ledger: 1 updates" in format_status(status)
