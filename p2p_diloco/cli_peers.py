"""The `p2p-diloco` subcommands that run against a swarm: `join` (its flags are `node.join_command`'s),
`status`, `dashboard`, `export` and `baseline-worker` (its flags are `baseline.flags`'s); argument parsing
only, `cli.build_parser` adds them.

A run manifest argument is optional to argparse (``nargs="?"``) so that `preflight` can say what happened
when ``--initial-peers`` swallowed it; `--identity` likewise, so its absence gets the `keygen` hint.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from p2p_diloco.baseline.flags import add_baseline_command
from p2p_diloco.node.join_command import MANIFEST_HELP, add_join_command


def add_peer_commands(sub: argparse._SubParsersAction, lazy: Callable[[str], Callable]) -> None:
    add_join_command(sub)

    p = sub.add_parser("status", help="print the swarm of a run: synchronizer, versions, peers")
    p.add_argument("manifest", nargs="?", metavar="MANIFEST", help=MANIFEST_HELP)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--wait", type=float, default=5.0, help="seconds to keep looking while no peer is seen")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for one DHT lookup")
    p.add_argument("--state-dir", default=None, help="a peer's state directory: add its contribution ledger")
    p.add_argument(
        "--ledger", action="store_true", help="print only the ledger of --state-dir (local files, no DHT)"
    )
    p.add_argument(
        "--last", type=int, default=0, metavar="N", help="with a ledger: also list its last N updates"
    )
    p.set_defaults(func=lazy("p2p_diloco.node.status:cli_status"))


def add_run_tools(sub: argparse._SubParsersAction, lazy: Callable[[str], Callable]) -> None:
    """`dashboard`, `export` and `baseline-worker`: after the volunteer's commands in `--help`."""
    p = sub.add_parser("dashboard", help="serve a live web page of a run: eval curve, versions, peers")
    p.add_argument("manifest", nargs="?", metavar="MANIFEST", help=MANIFEST_HELP)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080; 0: any free port)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--poll", type=float, default=2.0, help="seconds between two reads of the swarm")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for one DHT lookup")
    p.set_defaults(func=lazy("p2p_diloco.dashboard.command:cli_dashboard"))

    p = sub.add_parser("export", help="write the global model of a peer's state directory as safetensors")
    p.add_argument("manifest", nargs="?", metavar="MANIFEST", help=MANIFEST_HELP)
    p.add_argument("--state-dir", required=True, help="the peer's state directory (holds replica/)")
    p.add_argument("--out", required=True, help="output file (model.safetensors), or folder for --format hf")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="hf: a folder transformers' from_pretrained loads (model and tokenizer; [model] kind = 'hf')",
    )
    p.set_defaults(func=lazy("p2p_diloco.node.export:cli_export"))
    add_baseline_command(sub, lazy)
