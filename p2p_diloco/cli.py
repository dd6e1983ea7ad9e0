"""The `p2p-diloco` command line: argument parsing only; each subcommand's work lives in its module.

Handlers are imported lazily so `p2p-diloco --help` stays fast and a missing optional piece fails
with a clear message only when used.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from p2p_diloco.errors import ConfigError


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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    p.add_argument("--manifest", default=None, help="run manifest TOML (default: peers/demo.toml settings)")
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
    p.add_argument("--manifest", default=None, help="run manifest TOML (default: peers/demo.toml)")
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

    p = sub.add_parser("keygen", help="write a private key file; prints the peer ID it gives")
    p.add_argument("--out", required=True, help="path of the key file to write (mode 0600)")
    p.add_argument("--force", action="store_true", help="overwrite an existing key file")
    p.set_defaults(func=_lazy("p2p_diloco.net.identity:cli_keygen"))

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
    p.set_defaults(func=_lazy("p2p_diloco.net.bootstrap:cli_bootstrap"))

    p = sub.add_parser("join", help="run a learner (and synchronizer candidate) in a real swarm")
    p.add_argument("manifest", help="run manifest TOML, e.g. peers/demo.toml")
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MULTIADDR",
        help="peer addresses to join through (default: the manifest's bootstrap list)",
    )
    p.add_argument("--identity", required=True, help="key file from `p2p-diloco keygen` (stable peer ID)")
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
        help="run this learner as an island of N local ranks (execs torchrun --standalone; docs/island.md)",
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
        "dies (a supervisor runs both; README: Hot spare)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="be a hot spare: prepare the model, then wait for the line 'go' on stdin to take over "
        "(what --hot-spare and `demo --hot-spares` start)",
    )
    p.set_defaults(func=_lazy("p2p_diloco.node.supervise:cli_join_entry"))

    p = sub.add_parser("status", help="print the swarm of a run: synchronizer, versions, peers")
    p.add_argument("manifest", help="run manifest TOML")
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
    p.set_defaults(func=_lazy("p2p_diloco.node.status:cli_status"))

    p = sub.add_parser("dashboard", help="serve a live web page of a run: eval curve, versions, peers")
    p.add_argument("manifest", help="run manifest TOML")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080; 0: any free port)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--poll", type=float, default=2.0, help="seconds between two reads of the swarm")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for one DHT lookup")
    p.set_defaults(func=_lazy("p2p_diloco.dashboard.command:cli_dashboard"))

    p = sub.add_parser("export", help="write the global model of a peer's state directory as safetensors")
    p.add_argument("manifest", help="the run manifest TOML that peer joined with")
    p.add_argument("--state-dir", required=True, help="the peer's state directory (holds replica/)")
    p.add_argument("--out", required=True, help="output file (model.safetensors), or folder for --format hf")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="hf: a folder transformers' from_pretrained loads (model and tokenizer; [model] kind = 'hf')",
    )
    p.set_defaults(func=_lazy("p2p_diloco.node.export:cli_export"))

    p = sub.add_parser("data", help="prepare token shards (and train a tokenizer) from local text")
    actions = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    a = actions.add_parser(
        "prepare", help="tokenize .txt/.jsonl/.parquet files into shards; prints the digest"
    )
    a.add_argument("inputs", nargs="*", help="input files (.txt/.md whole, .jsonl 'text' field, .parquet)")
    a.add_argument("--builtin", action="store_true", help="also Python's bundled pydoc text (no download)")
    a.add_argument("--tokenizer", default="bytes", help="tokenizers JSON file, or 'bytes' (default)")
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
    p.add_argument("manifest", help="run manifest TOML")
    p.set_defaults(func=_lazy("p2p_diloco.model.external:cli_model_digest"))

    p = sub.add_parser(
        "baseline-worker",
        help="one baseline peer: elastic data parallel on hivemind.Optimizer (--mode dp, the lock-step "
        "baseline) or synchronous DiLoCo on hivemind (--mode diloco)",
    )
    p.add_argument("manifest", help="run manifest TOML (the same one the DiLoCo learners use)")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument("--identity", required=True, help="key file from `p2p-diloco keygen` (stable peer ID)")
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
    p.set_defaults(func=_lazy("p2p_diloco.baseline.command:cli_baseline_worker"))

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"p2p-diloco {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
