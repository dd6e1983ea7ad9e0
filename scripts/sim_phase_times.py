#!/usr/bin/env python3
"""Where a simulated peer's CPU time goes, by handler and by part, in plain CPU time (issue #40).

cProfile (`bench_swarm.py --sim-profile M`) names the functions, but its per-call cost inflates code made
of many small Python calls about twofold against code that runs in C (torch, json), so its shares mislead
when comparing sizes. This plays one clean run of `sim.bottle.scale` at M peers and times, with
`time.process_time` and only in the measured window, each `Peer.handle` by event, each learner step, the
event log, and the parts of a read (`Membership.ingest_all`, its heartbeat decoding and per-shard
`ingest`, `Peer.elect`, `Repair.due_repairs`) and of an applied update (decoding, the leader's signature,
the outer step, the bookkeeping, the relay's next hops). The parts nest inside the handlers.

    PYTHONHASHSEED=0 .venv/bin/python scripts/sim_phase_times.py --peers 256 --window 4 --out DIR

writes DIR/phase_times_M.json: per name, CPU ms per virtual s per peer, calls per virtual s per peer and
microseconds per call; and under `rounds` the updates published in the window: per fragment the virtual
times and contributors of each, their mean contributors and the mean gap between a fragment's updates
(how many rounds a swarm of M runs a second, and why: every peer applies every update).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2p_diloco.node.events import PeerEventLog
from p2p_diloco.sim.bottle import scale
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm import relay, spreading, updates
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.swarm.repair import Repair


class PhaseTimer:
    """CPU seconds and calls per name while `on` (the measured window)."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def wrap(self, owner: Any, name: str, key: Callable[[tuple], str] | None = None) -> None:
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            started = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                what = key(args) if key is not None else label
                self.seconds[what] += time.process_time() - started
                self.calls[what] += 1

        setattr(owner, name, timed)


def _event_name(args: tuple) -> str:
    event = args[1]
    kind = getattr(event, "kind", None)
    return f"Peer.handle[{type(event).__name__}{f':{kind}' if kind is not None else ''}]"


def instrument(timer: PhaseTimer) -> None:
    timer.wrap(Peer, "handle", _event_name)
    timer.wrap(Learner, "train_step")
    timer.wrap(PeerEventLog, "__call__", lambda args: f"PeerEventLog[{type(args[1]).__name__}]")
    for name in ("ingest_all", "_decode_heartbeats", "ingest"):
        timer.wrap(Membership, name)
    timer.wrap(Peer, "elect")
    timer.wrap(Repair, "due_repairs")
    for name in ("_step_received", "_note_applied", "signed_by_leader"):
        timer.wrap(updates.UpdateBook, name)
    timer.wrap(spreading.Spreading, "spread")
    timer.wrap(relay.Relay, "onward")
    timer.wrap(updates, "decode_update")  # the update book's reference (a relayed frame decodes in spreading)


class RoundLog:
    """The updates published while the window is on: fragment -> [(virtual time, contributors)]."""

    def __init__(self, timer: PhaseTimer) -> None:
        self.timer = timer
        self.by_fragment: defaultdict[int, list[tuple[float, int]]] = defaultdict(list)

    def watch(self) -> None:
        on_intent = scale.MeasuredSimulation._on_intent

        def logged(sim: scale.MeasuredSimulation, node: Any, intent: fx.Intent) -> None:
            if self.timer.on and isinstance(intent, fx.Published):
                record = intent.record
                self.by_fragment[record.fragment].append(
                    (round(sim.world.now(), 3), len(record.contributors))
                )
            on_intent(sim, node, intent)

        scale.MeasuredSimulation._on_intent = logged  # this process's runs only

    def report(self) -> dict[str, Any]:
        counts = [c for published in self.by_fragment.values() for _, c in published]
        gaps = [b[0] - a[0] for u in self.by_fragment.values() for a, b in zip(u, u[1:], strict=False)]
        return {
            "updates": len(counts),
            "mean_contributors": round(sum(counts) / len(counts), 2) if counts else None,
            "mean_gap_s": round(sum(gaps) / len(gaps), 3) if gaps else None,
            "by_fragment": {str(p): u for p, u in sorted(self.by_fragment.items())},
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, required=True, help="swarm size M (S = M / 16)")
    parser.add_argument("--window", type=float, default=4.0, help="measured virtual s after 10 s of warm-up")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.peers < 2 or args.window <= 0:
        parser.error("--peers needs 2 or more peers and --window a positive number of virtual seconds")
    timer = PhaseTimer()
    instrument(timer)
    rounds = RoundLog(timer)
    rounds.watch()
    mark = scale.MeasuredSimulation._mark

    def timed_mark(sim: scale.MeasuredSimulation, name: str) -> None:
        timer.on = name == "window_start" or (timer.on and name != "window_end")
        mark(sim, name)

    scale.MeasuredSimulation._mark = timed_mark  # this process's runs only
    result = scale.measure_size(
        scale.ScaleRun(peers=args.peers, window=args.window, quiet=1.0, check_every=0.01)
    )
    per = args.window * args.peers
    parts = {
        name: {
            "cpu_ms_per_virtual_s_per_peer": round(seconds / per * 1000, 3),
            "calls_per_virtual_s_per_peer": round(timer.calls[name] / per, 2),
            "us_per_call": round(seconds / timer.calls[name] * 1e6, 1),
        }
        for name, seconds in sorted(timer.seconds.items(), key=lambda item: -item[1])
    }
    report = {
        "peers": args.peers,
        "window": args.window,
        "cpu_seconds_per_virtual_second_per_peer": result.cpu_per_virtual_per_peer,
        "parts": parts,
        "rounds": rounds.report(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"phase_times_{args.peers}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for name, row in parts.items():
        print(
            f"{name:45s} {row['cpu_ms_per_virtual_s_per_peer']:8.3f} ms/vs/peer {row['us_per_call']:9.1f} us/call"
        )
    summary = {k: v for k, v in report["rounds"].items() if k != "by_fragment"}
    print(f"rounds in the window: {summary}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
