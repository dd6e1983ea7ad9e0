"""`p2p-diloco join`: parse and check the command line, wire SIGINT/SIGTERM to a stop event, run a `PeerNode`.

Every address is parsed with `net.addresses` before anything starts, so a bad one is refused with a
message naming the bad part (exit status 2). SIGINT/SIGTERM stop the peer after its current step; it
then releases its lease if it holds one, flushes its sends, persists its replica and exits 0.
SIGUSR1 ends training but keeps the peer in the swarm (serving, synchronizing), like `--max-steps`.
`--standby` makes this process a hot spare (`node.standby`); `--hot-spare` runs a peer with one beside
it (`node.supervise`, dispatched by `node.join_command` before this module is imported).
Under torchrun (or with `--nproc N`, which execs torchrun) the ranks form one island learner
(`node.island`): rank 0 runs the `PeerNode`, the other ranks only the inner loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import NoReturn

from p2p_diloco.errors import ConfigError
from p2p_diloco.net.addresses import parse_listen_addresses, parse_peer_addresses
from p2p_diloco.net.dht_store import DEFAULT_HOST_MADDRS
from p2p_diloco.net.identity import peer_id_of
from p2p_diloco.net.lifeline import install_stop_handlers, restore_handlers
from p2p_diloco.net.manifest_signature import dense_trust_line, load_run_manifest
from p2p_diloco.node.census import write_census
from p2p_diloco.node.evaluation import EvalMode, EvalOptions
from p2p_diloco.node.heap import bound_heap
from p2p_diloco.node.island import (
    Island,
    check_island_gpus,
    island_env,
    prepare_island,
    run_follower,
    torchrun_argv,
)
from p2p_diloco.node.logsinks import missing_package, parse_log_to
from p2p_diloco.node.observing import ObserveOptions
from p2p_diloco.node.options import NodeOptions, check_device
from p2p_diloco.node.runtime import PeerNode
from p2p_diloco.node.standby import check_standby_args, stand_by
from p2p_diloco.node.state import PEER_STATE_FILE
from p2p_diloco.preflight import check_reachable, explain_start_failure, given_fields, identity_taken


def options_from_args(args: argparse.Namespace) -> NodeOptions:
    """`NodeOptions` from parsed `join` arguments; `ConfigError` naming the bad argument."""
    env = island_env()
    manifest = load_run_manifest(args.manifest, warn=env is None or env.rank == 0)
    initial = parse_peer_addresses(args.initial_peers or manifest.bootstrap, what="--initial-peers")
    listen = parse_listen_addresses(args.listen or DEFAULT_HOST_MADDRS, what="--listen")
    announce = parse_listen_addresses(args.announce or (), what="--announce")
    peer_id_of(args.identity)  # a missing or corrupt key file is refused before anything starts
    check_device(args.device)
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if args.max_steps is not None and args.max_steps < 0:
        raise ConfigError(f"--max-steps must be >= 0, got {args.max_steps}")
    for name in ("persist_every", "progress_every"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0 seconds")
    micro_batch = args.micro_batch
    batch = manifest.diloco.batch_size
    if micro_batch < 0 or (micro_batch and batch % micro_batch):
        raise ConfigError(
            f"--micro-batch must divide the manifest's batch_size {batch} (e.g. {batch // 2 or 1}), "
            f"got {micro_batch}"
        )
    if args.min_step_time < 0:
        raise ConfigError("--min-step-time must be >= 0 seconds")
    if not 0 <= args.train_nice <= 19:
        raise ConfigError(f"--train-nice must be 0 (off) to 19, got {args.train_nice}")
    if not 0 <= args.metrics_port <= 65535:
        raise ConfigError(
            f"--metrics-port must be a TCP port (1-65535) or 0 for none, got {args.metrics_port}"
        )
    parsed = {
        "manifest": manifest,
        "identity": Path(args.identity),
        "state_dir": Path(args.state_dir),
        "initial_peers": tuple(initial),
        "may_sync": not (args.no_sync or args.behind_nat),
        "listen": tuple(listen),
        "announce": tuple(announce),
    }
    return NodeOptions(**{**given_fields(NodeOptions, args), **parsed})


def observe_options_from_args(args: argparse.Namespace) -> ObserveOptions:
    """Global evaluation and ``--log-to`` from `join` arguments; `ConfigError` naming the bad one
    (a ``--log-to`` target whose package is missing names the ``pip install`` that adds it)."""
    evaluate, no_evaluate = getattr(args, "evaluate", False), getattr(args, "no_evaluate", False)
    if evaluate and no_evaluate:
        raise ConfigError("--evaluate and --no-evaluate exclude each other")
    mode = EvalMode.ALWAYS if evaluate else EvalMode.NEVER if no_evaluate else EvalMode.AUTO
    defaults = EvalOptions()
    every = getattr(args, "eval_every", None) or defaults.every_updates
    batches = getattr(args, "eval_batches", None) or defaults.batches
    if every < 1 or batches < 1:
        raise ConfigError(f"--eval-every and --eval-batches must be >= 1, got {every} and {batches}")
    specs = tuple(parse_log_to(value) for value in getattr(args, "log_to", None) or ())
    for spec in specs:
        hint = missing_package(spec.target)
        if hint is not None:
            raise ConfigError(hint)
    return ObserveOptions(EvalOptions(mode=mode, every_updates=every, batches=batches), log_to=specs)


def _configure_logging(verbose: bool) -> None:
    """The project's own log lines to stderr (hivemind configures its loggers itself)."""
    logger = logging.getLogger("p2p_diloco")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False


