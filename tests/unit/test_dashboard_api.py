"""The dashboard without a network: the collector over an in-memory store, the HTTP endpoints on port 0,
the page's escaping of hostile text, and the command's argument errors."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from p2p_diloco.cli import main
from p2p_diloco.dashboard.collector import Collector
from p2p_diloco.dashboard.page import render_page
from p2p_diloco.dashboard.server import ENDPOINTS, DashboardServer
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.swarm.memory import InMemoryKeyValueStore
from p2p_diloco.wire import keys
from p2p_diloco.wire.observe import EvalHistory, EvalPoint, PeerStats
from p2p_diloco.wire.records import HeartbeatInfo, encode_lease
from tests.support.manifests import tiny_manifest

MANIFEST = tiny_manifest("dash-unit")
RUN = (MANIFEST.run_id, MANIFEST.manifest_hash)
A, B = "QmAlice" + "a" * 30, "QmBob" + "b" * 32


def heartbeat(kv, peer: str, versions, now: float, **fields) -> None:  # noqa: ANN001, ANN003
    info = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=tuple(versions), **fields)
    kv.store(keys.heartbeat_key(*RUN), peer, info.to_bytes(), now + 5)


def lease(kv, holder: str, term: int, now: float, released: bool = False) -> None:  # noqa: ANN001
    kv.store(
        keys.lease_key(*RUN),
        holder,
        encode_lease(LeaseRecord(holder, term, now + 5, released=released)),
        now + 5,
    )


def swarm(now: float) -> InMemoryKeyValueStore:
    kv = InMemoryKeyValueStore()
    heartbeat(kv, A, (4, 5), now, tokens_per_s=100.0, rejections=(("bad norm", 2),),
              rejections_by_sender=((B, "bad norm", 2),))  # fmt: skip
    info = HeartbeatInfo(role="learner", may_sync=False, reachable=False, versions=(3, 5))
    kv.store(keys.heartbeat_key(*RUN), B, info.to_bytes(), now + 5)
    lease(kv, A, 1, now)
    kv.store(keys.stats_key(*RUN), A, PeerStats(now - 30, "cpu", 1000, 2000).to_bytes(), now + 15)
    points = (EvalPoint(now - 2, 100, (1, 1), 3.5, A, 1), EvalPoint(now - 1, 200, (4, 5), 2.25, A, 1))
    history = EvalHistory(points, contributions=((A, 150, 3), (B, 50, 1)))
    kv.store(keys.eval_key(*RUN), A, history.to_bytes(), now + 100)
    return kv


def test_the_view_has_peers_eval_contributions_rejections_and_bytes():
    now = 1000.0
    collector = Collector(MANIFEST)
    collector.poll(swarm(now), now)
    view = collector.view(now)
    peers = {p["peer_id"]: p for p in view["peers"]}
    assert set(peers) == {A, B}
    assert (
        peers[A]["uptime"] == pytest.approx(30)
        and peers[A]["device"] == "cpu"
        and peers[A]["link"] == "direct"
    )
    assert peers[B]["link"] == "relayed" and peers[B]["version_lag"] == 1 and peers[B]["uptime"] is None
    assert [p["loss"] for p in view["eval"]] == [3.5, 2.25] and view["eval"][1]["tokens"] == 200
    assert [c["peer_id"] for c in view["contributions"]] == [A, B]
    assert view["rejections"]["by_reason"] == [{"reason": "bad norm", "count": 2}]
    assert view["rejections"]["by_sender"] == [{"sender": B, "reason": "bad norm", "count": 2}]
    assert view["bytes"]["sent"] == 1000 and view["bytes"]["received"] == 2000
    assert view["synchronizer"]["peer_id"] == A and view["versions"]["samples"][0]["versions"] == [4, 5]


def test_a_change_of_synchronizer_is_marked_failover_or_rotation_and_history_is_kept():
    now = 1000.0
    kv = swarm(now)
    collector = Collector(MANIFEST)
    collector.poll(kv, now)
    kv._data[keys.lease_key(*RUN)].clear()  # A died without releasing: B claims term 2
    kv._data[keys.eval_key(*RUN)].clear()  # and its eval record is gone too
    lease(kv, B, 2, now + 10)
    collector.poll(kv, now + 10)
    lease(kv, B, 2, now + 15, released=True)  # B rotates out (seen released) ...
    collector.poll(kv, now + 15)
    kv._data[keys.lease_key(*RUN)].clear()  # ... a poll sees no holder (the released lease expired) ...
    collector.poll(kv, now + 18)
    lease(kv, A, 3, now + 20)  # ... then A holds term 3
    collector.poll(kv, now + 20)
    marks = collector.view(now + 20)["versions"]["marks"]
    assert [(m["kind"], m["from"], m["to"], m["term"]) for m in marks] == [
        ("failover", A, B, 2),
        ("rotation", B, A, 3),
    ]
    assert len(collector.view(now + 20)["eval"]) == 2  # the curve stays on the page


class Broken:
    def get(self, key: str, now: float):  # noqa: ANN201
        raise TimeoutError("DHT get got no answer")

    def store(self, *args) -> bool:  # noqa: ANN002
        return False


def test_failed_polls_and_bad_records_are_counted_and_the_last_view_stays():
    now = 1000.0
    kv = swarm(now)
    kv.store(keys.eval_key(*RUN), B, b"junk", now + 100)
    kv.store(keys.stats_key(*RUN), B, b"{}", now + 100)
    collector = Collector(MANIFEST)
    collector.poll(kv, now)
    collector.poll(Broken(), now + 2)
    view = collector.view(now + 2)
    assert view["health"]["errors"] == 1 and "TimeoutError" in view["health"]["last_error"]
    assert view["health"]["ignored"]["bad eval history"] == 1 and view["health"]["ignored"]["bad stats"] == 1
    assert len(view["peers"]) == 2 and view["health"]["last_poll_age"] == pytest.approx(2)


def test_endpoints_serve_json_and_the_page_and_refuse_writes():
    now = 1000.0
    collector = Collector(MANIFEST)
    collector.poll(swarm(now), now)
    server = DashboardServer(lambda: collector.view(now), "127.0.0.1", 0)
    server.start()
    try:
        for path, part in ENDPOINTS.items():
            with urllib.request.urlopen(server.url + path.lstrip("/"), timeout=5) as r:
                assert r.headers["Content-Type"] == "application/json"
                data = json.loads(r.read())
            assert data == (collector.view(now) if part is None else collector.view(now)[part])
        with urllib.request.urlopen(server.url, timeout=5) as r:
            page = r.read().decode()
        assert A in page and "<script" in page
        assert not re.search(r"\b(src|href)\s*=|<link|@import|url\(", page)  # nothing loaded from anywhere
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(server.url + "api/peers", data=b"x", method="POST"))
        assert refused.value.code == 405
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url + "nope", timeout=5)
        assert missing.value.code == 404
    finally:
        server.close()


def test_hostile_text_cannot_break_out_of_the_embedded_json():
    view = Collector(MANIFEST).view(0.0) | {"run_id": "</script><script>alert(1)</script>"}
    page = render_page(view)
    assert "</script><script>alert(1)" not in page
    start = page.index("type='application/json'>") + len("type='application/json'>")
    assert json.loads(page[start : page.index("</script>", start)])["run_id"] == view["run_id"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "70000"], "--port must be a TCP port"),
        (["--port", "-1"], "--port must be a TCP port"),
        (["--poll", "0"], "--poll and --timeout must be > 0"),
        (["--initial-peers", "/ip4/1.2.3.4/tcp/x"], "--initial-peers"),
        ([], "needs a peer to ask"),
    ],
)
def test_dashboard_command_refuses_bad_arguments(tmp_path, capsys, args, message):
    manifest = tmp_path / "run.toml"
    manifest.write_text('run_id = "dash"\n')
    assert main(["dashboard", str(manifest), *args]) == 2
    assert message in capsys.readouterr().err


def test_the_poller_starts_a_new_dht_node_through_the_peers_it_saw_when_reads_fail(monkeypatch):
    from p2p_diloco.dashboard import command

    now = 1000.0
    kv = swarm(now)
    info = HeartbeatInfo(
        role="learner",
        may_sync=True,
        reachable=True,
        versions=(4, 5),
        addresses=("/ip4/1.2.3.4/tcp/5/p2p/QmA",),
    )
    kv.store(keys.heartbeat_key(*RUN), A, info.to_bytes(), now + 6)  # replaces A's heartbeat (later expiry)
    stores = iter([kv, Broken(), Broken(), Broken(), kv])
    connects: list[list[str]] = []

    class FakeDht:
        def shutdown(self, timeout: float = 0.0) -> None:
            pass

    def create_dht(initial_peers, client_mode):  # noqa: ANN001, ANN202
        connects.append(list(initial_peers))
        return FakeDht()

    monkeypatch.setattr(command, "create_dht", create_dht)
    monkeypatch.setattr(command, "DhtKeyValueStore", lambda dht, timeout: next(stores))
    monkeypatch.setattr(command, "get_dht_time", lambda: now)
    monkeypatch.setattr(command, "RECONNECT_EVERY", 0.0)
    collector = Collector(MANIFEST)
    poller = command.Poller(collector, ["/ip4/9.9.9.9/tcp/1/p2p/QmBoot"], poll=1.0, timeout=1.0)
    poller.connect()
    poller.poll_once()  # reads the swarm, learns A's address
    for _ in range(3):
        poller.kv = next(stores)
        poller.poll_once()  # the entry peer is gone: three failed reads
    assert connects == [
        ["/ip4/9.9.9.9/tcp/1/p2p/QmBoot"],
        ["/ip4/1.2.3.4/tcp/5/p2p/QmA", "/ip4/9.9.9.9/tcp/1/p2p/QmBoot"],
    ]
    assert collector.view(now)["health"]["reconnects"] == 1
    poller.poll_once()
    assert collector.view(now)["health"]["errors"] == 3 and len(collector.view(now)["peers"]) == 2


def test_samples_carry_the_peers_throughput_and_mean_training_loss():
    now = 1000.0
    kv = swarm(now)
    collector = Collector(MANIFEST)
    collector.poll(kv, now)  # A reports 100 tokens/s and no loss yet, B nothing
    heartbeat(kv, A, (5, 5), now + 2, tokens_per_s=300.0, loss=2.0)
    info = HeartbeatInfo(
        role="learner", may_sync=False, reachable=True, versions=(5, 5), tokens_per_s=50.0, loss=3.0
    )
    kv.store(keys.heartbeat_key(*RUN), B, info.to_bytes(), now + 7)
    collector.poll(kv, now + 2)
    first, second = collector.view(now + 2)["versions"]["samples"]
    assert (first["tokens_per_s"], first["train_loss"]) == (100.0, None)
    assert second["tokens_per_s"] == 350.0 and second["train_loss"] == pytest.approx(2.5)


def test_the_page_draws_legends_in_their_colours_and_fits_a_phone():
    page = render_page(Collector(MANIFEST).view(1000.0))
    # a fill attribute loses to the .lbl rule's fill; an inline style wins
    assert "style: `fill:${color}`" in page and "fill: s.color" not in page
    assert "minmax(min(520px,100%),1fr)" in page and "getBoundingClientRect().width" in page
    for chart in ("c-throughput", "c-train-loss"):
        assert f'<svg id="{chart}"></svg>' in page and f'chart("{chart}"' in page
