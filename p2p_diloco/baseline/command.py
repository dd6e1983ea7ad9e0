"""`p2p-diloco baseline-worker`: checks of its arguments (declared in `baseline.flags`) and the handler.

``--mode dp`` (default) runs the elastic data-parallel peer (`worker.BaselineWorker`), ``--mode diloco``
a synchronous DiLoCo peer (`diloco.DilocoWorker`: H, outer lr and momentum from the manifest).

Every address and the identity file are checked before anything starts (exit status 2 with a message
naming the argument); SIGINT/SIGTERM stop the worker after its current step and it exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from p2p_diloco.baseline.elastic import ElasticSettings, hivemind_run_id
from p2p_diloco.baseline.flags import MODES
from p2p_diloco.baseline.rounds import DilocoSettings
from p2p_diloco.baseline.worker import BaselineOptions, BaselineWorker
from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.addresses import parse_listen_addresses, parse_peer_addresses
from p2p_diloco.net.identity import peer_id_of
from p2p_diloco.net.lifeline import install_stop_handlers, restore_handlers
from p2p_diloco.preflight import given_fields

DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)


def options_from_args(args: argparse.Namespace) -> BaselineOptions:
    """`BaselineOptions` from parsed arguments; `ConfigError` naming the bad argument."""
    manifest = RunManifest.load(args.manifest)
    initial = parse_peer_addresses(args.initial_peers or manifest.bootstrap, what="--initial-peers")
    listen = parse_listen_addresses(args.listen or DEFAULT_LISTEN, what="--listen")
    peer_id_of(args.identity)  # a missing or corrupt key file is refused before anything starts
    positive = {
        "--learners": args.learners,
        "--threads": args.threads,
        "--average-state-every": args.average_state_every,
        "--matchmaking-time": args.matchmaking_time,
        "--averaging-timeout": args.averaging_timeout,
        "--peer-expiration": args.peer_expiration,
        "--progress-every": args.progress_every,
        "--checkpoint-every": args.checkpoint_every,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if args.target_batch_size is not None and args.target_batch_size < 1:
        raise ConfigError(f"--target-batch-size must be >= 1, got {args.target_batch_size}")
    if args.max_steps is not None and args.max_steps < 0:
        raise ConfigError(f"--max-steps must be >= 0, got {args.max_steps}")
    if args.min_step_time < 0:
        raise ConfigError("--min-step-time must be >= 0 seconds")
    mode = args.mode
    if mode not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    wait_for_peers = args.wait_for_peers
    if wait_for_peers < 0:
        raise ConfigError(f"--wait-for-peers must be >= 0 seconds, got {wait_for_peers}")
    batch = manifest.diloco.batch_size
    diloco = None
    if mode == "diloco":
        diloco = DilocoSettings(
            inner_steps=manifest.diloco.inner_steps,
            outer_lr=manifest.diloco.outer_lr,
            outer_momentum=manifest.diloco.outer_momentum,
            group_size=args.learners,
            wait_limit=wait_for_peers,
        )
    settings = {
        "run_id": hivemind_run_id(manifest, "baseline" if mode == "dp" else mode),
        "target_batch_size": args.target_batch_size or args.learners * batch,
        "batch_size_per_step": batch,
        "load_state_timeout": max(30.0, 3 * args.averaging_timeout),
    }
    elastic = ElasticSettings(**{**given_fields(ElasticSettings, args), **settings})
    parsed = {
        "manifest": manifest,
        "identity": Path(args.identity),
        "state_dir": Path(args.state_dir),
        "elastic": elastic,
        "initial_peers": tuple(initial),
        "listen": tuple(listen),
        "diloco": diloco,
    }
    return BaselineOptions(**{**given_fields(BaselineOptions, args), **parsed})


def cli_baseline_worker(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    stop = threading.Event()
    previous = install_stop_handlers(stop)
    if options.diloco is not None:
        from p2p_diloco.baseline.diloco import DilocoWorker

        worker: BaselineWorker = DilocoWorker(options, stop=stop)
    else:
        worker = BaselineWorker(options, stop=stop)
    try:
        status = worker.run()
    except ConnectionError as exc:
        print(f"p2p-diloco baseline-worker: {exc}", file=sys.stderr)
        return 1
    finally:
        restore_handlers(previous)
    if not worker.teardown_complete:  # hivemind threads or children hang: state is saved, leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
