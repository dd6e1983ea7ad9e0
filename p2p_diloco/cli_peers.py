"""The `p2p-diloco` subcommands that run against a swarm: `join` (its flags are `node.join_command`'s),
`status`, `dashboard`, `export` and `baseline-worker` (argument parsing only; `cli.build_parser` adds them).

A run manifest argument is optional to argparse (``nargs="?"``) so that `preflight` can say what happened
when ``--initial-peers`` swallowed it; `--identity` likewise, so its absence gets the `keygen` hint.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

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

    p = sub.add_parser(
        "baseline-worker",
        help="one baseline peer: elastic data parallel on hivemind.Optimizer (--mode dp, the lock-step "
        "baseline) or synchronous DiLoCo on hivemind (--mode diloco)",
    )
    p.add_argument("manifest", nargs="?", metavar="MANIFEST", help=MANIFEST_HELP)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument("--identity", default=None, help="key file from `p2p-diloco keygen` (stable peer ID)")
    p.add_argument("--state-dir", required=True, help="directory for the checkpoint and the event log")
    p.add_argument(
        "--listen", action="append", default=None, metavar="MULTIADDR", help="default /ip4/127.0.0.1/tcp/0"
    )
    p.add_argument(
        "--learners",
        type=int,
        default=4,
        help="peers expected (dp: the default target batch; diloco: the all-reduce group size)",
    )
    p.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        help="samples per global step across the swarm (default: learners x the manifest's batch_size)",
    )
    p.add_argument("--matchmaking-time", type=float, default=1.0, help="seconds to gather a group")
    p.add_argument("--averaging-timeout", type=float, default=10.0, help="seconds before a round is given up")
    p.add_argument(
        "--average-state-every", type=int, default=1, help="global steps between parameter averaging"
    )
    p.add_argument(
        "--peer-expiration",
        type=float,
        default=10.0,
        help="seconds a silent peer still counts as a member (hivemind's default is 60)",
    )
    p.add_argument("--compression", choices=["fp16", "fp32"], default="fp32")
    p.add_argument("--max-steps", type=int, default=None, help="leave the swarm after N local steps")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument(
        "--min-step-time", type=float, default=0.0, help="pace steps to at least this many seconds"
    )
    p.add_argument("--progress-every", type=float, default=1.0, help="seconds between progress events")
    p.add_argument("--checkpoint-every", type=float, default=10.0, help="seconds between checkpoints")
    p.add_argument("--verbose", action="store_true", help="hivemind logs every round to stderr")
    p.add_argument(
        "--mode",
        choices=["dp", "diloco"],
        default="dp",
        help="dp: elastic data parallel on hivemind.Optimizer; diloco: synchronous DiLoCo (H local AdamW "
        "steps, then an all-reduce of outer gradients and the manifest's outer Nesterov step)",
    )
    p.add_argument(
        "--wait-for-peers",
        type=float,
        default=30.0,
        help="--mode diloco: seconds a round waits for slower peers before going on without them",
    )
    p.set_defaults(func=lazy("p2p_diloco.baseline.command:cli_baseline_worker"))
