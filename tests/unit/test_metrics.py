"""Prometheus metrics and the live display of a node: scraped text exposition, HTTP endpoint, rendering."""

from __future__ import annotations

import io
import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco.errors import ConfigError
from p2p_diloco.node.metrics import MetricsServer, exposition, make_registry
from p2p_diloco.node.reporting import LiveProgressDisplay, NodeSnapshot, ProgressDisplay, make_display

SNAPSHOT = NodeSnapshot(
    peer_id="QmSelf",
    role="synchronizer",
    training=True,
    step=120,
    tokens=120 * 512,
    loss=2.5,
    tokens_per_s=4096.0,
    holder="QmSelf",
    term=3,
    versions=(7, 6),
    digest="ab" * 8,
    live_peers=3,
    updates_applied=13,
    deltas_sent=15,
    deltas_rejected=1,
    deltas_merged=12,
    failovers_seen=2,
    rounds_merged=4,
    rejections={"stale anchor": 2, "bad frame": 1},
    rejections_by_sender={("QmBad", "bad frame"): 1, ("QmSlow", "stale anchor"): 2},
    bytes_sent=123_456,
    bytes_received=654_321,
    tick_errors={"TimeoutError": 1},
    ledger={"QmSelf": {"tokens": 6144, "weight": 3.0e6, "share": 2.5, "updates": 12, "fragments": [0, 1]}},
    deltas_accepted=21,
    first_accepts=((3, 1000.5, 0),),
    step_time=0.125,
    eval_loss=2.75,
)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, parsed with prometheus_client's own parser."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def test_exposition_holds_every_figure_of_the_snapshot():
    text = exposition(make_registry(lambda: SNAPSHOT))
    got = samples(text)
    expect = {
        ("p2p_diloco_steps_total", ()): 120,
        ("p2p_diloco_tokens_total", ()): 120 * 512,
        ("p2p_diloco_loss", ()): 2.5,
        ("p2p_diloco_tokens_per_second", ()): 4096,
        ("p2p_diloco_step_seconds", ()): 0.125,
        ("p2p_diloco_eval_loss", ()): 2.75,
        ("p2p_diloco_training", ()): 1,
        ("p2p_diloco_role", (("role", "synchronizer"),)): 1,
        ("p2p_diloco_role", (("role", "learner"),)): 0,
        ("p2p_diloco_term", ()): 3,
        ("p2p_diloco_synchronizer_info", (("holder", "QmSelf"), ("term", "3"))): 1,
        ("p2p_diloco_fragment_version", (("fragment", "0"),)): 7,
        ("p2p_diloco_fragment_version", (("fragment", "1"),)): 6,
        ("p2p_diloco_live_peers", ()): 3,
        ("p2p_diloco_bytes_sent_total", ()): 123_456,
        ("p2p_diloco_bytes_received_total", ()): 654_321,
        ("p2p_diloco_rejections_total", (("reason", "stale anchor"),)): 2,
        ("p2p_diloco_rejections_total", (("reason", "bad frame"),)): 1,
        ("p2p_diloco_rejections_by_sender_total", (("reason", "bad frame"), ("sender", "QmBad"))): 1,
        ("p2p_diloco_deltas_sent_total", ()): 15,
        ("p2p_diloco_deltas_rejected_total", ()): 1,
        ("p2p_diloco_deltas_merged_total", ()): 12,
        ("p2p_diloco_deltas_accepted_total", ()): 21,
        ("p2p_diloco_updates_applied_total", ()): 13,
        ("p2p_diloco_failovers_seen_total", ()): 2,
        ("p2p_diloco_rounds_merged", ()): 4,
        ("p2p_diloco_tick_errors_total", (("error", "TimeoutError"),)): 1,
        ("p2p_diloco_ledger_tokens_total", (("peer", "QmSelf"),)): 6144,
        ("p2p_diloco_ledger_updates_total", (("peer", "QmSelf"),)): 12,
    }
    for key, value in expect.items():
        assert got.get(key) == value, (key, got.get(key))
    assert got[("p2p_diloco_process_resident_bytes", ())] > 50e6  # this test process (torch is loaded)


def test_no_snapshot_yet_exposes_nothing_and_nan_loss_is_allowed():
    assert exposition(make_registry(lambda: None)) == ""
    fresh = NodeSnapshot(**{**SNAPSHOT.__dict__, "loss": math.nan, "rejections": {}, "ledger": {}})
    got = samples(exposition(make_registry(lambda: fresh)))
    assert math.isnan(got[("p2p_diloco_loss", ())])
    assert not any(name == "p2p_diloco_rejections_total" for name, _ in got)


def test_http_endpoint_serves_a_fresh_snapshot_per_scrape_from_its_own_registry():
    current = {"snapshot": SNAPSHOT}
    server = MetricsServer(make_registry(lambda: current["snapshot"]), "127.0.0.1", 0)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics" and server.port > 0

        def scrape() -> dict:
            with urllib.request.urlopen(server.url, timeout=5) as response:
                return samples(response.read().decode())

        assert scrape()[("p2p_diloco_steps_total", ())] == 120
        current["snapshot"] = NodeSnapshot(**{**SNAPSHOT.__dict__, "step": 121})
        got = scrape()
        assert got[("p2p_diloco_steps_total", ())] == 121
        # its own registry: none of the process-global default collectors (python_info, process_*)
        assert not any(name.startswith(("python_", "process_")) for name, _ in got)
        with pytest.raises(ConfigError, match=f"--metrics-port {server.port}: cannot serve"):
            MetricsServer(make_registry(lambda: SNAPSHOT), "127.0.0.1", server.port)  # taken
    finally:
        server.close()


def test_plain_display_prints_lines_and_live_display_draws_a_panel():
    out = io.StringIO()
    plain = make_display(out, "run")  # a StringIO is not a terminal
    assert type(plain) is ProgressDisplay and plain.period(5.0) == 5.0
    plain.say("peer id: QmSelf")
    plain.show(SNAPSHOT, "step 120 loss 2.500")
    assert out.getvalue().splitlines() == ["peer id: QmSelf", "step 120 loss 2.500"]

    out = io.StringIO()
    live = make_display(out, "run", "live")
    assert isinstance(live, LiveProgressDisplay) and live.period(5.0) == 1.0
    live.say("address: /ip4/127.0.0.1/tcp/1")
    live.show(SNAPSHOT, "ignored in live mode")
    live.stop()
    text = out.getvalue()
    for fragment in (
        "address: /ip4",
        "QmSelf",
        "synchronizer",
        "0:v7",
        "stale anchor 2",
        "123.5 kB",
        "failovers seen 2",
        "global eval",
        "loss 2.7500",
        "my deltas sent 15 and refused 1 since start,",
        "merged 12 in all runs",
        "QmSelf 100% (6,144 tok)",
    ):
        assert fragment in text, fragment
    assert "ignored in live mode" not in text


def test_progress_event_fields_carry_accepts_and_the_replica_digest():
    fields = SNAPSHOT.event_fields()
    assert fields["deltas_accepted"] == 21 and fields["first_accepts"] == [[3, 1000.5, 0]]
    assert fields["digest"] == "ab" * 8 and fields["deltas_sent"] == 15
