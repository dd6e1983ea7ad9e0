"""Issue #43 item 3: `status` never pretends (no peer to ask, no live peer: exit non-zero with the reason),
prints times a volunteer reads, and the dashboard's charts keep their last values while no peer is live."""

from __future__ import annotations

import socket

import pytest

from p2p_diloco.cli import main
from p2p_diloco.dashboard.collector import Collector
from p2p_diloco.dashboard.page import render_page
from p2p_diloco.node import status as status_module
from p2p_diloco.node.status import format_status, swarm_status
from p2p_diloco.swarm.memory import InMemoryKeyValueStore
from p2p_diloco.wire import keys
from p2p_diloco.wire.records import HeartbeatInfo
from tests.support.manifests import tiny_manifest

MANIFEST = tiny_manifest("status-ux")
RUN = (MANIFEST.run_id, MANIFEST.manifest_hash)
A = "QmAlice" + "a" * 30
NOW = 1795851428.0


def one_peer(now: float, decisions: tuple[str, ...] = ()) -> InMemoryKeyValueStore:
    kv = InMemoryKeyValueStore()
    info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(4, 5), decisions=decisions)
    kv.store(keys.heartbeat_key(*RUN), A, info.to_bytes(), now + 5)
    return kv


def test_status_without_a_peer_to_ask_refuses(capsys):
    assert main(["status", "demo"]) == 2
    err = capsys.readouterr().err
    assert "no peer to ask" in err and "--initial-peers" in err


def test_status_that_sees_no_live_peer_exits_1_with_the_reason(monkeypatch, capsys):
    class FakeDht:
        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(status_module, "create_dht", lambda **_: FakeDht())
    monkeypatch.setattr(status_module, "DhtKeyValueStore", lambda *_, **__: InMemoryKeyValueStore())
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/Qm" + "x" * 44
        code = main(["status", "demo", "--initial-peers", address, "--wait", "0"])
    captured = capsys.readouterr()
    assert code == 1
    assert "0 live peers" in captured.out and "fragments: unknown" in captured.out
    assert "0:v0" not in captured.out
    assert "no live peer of run" in captured.err


def test_status_lines_say_one_peer_and_human_times():
    decision = "granted lease: term 3 until 1795851440.18, 0 rounds done"
    text = format_status(swarm_status(one_peer(NOW, (decision,)), MANIFEST, NOW))
    assert "1 live peer," in text and "1 live peers" not in text
    assert "1795851440" not in text
    assert "until 07:37:20 UTC (in 12 s)" in text


@pytest.mark.parametrize("empty_polls", [1, 3])
def test_dashboard_keeps_versions_and_term_while_no_peer_is_live(empty_polls):
    collector = Collector(MANIFEST)
    collector.poll(one_peer(NOW), NOW)
    for i in range(empty_polls):
        collector.poll(InMemoryKeyValueStore(), NOW + 10 + i)
    view = collector.view(NOW + 20)
    samples = view["versions"]["samples"]
    assert [s["versions"] for s in samples] == [[4, 5]] * (1 + empty_polls)
    assert samples[-1]["live_peers"] == 0
    assert [f["version"] for f in view["fragments"]] == [4, 5]


def test_the_page_at_420_px_scrolls_tables_and_places_mark_labels_by_their_width():
    page = render_page(Collector(MANIFEST).view(NOW))
    for table in ("t-eval", "t-contrib", "t-failovers"):
        assert f'<div class="scroll"><table id="{table}"></table></div><div class="more"></div>' in page
    # the peers table is never cut: below 600 px each peer's cells stack, labelled by their column
    assert '<table id="t-peers" class="stack"></table></div><div class="more"></div>' in page
    assert "table.stack td[data-label]::before{content:attr(data-label)" in page
    assert '"data-label": head[i]' in page
    assert ".scroll{overflow-x:auto" in page and "scroll sideways for more columns" in page
    assert "getComputedTextLength()" in page and "W < 560 ? m.short : m.label" in page
    assert "short: `→ t${m.term}`" in page
