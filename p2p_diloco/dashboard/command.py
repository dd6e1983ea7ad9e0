"""`p2p-diloco dashboard MANIFEST --initial-peers ... [--port 8080] [--host 127.0.0.1]`: the run, live.

A passive DHT client like `status` (it writes nothing, serves nothing to the swarm) polls the run every
``--poll`` seconds into a `Collector` and serves its view over HTTP (`dashboard.server`), bound to
127.0.0.1 unless ``--host`` says otherwise. Peers come and go, the one it bootstrapped from included:
when its DHT node stops answering (several failed polls in a row) or sees no peer any more after it
saw some, it starts a new DHT node through the initial peers *and* the addresses the peers last
announced in their heartbeats, and the page keeps showing the last view meanwhile (marked stale).
SIGINT/SIGTERM stop it (exit 0).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.dashboard.collector import Collector
from p2p_diloco.dashboard.server import DashboardServer
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.addresses import parse_peer_addresses
from p2p_diloco.net.dht_store import DhtKeyValueStore, DhtPeer, create_dht
from p2p_diloco.net.lifeline import install_stop_handlers, restore_handlers
from p2p_diloco.net.manifest_signature import load_run_manifest

RECONNECT_AFTER = 3  # failed (or empty after non-empty) polls in a row before a new DHT node
RECONNECT_EVERY = 10.0  # seconds between two attempts


class Poller:
    """Owns the dashboard's DHT node and polls it into the collector on its own thread."""

    def __init__(self, collector: Collector, initial: list[str], *, poll: float, timeout: float):
        self.collector, self.initial, self.poll_seconds, self.timeout = collector, initial, poll, timeout
        self.dht: DhtPeer | None = None
        self.kv: DhtKeyValueStore | None = None
        self._bad = 0
        self._last_attempt = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def connect(self, extra: list[str] | None = None) -> None:
        """A new DHT client node through the initial peers (and `extra` addresses); ConnectionError if none
        answers."""
        addresses = list(dict.fromkeys([*(extra or []), *self.initial]))
        old = self.dht
        self.dht = create_dht(initial_peers=addresses, client_mode=True)
        self.kv = DhtKeyValueStore(self.dht, timeout=self.timeout)
        if old is not None:
            old.shutdown(timeout=1.0)

    def poll_once(self) -> None:
        assert self.kv is not None
        errors, had_peers = (
            self.collector.errors,
            bool(self.collector.status and self.collector.status["peers"]),
        )
        self.collector.poll(self.kv, get_dht_time())
        empty = self.collector.status is not None and not self.collector.status["peers"]
        bad = self.collector.errors > errors or (had_peers and empty)
        self._bad = self._bad + 1 if bad or (self._bad and empty) else 0
        if self._bad >= RECONNECT_AFTER and time.monotonic() - self._last_attempt >= RECONNECT_EVERY:
            self._last_attempt = time.monotonic()
            try:
                self.connect(self.collector.known_addresses())
                self.collector.reconnects += 1
                self._bad = 0
            except (ConnectionError, ConfigError) as exc:
                self.collector.last_error = f"reconnect failed: {exc}"[:300]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dashboard-poll", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll_once()
            self._stop.wait(max(0.0, self.poll_seconds - (time.monotonic() - started)))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 5.0)
        if self.dht is not None:
            self.dht.shutdown(timeout=2.0)


def check_args(args: argparse.Namespace) -> list[str]:
    """The initial peers; `ConfigError` naming a bad argument."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be a TCP port (1-65535, or 0 for any free one), got {args.port}")
    if args.poll <= 0 or args.timeout <= 0:
        raise ConfigError("--poll and --timeout must be > 0 seconds")
    return parse_peer_addresses(args.initial_peers, what="--initial-peers")


def cli_dashboard(args: argparse.Namespace) -> int:
    manifest = load_run_manifest(
        args.manifest
    )  # a public run's manifest must carry its authority's signature
    initial = check_args(args) or parse_peer_addresses(manifest.bootstrap, what="the manifest's bootstrap")
    if not initial:
        raise ConfigError(
            "no --initial-peers and no bootstrap in the manifest: the dashboard needs a peer to ask"
        )
    collector = Collector(manifest)
    try:
        server = DashboardServer(lambda: collector.view(get_dht_time()), args.host, args.port)
    except OSError as exc:
        print(
            f"p2p-diloco dashboard: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    stop = threading.Event()
    previous = install_stop_handlers(stop)
    poller = Poller(collector, initial, poll=args.poll, timeout=args.timeout)
    try:
        try:
            poller.connect()
        except ConnectionError as exc:
            print(f"p2p-diloco dashboard: {exc}", file=sys.stderr)
            return 1
        poller.poll_once()
        poller.start()
        server.start()
        print(f"dashboard: {server.url}", flush=True)
        stop.wait()
    finally:
        server.close()
        poller.close()
        restore_handlers(previous)
    return 0
