"""`p2p-diloco baseline-worker`'s flags, declared next to the options they fill (`baseline.command`
turns them into `BaselineOptions` and `ElasticSettings`, same-named flags as they are), without
importing torch or hivemind: parsing a command line stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from p2p_diloco.node.join_command import MANIFEST_HELP

MODES = ("dp", "diloco")


def add_baseline_command(sub: argparse._SubParsersAction, lazy: Callable[[str], Callable]) -> None:
    """The `baseline-worker` subcommand and its flags."""
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
        choices=list(MODES),
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