def cli_join(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    observe = observe_options_from_args(args)
    nproc = getattr(args, "nproc", 1)
    env = island_env()
    if nproc > 1 and env is None:  # checked the arguments above: now run them on nproc torchrun ranks
        _exec_torchrun(options, nproc)
    if env is not None and nproc not in (1, env.world_size):
        raise ConfigError(f"--nproc {nproc} but torchrun started {env.world_size} ranks")
    standby = getattr(args, "standby", False)
    check_standby_args(standby, nproc, env is not None)
    _configure_logging(options.verbose)
    bound_heap()  # freed fragment-sized tensors go back to the system (node/heap.py)
    options, island = prepare_island(options)
    if island is not None and island.rank != 0:
        _exit_as_follower(options, island)
    if (line := dense_trust_line(options.manifest)) is not None:
        print(line, file=sys.stderr, flush=True)  # once per start: who this run trusts with the model
    first_start = _check_first_start(options, standby)
    takeover = None
    if standby:  # a hot spare: prepare, then wait for the takeover line (node/standby.py)
        takeover = stand_by(options, sys.stdin, sys.stdout)
        if takeover is None:
            return 0
    stop = threading.Event()
    previous = install_stop_handlers(stop)
    node = PeerNode(
        options,
        stop=stop,
        island=island,
        observe=observe,
        takeover=takeover,
    )
    _install_usr_signals(node, options, previous)
    try:
        return node.run()
    except ConnectionError as exc:
        print(f"p2p-diloco join: {explain_start_failure(exc, options.identity)}", file=sys.stderr)
        return 2 if first_start or identity_taken(exc) else 1
    finally:
        restore_handlers(previous)
        if island is not None:
            island.close()


def _exec_torchrun(options: NodeOptions, nproc: int) -> NoReturn:
    """Replace this process by torchrun running this same `join` command line on `nproc` ranks."""
    if "join" not in sys.argv[1:]:
        raise ConfigError("--nproc needs the `join` command line in sys.argv; run torchrun yourself")
    if options.device == "cuda":
        check_island_gpus(nproc)  # before torchrun starts ranks that would die on a missing cuda:N
    argv = torchrun_argv(nproc, sys.argv[1:])
    sys.stdout.flush()
    os.execv(argv[0], argv)


def _exit_as_follower(options: NodeOptions, island: Island) -> NoReturn:
    """An island rank other than 0: run the inner loop only (`run_follower`), then exit at once."""
    code = run_follower(options, island)  # its digest is written and the process group closed
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: native threads of the torch.distributed (gloo) backend can
    # abort it (SIGABRT) after a clean STOP, and torchrun then reports the whole island as failed.
    os._exit(code)


def _check_first_start(options: NodeOptions, standby: bool) -> bool:
    """Whether this is the first start on its state directory (then unreachable initial peers are refused
    here); warns when there is no peer to join."""
    # A first start refuses unreachable initial peers and daemon start failures with exit status 2 (a
    # mistake to fix); a restart on a used state directory keeps exit status 1, for its supervisor to retry.
    first_start = not standby and not (options.state_dir / PEER_STATE_FILE).exists()
    if first_start and options.initial_peers:
        check_reachable(options.initial_peers)
    if not options.initial_peers:
        print(
            "warning: no --initial-peers and no bootstrap in the manifest: starting a new swarm alone",
            file=sys.stderr,
        )
    return first_start


def _install_usr_signals(node: PeerNode, options: NodeOptions, previous: dict) -> None:
    """SIGUSR1 ends training (the peer keeps serving), SIGUSR2 writes a memory census; the handlers they
    replace go into `previous`, for `restore_handlers`."""
    main_pid = os.getpid()

    def on_usr1(signum: int, _frame: FrameType | None) -> None:
        if os.getpid() == main_pid:  # forked children (the DHT) inherit this handler: ignore it there
            node.finish_training.set()

    def on_usr2(signum: int, _frame: FrameType | None) -> None:
        if os.getpid() == main_pid:
            write_census(options.state_dir / "memory-census.json", {"node": node})

    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_usr1)
    previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, on_usr2)
