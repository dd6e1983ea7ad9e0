"""`p2p-diloco join`'s command line: its flags (`add_join_command`) and its entry (`cli_join_entry`).

The flags are declared here, next to what they ask for (`node.options.NodeOptions`, which
`node.join.options_from_args` fills from them), without importing torch: parsing a command line stays
fast and a `--hot-spare` supervisor (`node.supervise`) never loads it. The entry runs that supervisor,
or imports `node.join` (quietly, at a lower priority, for a `--standby` spare) and runs the peer.

A run manifest argument is optional to argparse (``nargs="?"``) so that `preflight` can say what happened
when ``--initial-peers`` swallowed it; `--identity` likewise, so its absence gets the `keygen` hint.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

from p2p_diloco.errors import ConfigError
from p2p_diloco.node.priority import run_lowered
from p2p_diloco.node.supervise import SPARE_NICENESS, Supervisor

MANIFEST_HELP = "run manifest: a .toml file, or a packaged example by name (demo, llama-tiny, public)"


def add_join_command(sub: argparse._SubParsersAction) -> None:
    """The `join` subcommand and its flags."""
    p = sub.add_parser("join", help="run a learner (and synchronizer candidate) in a real swarm")
    p.add_argument("manifest", nargs="?", metavar="MANIFEST", help=MANIFEST_HELP)
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MULTIADDR",
        help="peer addresses to join through (default: the manifest's bootstrap list)",
    )
    p.add_argument("--identity", default=None, help="key file from `p2p-diloco keygen` (stable peer ID)")
    p.add_argument("--state-dir", required=True, help="directory for the replica, peer state and event log")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--no-sync", action="store_true", help="never take the synchronizer role")
    p.add_argument(
        "--behind-nat",
        action="store_true",
        help="this peer cannot accept connections: relay through the initial peers, never synchronize",
    )
    p.add_argument(
        "--listen", action="append", default=None, metavar="MULTIADDR", help="default /ip4/0.0.0.0/tcp/0"
    )
    p.add_argument("--announce", action="append", default=[], metavar="MULTIADDR")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop training after N steps (keeps serving until stopped)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument(
        "--train-nice",
        type=int,
        default=5,
        help="nice value added to the training thread so heartbeats, leases and the DHT get the CPU "
        "first (Linux; default 5, 0: off)",
    )
    p.add_argument("--persist-every", type=float, default=30.0, help="seconds between replica saves")
    p.add_argument("--progress-every", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument(
        "--min-step-time", type=float, default=0.0, help="pace inner steps to at least this many seconds"
    )
    p.add_argument("--verbose", action="store_true", help="print every decision to stderr")
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (default 0: off)"
    )
    p.add_argument(
        "--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds (default 127.0.0.1)"
    )
    p.add_argument(
        "--display",
        choices=["auto", "live", "plain"],
        default="auto",
        help="progress output: a live panel (rich) or plain lines; auto: live when stdout is a terminal",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        metavar="N",
        help="sequences per forward/backward; the manifest's batch_size (a step) is accumulated over "
        "batch_size/N micro-batches (default: the whole batch at once)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help=(
            "run this learner as an island of N local ranks that train as one peer "
            "(execs torchrun --standalone)"
        ),
    )
    p.add_argument(
        "--evaluate",
        action="store_true",
        help="evaluate the global model on the held-out split and publish the curve (default: the "
        "synchronizer does, unless a peer with --evaluate is live)",
    )
    p.add_argument("--no-evaluate", action="store_true", help="never evaluate the global model")
    p.add_argument(
        "--eval-every", type=int, default=None, metavar="N", help="merged updates between evaluations (20)"
    )
    p.add_argument(
        "--eval-batches", type=int, default=None, metavar="B", help="eval batches of 8 windows (4)"
    )
    p.add_argument(
        "--log-to",
        action="append",
        default=[],
        metavar="TARGET",
        help="tensorboard:DIR or wandb[:PROJECT] (repeatable): loss, tokens/s, merged tokens, global eval",
    )
    p.add_argument(
        "--hot-spare",
        action="store_true",
        help="keep a prepared spare process beside this peer that takes over within seconds if the peer "
        "dies (a supervisor runs both)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="be a hot spare: prepare the model, then wait for the line 'go' on stdin to take over "
        "(what --hot-spare and `demo --hot-spares` start)",
    )
    p.set_defaults(func=cli_join_entry)


def supervised_argv(argv: Sequence[str]) -> list[str]:
    """This process's `join` command line without ``--hot-spare``, run with this Python."""
    if "join" not in argv:
        raise ConfigError("--hot-spare needs the `join` command line in sys.argv")
    return [sys.executable, "-m", "p2p_diloco", *(a for a in argv if a != "--hot-spare")]


def restore_sigint() -> None:
    """Python's own SIGINT handler (KeyboardInterrupt until the peer installs its stop handler). A shell
    script's background job (`p2p-diloco join ... &`) starts with SIGINT ignored, and Python keeps an
    inherited "ignore": Ctrl-C and `kill -INT` would then never stop the peer."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def cli_join_entry(args: argparse.Namespace) -> int:
    """`p2p-diloco join`: the supervisor for ``--hot-spare`` (without importing torch), else the peer."""
    restore_sigint()
    if getattr(args, "hot_spare", False):
        if getattr(args, "standby", False):
            raise ConfigError("--hot-spare and --standby exclude each other: the supervisor starts the spare")
        if getattr(args, "nproc", 1) > 1:
            raise ConfigError("--hot-spare runs one process; an island learner (--nproc) has no hot spare")
        return Supervisor(supervised_argv(sys.argv[1:])).run()
    if getattr(args, "standby", False):
        return _imported_quietly().cli_join(args)
    from p2p_diloco.node import join  # torch, hivemind and the rest: only for a peer, not its supervisor

    return join.cli_join(args)


def _imported_quietly() -> ModuleType:
    """`node.join` (torch, hivemind and the rest) imported on a thread at a lower priority: a spare's
    imports take the CPU only where the peers beside it leave it idle (the takeover then runs at the
    priority the process started with)."""
    return run_lowered(
        SPARE_NICENESS, lambda: importlib.import_module("p2p_diloco.node.join"), name="standby-imports"
    )
