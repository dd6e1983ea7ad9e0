"""Prometheus metrics of one node.

* `NodeCollector`: a prometheus_client collector that turns one `NodeSnapshot` (taken when scraped)
  into metric families. It lives in its own `CollectorRegistry`, never the process-global one, so two
  nodes in one process (tests) never clash.
* `MetricsServer`: the HTTP endpoint (``/metrics``) on a daemon thread, 127.0.0.1 by default. A scrape
  takes its snapshot on the peer's owner thread (`PeerNode.snapshot`), never reading the peer itself.

Metric names (prefix ``p2p_diloco_``): steps_total, tokens_total, loss, tokens_per_second, step_seconds,
eval_loss (the newest global evaluation this peer ran or read), process_resident_bytes (Linux), training,
role{role}, term, synchronizer_info{holder,term}, fragment_version{fragment}, live_peers,
bytes_sent_total, bytes_received_total (payload bytes over the transport's streams to other peers,
counted by the transport as they move: request bodies and reply items, deltas, updates, fetches and
what this peer serves; framing, libp2p and DHT traffic excluded), rejections_total{reason},
rejections_by_sender_total{sender,reason}, deltas_sent_total, deltas_rejected_total,
deltas_merged_total, deltas_accepted_total (remote deltas accepted as synchronizer),
updates_applied_total, failovers_seen_total, rounds_merged (this term, as synchronizer),
tick_errors_total{error}, ledger_tokens_total{peer}, ledger_weight_total{peer},
ledger_updates_total{peer}.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import generate_latest, start_http_server
from prometheus_client.registry import Collector

from p2p_diloco.errors import ConfigError
from p2p_diloco.node.reporting import ROLES, NodeSnapshot

PREFIX = "p2p_diloco_"


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _labelled(kind: type, name: str, doc: str, labels: list[str], rows: list[tuple[list[str], float]]):
    family = kind(PREFIX + name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def resident_bytes() -> int | None:
    """This process's resident set size from /proc/self/statm (Linux), None elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def snapshot_metrics(s: NodeSnapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (module docstring lists them)."""
    yield from _training_metrics(s)
    yield from _synchronizer_metrics(s)
    yield from _traffic_metrics(s)
    yield from _exchange_metrics(s)
    yield _labelled(
        CounterMetricFamily,
        "tick_errors",
        "failed swarm or sync ticks, by exception type",
        ["error"],
        sorted(([error], n) for error, n in s.tick_errors.items()),
    )
    yield from _ledger_metrics(s)


def _training_metrics(s: NodeSnapshot) -> Iterator[Metric]:
    """What this process trained, how fast, to what loss, in how much memory."""
    yield _counter("steps", "inner steps trained by this process", s.step)
    yield _counter("tokens", "tokens trained by this process", s.tokens)
    yield _gauge("loss", "training loss of the last inner step (NaN before the first)", s.loss)
    yield _gauge("tokens_per_second", "training throughput (0 when not training)", s.tokens_per_s)
    yield _gauge("step_seconds", "seconds of the last inner step (0 before the first)", s.step_time)
    yield _gauge("eval_loss", "newest global eval loss this peer ran or read (NaN: none yet)", s.eval_loss)
    rss = resident_bytes()
    if rss is not None:
        yield _gauge("process_resident_bytes", "resident memory of this process (Linux)", rss)
    yield _gauge("training", "1 while this peer trains, 0 once it only serves", float(s.training))


