"""`p2p-diloco bootstrap`: a DHT-only node with a stable peer ID that new peers join through.

It trains nothing and knows no run: it stores and serves owner-signed records (signature checks
only), relays for peers behind NAT (libp2p circuit relay v2: p2pd's relay service is on whenever
relaying is enabled), and prints one ``bootstrap address: <multiaddr>/p2p/<id>`` line per address
once it is ready. SIGINT or SIGTERM shuts it down cleanly with exit status 0. With ``--manifest`` it
first checks a run's manifest like ``join`` does (the authority's signature of a public run); with
``--state-dir`` too it watches that run and remembers its peers and the proof that it is under way
across restarts (`net.bootstrap_state`: a restart dials them again, and a newcomer through it never
starts the run again from version 0).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence

from p2p_diloco.config import RunManifest
from p2p_diloco.net.bootstrap_state import WATCH_PERIOD, BootstrapMemory, dht_now
from p2p_diloco.net.dht_store import EXIT_DHT_DIED, DhtKeyValueStore, create_dht
from p2p_diloco.net.identity import peer_id_of
from p2p_diloco.net.lifeline import install_stop_handlers, restore_handlers
from p2p_diloco.net.manifest_signature import load_run_manifest

log = logging.getLogger(__name__)

# p2pd here always has QUIC; listening on it too helps peers behind NAT (UDP hole punching)
DEFAULT_LISTEN = ("/ip4/0.0.0.0/tcp/31337", "/ip4/0.0.0.0/udp/31337/quic-v1")
ADDRESS_LINE_PREFIX = "bootstrap address: "


def run_bootstrap(
    *,
    identity: str | None,
    listen: Sequence[str],
    announce: Sequence[str],
    initial_peers: Sequence[str],
    stop: threading.Event,
    out=sys.stdout,
    manifest: RunManifest | None = None,
    state_dir: str | None = None,
) -> int:
    """Serve until `stop` is set; the CLI wires `stop` to SIGINT/SIGTERM."""
    memory = None
    if manifest is not None and state_dir is not None:
        memory = BootstrapMemory(state_dir, manifest, peer_id_of(identity) if identity else "")
    saved = [a for a in (memory.dial_list() if memory else []) if a not in initial_peers]
    if identity is None:
        print(
            "warning: no --identity given: the peer ID (and so the bootstrap address) "
            "changes on every start; create a key with `p2p-diloco keygen --out bootstrap.key`",
            file=sys.stderr,
        )
    extra = {"ensure_bootstrap_success": False} if saved else {}  # saved peers may be gone: serve anyway
    peer = create_dht(
        initial_peers=[*initial_peers, *saved],
        identity_path=identity,
        host_maddrs=listen,
        announce_maddrs=announce,
        client_mode=False,
        use_relay=True,
        **extra,
    )
    try:
        addresses = peer.visible_addresses()
        for address in addresses:
            print(f"{ADDRESS_LINE_PREFIX}{address}", file=out)
        out.flush()
        print(f"bootstrap {peer.peer_id} ready; stop with Ctrl-C or SIGTERM", file=sys.stderr, flush=True)
        kv = DhtKeyValueStore(peer, timeout=WATCH_PERIOD * 2) if memory else None
        while not stop.wait(WATCH_PERIOD if memory else 1.0):
            if memory is not None and kv is not None:
                memory.watch(kv, dht_now())
            if not peer.alive():  # hivemind's DHT process died: nothing is served any more
                print("error: the DHT process died; exiting for a supervisor to restart", file=sys.stderr)
                return EXIT_DHT_DIED
    finally:
        print("bootstrap stopping: shutting the DHT node down", file=sys.stderr, flush=True)
        peer.shutdown()
    print("bootstrap stopped", file=sys.stderr, flush=True)
    return 0


def check_manifest(manifest_path: str, identity: str | None) -> RunManifest:
    """``bootstrap --manifest``: refuse a public run's manifest whose signature does not hold (as ``join``
    does), and note when this node's peer ID is not among the manifest's bootstrap addresses."""
    manifest = load_run_manifest(manifest_path)
    if identity and not any(a.endswith(f"/p2p/{peer_id_of(identity)}") for a in manifest.bootstrap):
        print(
            f"note: {manifest_path} does not list this node ({peer_id_of(identity)}) "
            "in bootstrap; volunteers "
            "will not find it there until the organizer adds its address and signs the manifest again",
            file=sys.stderr,
        )
    return manifest


def cli_bootstrap(args: argparse.Namespace) -> int:
    """`p2p-diloco bootstrap [--identity KEY] [--manifest RUN.toml] [--listen MA]... [--announce MA]...
    [--initial-peers MA...]`."""
    manifest = check_manifest(args.manifest, args.identity) if getattr(args, "manifest", None) else None
    state_dir = getattr(args, "state_dir", None)
    if state_dir and manifest is None:
        print("p2p-diloco bootstrap: --state-dir needs --manifest (the run to watch)", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = install_stop_handlers(stop)
    try:
        return run_bootstrap(
            identity=args.identity,
            listen=args.listen or DEFAULT_LISTEN,
            announce=args.announce or (),
            initial_peers=args.initial_peers or (),
            stop=stop,
            manifest=manifest,
            state_dir=state_dir,
        )
    except ConnectionError as exc:  # e.g. --initial-peers unreachable, port already taken
        print(f"p2p-diloco bootstrap: {exc}", file=sys.stderr)
        return 1
    finally:
        restore_handlers(previous)
