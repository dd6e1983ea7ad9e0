"""The `p2p-diloco` command line: argument parsing only; each subcommand's work lives in its module.

Handlers are imported lazily so `p2p-diloco --help` stays fast and a missing optional piece fails
with a clear message only when used.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence

from p2p_diloco.cli_peers import MANIFEST_HELP, add_peer_commands, add_run_tools
from p2p_diloco.errors import ConfigError
from p2p_diloco.preflight import check_arguments


def _lazy(target: str):
    """`module:function` resolved at call time."""

    def run(args: argparse.Namespace) -> int:
        module_name, func_name = target.split(":")
        return getattr(importlib.import_module(module_name), func_name)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2p-diloco",
        description="Peer-to-peer Decoupled DiLoCo: pool GPUs you don't control into one training run.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # --help lists the commands in this order: a volunteer's first, then the lab's and the organizer's
    add_peer_commands(sub, _lazy)  # join, status
    add_doctor(sub, _lazy)
    add_keygen(sub, _lazy)
    add_bootstrap(sub, _lazy)

    p = sub.add_parser("simulate", help="paper-scale discrete-event goodput simulation (no training)")
    p.add_argument("--learners", "-M", type=int, required=True, help="number of DiLoCo learners M")
    p.add_argument("--chips", "-N", type=int, required=True, help="total number of chips in the cluster")
    p.add_argument("--mtbf-years", type=float, default=1.0, help="mean time between failures of one chip")
    p.add_argument(
        "--hours", type=float, default=None, help="simulated wall time (default: enough for stable figures)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_lazy("p2p_diloco.sim.goodput:cli_simulate"))

    p = sub.add_parser("swarm", help="run the in-process swarm (many learners in one process, fake clock)")
    p.add_argument(
        "--manifest",
        default=None,
        help="run manifest (a .toml file or a packaged name; default: the demo's settings)",
    )
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--tokens", type=int, default=None, help="total tokens to train on (default: a short run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--crash",
        action="append",
        default=[],
        metavar="LEARNER@T:DOWN",
        help="crash learner LEARNER at fake time T seconds for DOWN seconds, e.g. 1@20:15",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("p2p_diloco.swarm.inprocess:cli_swarm"))

    p = sub.add_parser("demo", help="the main job: a swarm on this machine with a report")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of training")
    p.add_argument("--chaos", action="store_true", help="inject failures from a seeded schedule")
    p.add_argument(
        "--chaos-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="long chaos: a seeded fault about every SECONDS for the whole run (kill the synchronizer or a "
        "learner, SIGSTOP a learner, restart the bootstrap node), then check replicas and resume",
    )
    p.add_argument(
        "--compare",
        nargs="?",
        const="dp",
        default=None,
        metavar="{dp,diloco,all}",
        help="also run baselines under the same schedule: dp (the default of a bare --compare: elastic data "
        "parallel on hivemind.Optimizer), diloco (synchronous DiLoCo on hivemind), or all",
    )
    p.add_argument(
        "--baseline", choices=["hivemind"], default=None, help="old spelling of --compare dp (implies it)"
    )
    p.add_argument("--out", default="demo-out", help="directory for report.json and PNGs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--manifest", default=None, help="run manifest (a .toml file or a packaged name; default: demo)"
    )
    p.add_argument(
        "--slow-step-time", type=float, default=0.3, help="--min-step-time of the throttled learner (--chaos)"
    )
    p.add_argument(
        "--hot-spares",
        action="store_true",
        help="keep a prepared `join --standby` per learner that a restart after a kill promotes instead of "
        "starting a cold process (what `join --hot-spare` does for a volunteer)",
    )
    p.set_defaults(func=_lazy("p2p_diloco.demo:cli_demo"))

    p = sub.add_parser("manifest", help="sign a run manifest as its organizer, or verify a signed one")
    actions = p.add_subparsers(dest="manifest_command", required=True, metavar="ACTION")
    a = actions.add_parser("sign", help="write MANIFEST.sig: the authority's signature of the manifest")
    a.add_argument("manifest", help="run manifest TOML with a [trust] authority")
    a.add_argument(
        "--identity", required=True, help="the authority's key file (its peer ID is trust.authority)"
    )
    a.add_argument("--out", default=None, help="signature file to write (default: MANIFEST.sig beside it)")
    a.set_defaults(func=_lazy("p2p_diloco.net.manifest_signature:cli_manifest"))
    a = actions.add_parser("verify", help="check MANIFEST.sig against the manifest's [trust] authority")
    a.add_argument("manifest", help="run manifest TOML")
    a.set_defaults(func=_lazy("p2p_diloco.net.manifest_signature:cli_manifest"))

    p = sub.add_parser("data", help="prepare token shards (and train a tokenizer) from local text")
    actions = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    a = actions.add_parser(
        "prepare", help="tokenize .txt/.jsonl/.parquet files into shards; prints the digest"
    )
    a.add_argument("inputs", nargs="*", help="input files (.txt/.md whole, .jsonl 'text' field, .parquet)")
    a.add_argument("--builtin", action="store_true", help="also Python's bundled pydoc text (no download)")
    a.add_argument(
        "--tokenizer",
        default="bytes",
        help="tokenizers JSON file, a folder or Hub name holding one, or 'bytes'",
    )
    a.add_argument(
        "--dataset", help="a datasets dataset: save_to_disk folder, data file or folder, cached ORG/NAME"
    )
    a.add_argument("--split", default="train", help="--dataset's split (default train)")
    a.add_argument("--subset", default=None, help="--dataset's configuration/subset name, if it has several")
    a.add_argument("--text-field", default="text", help="--dataset's column holding the text (default text)")
    a.add_argument("--out", required=True, help="new folder for index.json and the shards")
    a.add_argument("--eval-fraction", type=float, default=0.05, help="share of the stream held out for eval")
    a.add_argument("--shard-tokens", type=int, default=50_000_000, help="tokens per train shard at most")
    a.set_defaults(func=_lazy("p2p_diloco.model.prepare:cli_data"))
    a = actions.add_parser("tokenizer", help="train a byte-level BPE tokenizer on local text, offline")
    a.add_argument("inputs", nargs="*", help="input files, as for prepare")
    a.add_argument("--builtin", action="store_true", help="also Python's bundled pydoc text")
    a.add_argument("--vocab-size", type=int, default=4096)
    a.add_argument("--out", required=True, help="tokenizer JSON file to write")
    a.set_defaults(func=_lazy("p2p_diloco.model.prepare:cli_data"))

    p = sub.add_parser("model-digest", help="build a manifest's initial model and print its weights digest")
    p.add_argument("manifest", nargs="?", metavar="MANIFEST", help=MANIFEST_HELP)
    p.set_defaults(func=_lazy("p2p_diloco.model.gpt:cli_model_digest"))

    add_run_tools(sub, _lazy)  # dashboard, export, baseline-worker
    return parser


def add_keygen(sub: argparse._SubParsersAction, lazy) -> None:
    p = sub.add_parser("keygen", help="write a private key file; prints the peer ID it gives")
    p.add_argument("--out", required=True, help="path of the key file to write (mode 0600)")
    p.add_argument("--force", action="store_true", help="overwrite an existing key file")
    p.set_defaults(func=lazy("p2p_diloco.net.identity:cli_keygen"))


def add_bootstrap(sub: argparse._SubParsersAction, lazy) -> None:
    p = sub.add_parser("bootstrap", help="run a DHT-only bootstrap node (trains nothing)")
    p.add_argument("--identity", default=None, help="key file from `p2p-diloco keygen` (stable peer ID)")
    p.add_argument(
        "--manifest",
        default=None,
        help="a run manifest to check before starting (a public run's signature, as join checks it)",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=None,
        metavar="MULTIADDR",
        help="address to listen on (repeatable); default /ip4/0.0.0.0/tcp/31337",
    )
    p.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="public address to announce (repeatable)",
    )
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument(
        "--state-dir",
        default=None,
        help="with --manifest: remember the run's peers and the proof it is under way across restarts",
    )
    p.set_defaults(func=lazy("p2p_diloco.net.bootstrap:cli_bootstrap"))


def version_line() -> str:
    """`p2p-diloco --version`: the installed distribution's version (the source's when not installed)."""
    try:
        version = importlib.metadata.version("p2p_diloco")
    except importlib.metadata.PackageNotFoundError:
        from p2p_diloco import __version__ as version
    return f"p2p-diloco {version} (Python {sys.version.split()[0]})"


def add_doctor(sub: argparse._SubParsersAction, lazy) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine before joining (or for a bug report): versions, devices, memory, clock, "
        "peers, reachability, state dir; ok / warn / fail with the fix",
    )
    p.add_argument("manifest", nargs="?", metavar="MANIFEST", help=MANIFEST_HELP + "; optional")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument("--state-dir", default=None, help="the state directory you will join with")
    p.add_argument("--device", default=None, help="the --device you will join with (default: cuda if any)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each network check")
    p.set_defaults(func=lazy("p2p_diloco.doctor:cli_doctor"))


def _stdout_gone(command: str) -> int:
    """stdout's reader went away (`... | head`): no traceback, and no second error when Python flushes."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    print(
        f"p2p-diloco {command}: the output's reader closed it early (e.g. `| head`); "
        "the rest was not printed: redirect to a file (> out.txt) to keep all of it",
        file=sys.stderr,
    )
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe raises here, inside the handler below, not at exit
        return code
    except ConfigError as exc:
        print(f"p2p-diloco {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _stdout_gone(args.command)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