def _synchronizer_metrics(s: NodeSnapshot) -> Iterator[Metric]:
    """This peer's role, the synchronizer and term it sees, its replica's versions, the live peers."""
    yield _labelled(
        GaugeMetricFamily,
        "role",
        "1 for this peer's current role",
        ["role"],
        [([role], float(role == s.role)) for role in ROLES],
    )
    yield _gauge("term", "highest synchronizer term seen", s.term)
    info = InfoMetricFamily(PREFIX + "synchronizer", "the current synchronizer as this peer sees it")
    info.add_metric([], {"holder": s.holder or "", "term": str(s.term)})
    yield info
    yield _labelled(
        GaugeMetricFamily,
        "fragment_version",
        "global version of each fragment in this peer's replica",
        ["fragment"],
        [([str(p)], v) for p, v in enumerate(s.versions)],
    )
    yield _gauge("live_peers", "peers with a live heartbeat, this one included", s.live_peers)


def _traffic_metrics(s: NodeSnapshot) -> Iterator[Metric]:
    """Bytes moved over the transport, and the inputs refused (by reason, and by sender and reason)."""
    yield _counter("bytes_sent", "transport payload bytes sent, pushed and served", s.bytes_sent)
    yield _counter("bytes_received", "transport payload bytes received and fetched", s.bytes_received)
    yield _labelled(
        CounterMetricFamily,
        "rejections",
        "inputs this peer refused, by reason tag",
        ["reason"],
        sorted(([tag], n) for tag, n in s.rejections.items()),
    )
    yield _labelled(
        CounterMetricFamily,
        "rejections_by_sender",
        "inputs this peer refused, by sender and reason tag",
        ["sender", "reason"],
        sorted(([sender, tag], n) for (sender, tag), n in s.rejections_by_sender.items()),
    )


def _exchange_metrics(s: NodeSnapshot) -> Iterator[Metric]:
    """The outer exchange as this peer took part: deltas, updates, failovers, rounds merged."""
    yield _counter("deltas_sent", "fragment deltas this peer sent", s.deltas_sent)
    yield _counter("deltas_rejected", "deltas of this peer the synchronizer refused", s.deltas_rejected)
    yield _counter("deltas_accepted", "remote deltas this peer accepted as synchronizer", s.deltas_accepted)
    yield _counter(
        "deltas_merged", "applied updates that merged a delta of this peer (ledger)", s.deltas_merged
    )
    yield _counter("updates_applied", "outer updates applied to this peer's replica", s.updates_applied)
    yield _counter(
        "failovers_seen",
        "synchronizer changes this peer observed (planned rotations excluded)",
        s.failovers_seen,
    )
    yield _gauge(
        "rounds_merged", "rounds merged in the current term while this peer synchronizes", s.rounds_merged
    )


def _ledger_metrics(s: NodeSnapshot) -> Iterator[Metric]:
    """Each peer's share of the updates this peer applied: tokens, merge weight, updates."""
    for field, doc in (
        ("tokens", "tokens of each peer merged into updates this peer applied (ledger)"),
        ("weight", "merge weight of each peer in updates this peer applied (ledger)"),
        ("updates", "updates this peer applied that merged a delta of each peer (ledger)"),
    ):
        yield _labelled(
            CounterMetricFamily,
            f"ledger_{field}",
            doc,
            ["peer"],
            sorted(([peer], row[field]) for peer, row in s.ledger.items()),
        )


class NodeCollector(Collector):
    """Collects a fresh `NodeSnapshot` from `snapshot` at every scrape."""

    def __init__(self, snapshot: Callable[[], NodeSnapshot | None]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        if s is not None:
            yield from snapshot_metrics(s)


def make_registry(snapshot: Callable[[], NodeSnapshot | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(snapshot))
    return registry


def exposition(registry: CollectorRegistry) -> str:
    """The Prometheus text exposition of `registry` (what ``/metrics`` serves)."""
    return generate_latest(registry).decode()


class MetricsServer:
    """``/metrics`` over HTTP on a daemon thread; `port` 0 picks a free port (see `port`)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        self.registry = registry
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:  # port taken, address not local, ...
            raise ConfigError(
                f"--metrics-port {port}: cannot serve metrics on {host}: {exc.strerror or exc}; "
                "pick a free port (or --metrics-host)"
            ) from exc
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
