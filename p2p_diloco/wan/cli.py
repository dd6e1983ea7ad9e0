"""Command line of the WAN emulator (``scripts/wan_emulator.py``): start, shape, exec, measure, list, cleanup.

Peers are given as ``NAME[:DELAY_MS[:RATE_MBIT]][:nat]``: DELAY_MS is the one-way delay of the peer's
access link in each direction (RTT between two peers = 2 x the sum of their delays), RATE_MBIT its rate
each way (empty or omitted: unlimited), ``nat`` puts the peer behind a MASQUERADE gateway.

    wan_emulator.py start a:25:20 b:25:20 n:25:20:nat          # runs until Ctrl-C / SIGTERM, then tears down
    wan_emulator.py start --detach a:25 b:25                    # prints the prefix and leaves it running
    wan_emulator.py exec --prefix pdw1a2b3c a -- python -m ...  # run a command in peer a's namespace
    wan_emulator.py shape --prefix pdw1a2b3c a --delay-ms 50 --rate-mbit none
    wan_emulator.py measure --prefix pdw1a2b3c a b              # RTT and TCP throughput a -> b
    wan_emulator.py cleanup --prefix pdw1a2b3c                  # or --stale, or --prefix pdw for all runs
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence

from p2p_diloco.wan.emulator import (
    FAMILY,
    REGISTRY_DIR,
    EmulatorError,
    LinkSpec,
    PeerSpec,
    WanEmulator,
    cleanup,
    cleanup_stale,
    environment_problem,
    pid_alive,
)
from p2p_diloco.wan.probe import measure_rtt, measure_throughput


def parse_peer(text: str) -> PeerSpec:
    """``NAME[:DELAY_MS[:RATE_MBIT]][:nat]`` -> `PeerSpec`; `ValueError` naming the bad part."""
    parts = text.split(":")
    nat = parts[-1] == "nat"
    if nat:
        parts = parts[:-1]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"peer {text!r}: expected NAME[:DELAY_MS[:RATE_MBIT]][:nat]")
    name, delay, rate = (parts + ["", ""])[:3]
    try:
        link = LinkSpec(delay_ms=float(delay) if delay else 0.0, rate_mbit=float(rate) if rate else None)
    except ValueError as exc:
        raise ValueError(f"peer {text!r}: {exc}") from exc
    return PeerSpec(name=name, link=link, nat=nat)


def _cmd_start(args: argparse.Namespace) -> int:
    wan = WanEmulator([parse_peer(p) for p in args.peers], prefix=args.prefix, mtu=args.mtu)
    wan.start()
    print(json.dumps(wan.describe(), indent=1), flush=True)
    if args.detach:
        wan.detach()
        print(f"detached; remove with: {sys.argv[0]} cleanup --prefix {wan.prefix}", file=sys.stderr)
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"running {wan.prefix}; Ctrl-C or SIGTERM tears it down", file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        if wan.forwarder is not None and wan.forwarder.poll() is not None:
            print("forwarder exited; tearing down", file=sys.stderr)
            break
    wan.teardown()
    return 0


def _cmd_shape(args: argparse.Namespace) -> int:
    wan = WanEmulator.attach(args.prefix)
    rate: float | None | str = "keep"
    if args.rate_mbit is not None:
        rate = None if args.rate_mbit == "none" else float(args.rate_mbit)
    wan.shape(args.peer, delay_ms=args.delay_ms, rate_mbit=rate)
    print(json.dumps(wan.describe_peer(args.peer)))
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ValueError("exec: give a command after --")
    wan = WanEmulator.attach(args.prefix)
    command = wan.command(args.peer, argv)
    os.execvp(command[0], command)
    return 127  # not reached


def _cmd_measure(args: argparse.Namespace) -> int:
    wan = WanEmulator.attach(args.prefix)
    rtt = measure_rtt(wan, args.src, args.dst, count=args.count)
    throughput = measure_throughput(wan, args.src, args.dst, seconds=args.seconds)
    print(json.dumps({"rtt": rtt.summary(), "throughput": throughput.__dict__}, indent=1))
    return 0


def _cmd_list(_args: argparse.Namespace) -> int:
    for file in sorted(REGISTRY_DIR.glob(f"{FAMILY}*.json")) if REGISTRY_DIR.is_dir() else []:
        if file.name.endswith(".forwarder.json"):
            continue
        record = json.loads(file.read_text())
        alive = "alive" if pid_alive(record["owner_pid"]) else "owner gone"
        names = ", ".join(p["name"] for p in record["peers"])
        print(f"{record['prefix']}  owner {record['owner_pid']} ({alive})  peers: {names}")
    return 0


def _cmd_cleanup(args: argparse.Namespace) -> int:
    removed = cleanup_stale() if args.stale else cleanup(args.prefix)
    print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wan_emulator.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("start", help="create the namespaces and links")
    p.add_argument("peers", nargs="+", metavar="NAME[:DELAY_MS[:RATE_MBIT]][:nat]")
    p.add_argument("--prefix", help=f"name prefix (default: {FAMILY} + random hex)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--detach", action="store_true", help="leave it running and exit")
    p.set_defaults(func=_cmd_start)
    p = sub.add_parser("shape", help="change a peer's link delay and/or rate")
    p.add_argument("--prefix", required=True)
    p.add_argument("peer")
    p.add_argument("--delay-ms", type=float)
    p.add_argument("--rate-mbit", help="Mbit/s, or 'none' for unlimited")
    p.set_defaults(func=_cmd_shape)
    p = sub.add_parser("exec", help="run a command in a peer's namespace")
    p.add_argument("--prefix", required=True)
    p.add_argument("peer")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_exec)
    p = sub.add_parser("measure", help="UDP RTT and TCP throughput from SRC to DST")
    p.add_argument("--prefix", required=True)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--seconds", type=float, default=5.0)
    p.set_defaults(func=_cmd_measure)
    p = sub.add_parser("list", help="runs in the registry")
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("cleanup", help="kill processes in and delete a run's namespaces")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prefix", help=f"a run's prefix, or {FAMILY} for every run")
    group.add_argument("--stale", action="store_true", help="runs whose owner process is gone")
    p.set_defaults(func=_cmd_cleanup)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd != "list" and (problem := environment_problem()):
        print(f"wan_emulator: {problem}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (EmulatorError, ValueError, KeyError) as exc:
        print(f"wan_emulator: {exc}", file=sys.stderr)
        return 2
