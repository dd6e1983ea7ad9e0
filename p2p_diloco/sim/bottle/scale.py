"""Per-peer cost at swarm scale, measured on the real peer code in the swarm in a bottle (issue #40 item 3).

`measure_size(ScaleRun(peers=M))` plays one clean run (no faults) of M whole simulated nodes, each the
real `Peer`, `Learner` and `StateDir` (`sim.bottle.node`), with S = max(1, M // 16) synchronizer shards
(`sim_manifest(S)`: `[diloco] synchronizer_shards = S`) over P = `fragments` = max(16, S) fragments and
H = `inner_steps` = max(16, P) at every size (the manifest rules need H >= P and P >= S), so that every
size trains the same model cut the same way and sends the same messages per step: only M and S change
(`ScaleRun(fragments=0)`: P = max(4, S), the layout of the figures before 2026-11-28's second session, which
made P and so each peer's updates per second grow with M), over the world's link model (`LinkSpec`), on
virtual time:

* `[0, warmup)`: every node starts, catches up (from nobody) and trains (40 virtual s by default: module
  docstring, "Steady state");
* `[warmup, warmup + window)`: the measured window, still training: link bytes (the transport's
  `Traffic`), updates published, DHT records read;
* then training stops and `quiet` virtual seconds let deltas and updates settle; the end state is
  checked as `Invariants.final` does (every replica at the same versions, bit-identical).

Every invariant of `sim.bottle.invariants` is checked after every event, as in `simulate`; its wall time
is measured apart and left out of the per-peer cost (it is the simulator's, not the peer's). What the
result holds (`SizeResult.row()`, one row of `sim_peers.json`):

* `wall_seconds_per_virtual_second_per_peer`: the event loop's wall time less the checks', over the
  measured window's virtual seconds and the peers (training, the peers' owners and I/O, the simulated DHT
  and links); a run stopped before the window ended: over all it played, start-up included;
* `cpu_seconds_per_virtual_second_per_peer`: the same in the process's CPU time, window only (on a shared
  machine the wall time also holds the time other processes took the cores; CPU time does not);
* `detail.cpu_seconds_per_round_per_peer`: the window's CPU time over its rounds and the peers (a larger
  swarm publishes more rounds a second, and every peer applies every update);
* `busiest_peer_bytes_per_round`: the most bytes one peer sent plus received in the window, over the
  window's rounds, a round being one update of every fragment (updates published / fragments);
* `holder_inbound_bytes_per_round`: the most bytes a synchronizer received in the window over the rounds
  it merged there (its updates published / fragments per shard);
* `propagation_p50_s`, `propagation_p99_s`: virtual seconds from an update's `Published` at its
  synchronizer to its `Applied` at each other replica, over every update of the run;
* `terms_held_twice`: shard terms that two peers held at once while each one's DHT view held the
  other's lease (`Invariants.check`'s notion: the (shard, term) pairs it ever timed);
* `replicas_equal`: after the quiet period every running replica has the same versions and digest.

Steady state. Every node starts at once, so for the first outer cycle (H = 16 steps of 1 virtual s) the
learners are still in step and send each fragment's deltas together: a window from 10 to 30 virtual s (the
default before 2026-12-02's session) held 4.6 rounds at 16 peers against 8.8 from 40 to 60 and 8.7 from
130 to 150 (issue #40), and at 256 peers 9.9 against 22.1. The window opens at 40 virtual s, after two
outer cycles, where a size's rounds a second have settled.

Quorum. With K = 1 (the paper's default, the manifest's) a round opens at a fragment's first delta and
closes a grace window later; once learners are out of step a larger swarm's deltas arrive all the time, so
a fragment gets a round every grace window and every peer applies every one: in steady state 256 peers run
2.5x the rounds of 16. `ScaleRun.min_quorum` (`--sim-min-quorum K`; 0: K = S, sized with the swarm as the
shards are) sets K at every size; the row's detail says which K a size ran with. A quorum waits with
no deadline, so with K > 1 a fragment's last round holds open once training stops, and the run ends
with `deltas_settled` broken (256 peers at K = 16, 2026-12-02).

The collector. The cost includes Python's cyclic garbage collector, whose CPU seconds in the window the
row's detail gives apart (`window_gc_cpu_seconds`). Its youngest generation is sized per peer
(`ScaleRun.young_per_peer`, 700 objects, CPython's default for one process: the threshold is 700 x M
while a size plays). A peer in a process of its own collects its young objects every 700 of its own
allocations; with one threshold of 700 for M peers in one process, an object a peer holds for a virtual
round trip (a reply's timer, a frame on its way) lives through M times as many collections, so it is
promoted and scanned again and again in the older generations. At 256 peers that put 16 % of the window's
CPU time in the collector against 6 % at 16 (5.7 of 36 CPU s in a 4-virtual-s window at 256 peers; 2.3 of
32 with 700 per peer). `young_per_peer=0` (`--sim-young-per-peer 0`) keeps the process's own setting.

Plays. A size whose measured window takes less than `MIN_WINDOW_CPU` (30) CPU seconds is played again,
each time in a fresh process, until its windows add up to that, at most `MAX_PLAYS` (8) times: the window
of 16 peers takes about 6 CPU s, in which this shared machine's speed moved its figure by up to 40 %
between runs of the same code (0.0138 to 0.0197 CPU s per virtual s per peer), where 256 peers' window
takes about 190. The same seed plays the same run, so the row's traffic, rounds and propagation are the
first play's; its time and CPU figures pool every play's window (`detail.plays`, and each play's figure
in `detail.cpu_seconds_per_virtual_second_per_peer_by_play`). A size played more than once is played as
many times again once the larger sizes are done, so that its figure pools plays from before and after
them: this machine's speed drifts over minutes (16 peers' pooled figure was 0.0189 in one run of the
command and 0.0125 in the next, the same code), and 256 peers' window takes six of them.
`--sim-min-window-cpu 0` plays once.

A wall budget stops a run early (`completed` false; the cost is then measured over what was played and
the end-state fields are None). `--sim-peers` of `scripts/bench_swarm.py` is the command line.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import math
import multiprocessing
import pstats
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.sim.bottle.node import Phase, SimNode
from p2p_diloco.sim.bottle.run import Scenario, Simulation, sim_manifest
from p2p_diloco.sim.bottle.transport import Traffic, traffic
from p2p_diloco.sim.bottle.world import LinkSpec
from p2p_diloco.swarm import effects as fx

PEERS_PER_SHARD = 16  # S = M / 16 (issue #40)
INNER_STEPS = 16  # H at every size (module docstring)
FRAGMENTS = 16  # P at every size, at least S (module docstring)
MIN_WINDOW_CPU = 30.0  # CPU seconds of measured windows each size's figures pool, at least (docstring)
MAX_PLAYS = 8
YOUNG_PER_PEER = 700  # CPython's default threshold of the youngest generation: what one process has


def shards_for(peers: int) -> int:
    return max(1, peers // PEERS_PER_SHARD)


@dataclass(frozen=True)
class ScaleRun:
    """One size's clean run (module docstring); virtual seconds for the phases."""

    peers: int
    shards: int | None = None  # None: `shards_for(peers)`
    fragments: int | None = None  # None: max(FRAGMENTS, S); 0: max(4, S) (module docstring)
    warmup: float = 40.0  # two outer cycles and more (module docstring, "Steady state")
    window: float = 20.0
    quiet: float = 30.0
    seed: int = 0
    step_time: float = 1.0
    link: LinkSpec = field(default_factory=LinkSpec)
    wall_budget: float | None = None  # wall seconds for the loop; None: no limit
    # virtual seconds between invariant checks; 0: after every event, as `simulate` does (at 256 peers the
    # checks, M nodes x S seats after each of ~M events a virtual ms, cost more wall time than the peers)
    check_every: float = 0.0
    # objects of the collector's youngest generation per simulated peer (module docstring, "The collector");
    # 0: one young generation for the whole process, Python's own setting
    young_per_peer: int = YOUNG_PER_PEER
    # K, the deltas a round waits for (module docstring, "Quorum"): None keeps the manifest's (1, the
    # paper's default); 0 sizes it with the swarm as S is, K = S (one delta per 16 peers)
    min_quorum: int | None = None

    @property
    def s(self) -> int:
        return self.shards if self.shards is not None else shards_for(self.peers)

    @property
    def p(self) -> int:
        if self.fragments is None:
            return max(FRAGMENTS, self.s)
        return max(self.fragments, self.s) if self.fragments else max(4, self.s)

    @property
    def k(self) -> int | None:
        """The quorum this run sets (None: the manifest's)."""
        return self.s if self.min_quorum == 0 else self.min_quorum

    def manifest(self) -> RunManifest:
        manifest = sim_manifest(self.s, inner_steps=max(INNER_STEPS, self.p), fragments=self.p)
        if self.k is None:
            return manifest
        return dataclasses.replace(manifest, diloco=dataclasses.replace(manifest.diloco, min_quorum=self.k))

    def scenario(self) -> Scenario:
        return Scenario(
            nodes=self.peers,
            shards=self.s,
            fault_window=max(self.warmup, 10.0),
            faults=0,
            settle=self.window,
            quiet=self.quiet,
            step_time=self.step_time,
            link=self.link,
        )


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100.0 * len(ordered)) - 1)
    return ordered[rank]


def _minus(after: Counter, before: Counter) -> Counter:
    return Counter({k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)})


class MeasuredSimulation(Simulation):
    """A clean `Simulation` with the measurements of the module docstring taken along the way."""

    def __init__(self, run: ScaleRun, root: Path, profiler: cProfile.Profile | None = None):
        super().__init__(run.seed, run.scenario(), root, run.manifest(), faults=[])
        self.spec = run
        self.profiler = profiler  # on for the measured window only (`run`)
        self.gc_cpu = 0.0  # CPU seconds the cyclic collector took while `in_window`
        self._gc_started: float | None = None
        self.deadline = math.inf
        self.out_of_time = False
        self.check_wall = 0.0
        self.loop_wall = 0.0
        self.check_cpu = 0.0  # the same in this process's CPU time (what other processes on the machine
        self.loop_cpu = 0.0  # take of the cores does not count in it)
        self.held_twice: set[tuple[int, int]] = set()
        self.claimers: dict[tuple[int, int], set[str]] = {}
        self.published_at: dict[tuple[int, int, int, str], float] = {}
        self.delays: list[float] = []
        self.in_window = False
        self.window_published: Counter = Counter()  # synchronizer -> updates published in the window
        self.dht_reads: Counter = Counter()  # reader -> records its DHT reads returned
        self.marks: dict[str, Any] = {}
        self.checking = False
        self.checked_at = -math.inf
        for node in self.nodes:
            node.on_intent = self._on_intent
        store = self.world.dht
        get_for = store.get_for

        def counted_get(reader: str, key: str, now: float) -> dict:
            found = get_for(reader, key, now)
            if not self.checking:  # the invariants' own reads are not the peer's
                self.dht_reads[reader] += len(found)
            return found

        store.get_for = counted_get  # the simulated DHT's reads, counted (instance attribute, this run only)

    # ---- measurements --------------------------------------------------------------------------------

    def _on_intent(self, node: SimNode, intent: fx.Intent) -> None:
        self.invariants.on_intent(node, intent)
        now = self.world.now()
        match intent:
            case fx.Claimed():
                self.claimers.setdefault((intent.shard, intent.term), set()).add(node.peer_id)
            case fx.Published():
                r = intent.record
                self.published_at.setdefault((r.fragment, r.from_version, r.term, r.leader), now)
                if self.in_window:
                    self.window_published[node.peer_id] += 1
            case fx.Applied():
                r = intent.record
                at = self.published_at.get((r.fragment, r.from_version, r.term, r.leader))
                if at is not None and intent.how != "own" and node.peer_id != r.leader:
                    self.delays.append(now - at)

    def _stopped(self) -> bool:
        if self.world.now() - self.checked_at < self.spec.check_every:
            return self.out_of_time
        self.checked_at = self.world.now()
        started, started_cpu = time.perf_counter(), time.process_time()
        self.checking = True
        stop = super()._stopped()
        self.checking = False
        self.held_twice.update(self.invariants.shared_terms)
        ended = time.perf_counter()
        self.check_wall += ended - started
        self.check_cpu += time.process_time() - started_cpu
        if ended > self.deadline:
            self.out_of_time = True
        return stop or self.out_of_time

    def _until(self, t: float) -> bool:
        started, started_cpu = time.perf_counter(), time.process_time()
        ok = super()._until(t)
        self.loop_wall += time.perf_counter() - started
        self.loop_cpu += time.process_time() - started_cpu
        return ok and not self.out_of_time

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """`gc.callbacks`: the collector's CPU time while `in_window` (`window_gc_seconds`)."""
        if phase == "start":
            self._gc_started = time.process_time() if self.in_window and not self.checking else None
        elif self._gc_started is not None:
            self.gc_cpu += time.process_time() - self._gc_started
            self._gc_started = None

    def _mark(self, name: str) -> None:
        self.marks[name] = {
            "t": self.world.now(),
            "traffic": traffic(self.world).snapshot(),
            "dht_reads": Counter(self.dht_reads),
            "loop_wall": self.loop_wall,
            "check_wall": self.check_wall,
            "loop_cpu": self.loop_cpu,
            "check_cpu": self.check_cpu,
            "gc_cpu": self.gc_cpu,
        }

    # ---- the run -------------------------------------------------------------------------------------

    def run(self) -> None:
        """Start everyone, warm up, measure the window, stop training, settle, check the end state."""
        spec = self.spec
        if spec.wall_budget is not None:
            self.deadline = time.perf_counter() + spec.wall_budget
        for node in self.nodes:
            self.world.note("sim", "node", peer=node.peer_id, step_time=node.spec.step_time)
            self.world.loop.call_at(0.0, node.start)
        warmup_end = self.scenario.fault_window
        window_end = warmup_end + spec.window
        if not self._until(warmup_end):
            return
        gc.callbacks.append(self._on_gc)
        self._mark("window_start")
        self.in_window = True
        if self.profiler is not None:
            self.profiler.enable()
        try:
            if not self._until(window_end):
                return
        finally:
            if self.profiler is not None:
                self.profiler.disable()
            self.in_window = False
            gc.callbacks.remove(self._on_gc)
        self._mark("window_end")
        self.world.note("sim", "stop_training")
        for node in self.nodes:
            node.training = False
        if not self._until(window_end + spec.quiet):
            return
        self.invariants.final()
        self._mark("end")


@dataclass
class SizeResult:
    peers: int
    shards: int
    fragments: int
    completed: bool
    violation: str | None
    virtual_seconds: float
    wall_seconds: float  # the loop, checks included
    check_wall_seconds: float
    window_seconds: float | None  # the measured window's virtual seconds, if it ended
    window_wall_seconds: float | None  # the loop's wall time in the window, checks excluded
    window_cpu_seconds: float | None  # the same in this process's CPU time
    window_gc_seconds: float | None  # of which the cyclic garbage collector's
    build_wall_seconds: float
    window_rounds: float | None
    busiest_peer: str | None
    busiest_peer_bytes_per_round: float | None
    busiest_peer_kinds: dict[str, int]
    holder: str | None
    holder_inbound_bytes_per_round: float | None
    holder_inbound_delta_bytes_per_round: float | None
    propagation: list[float]
    terms_held_twice: int
    terms_claimed_twice: int
    replicas_equal: bool | None
    versions: list[int]
    dht_records_read_per_peer_per_second: float | None
    run: dict[str, Any]
    # plays pooled into the window fields (`pool_plays`); each one's CPU s per virtual s per peer
    plays: int = 1
    cpu_by_play: list[float] = field(default_factory=list)
    min_quorum: int = 1  # K the size ran with

    @property
    def wall_per_virtual_per_peer(self) -> float:
        if self.window_seconds:
            return self.window_wall_seconds / self.window_seconds / self.peers
        played = max(self.virtual_seconds, 1e-9)
        return (self.wall_seconds - self.check_wall_seconds) / played / self.peers

    @property
    def cpu_per_virtual_per_peer(self) -> float | None:
        """As `wall_per_virtual_per_peer`, in the process's CPU time (the window only): on a shared machine
        the wall time also holds what other processes took of the cores."""
        if not self.window_seconds or self.window_cpu_seconds is None:
            return None
        return self.window_cpu_seconds / self.window_seconds / self.peers

    @property
    def cpu_per_round_per_peer(self) -> float | None:
        """The window's CPU time over its rounds and the peers: a peer's cost per unit of the run's progress
        (a larger swarm publishes more rounds a second, and every peer applies every update)."""
        if not self.window_rounds or self.window_cpu_seconds is None:
            return None
        return self.window_cpu_seconds / self.window_rounds / self.peers

    @property
    def rounds_per_play(self) -> float | None:
        return self.window_rounds / self.plays if self.window_rounds is not None else None

    def row(self) -> dict[str, Any]:
        """One size's entry of `sim_peers.json` (module docstring)."""
        return {
            "peers": self.peers,
            "shards": self.shards,
            "fragments": self.fragments,
            "completed": self.completed,
            "violation": self.violation,
            "wall_seconds_per_virtual_second_per_peer": _round(self.wall_per_virtual_per_peer, 5),
            "cpu_seconds_per_virtual_second_per_peer": _round(self.cpu_per_virtual_per_peer, 5),
            "busiest_peer_bytes_per_round": _round(self.busiest_peer_bytes_per_round, 0),
            "holder_inbound_bytes_per_round": _round(self.holder_inbound_bytes_per_round, 0),
            "propagation_p50_s": _round(_percentile(self.propagation, 50), 3),
            "propagation_p99_s": _round(_percentile(self.propagation, 99), 3),
            "terms_held_twice": self.terms_held_twice,
            "replicas_equal": self.replicas_equal,
            "detail": {
                "virtual_seconds": round(self.virtual_seconds, 3),
                "loop_wall_seconds": round(self.wall_seconds, 2),
                "invariant_check_wall_seconds": round(self.check_wall_seconds, 2),
                "plays": self.plays,
                "min_quorum": self.min_quorum,
                "cpu_seconds_per_virtual_second_per_peer_by_play": [round(c, 5) for c in self.cpu_by_play],
                "window_wall_seconds": _round(self.window_wall_seconds, 2),
                "window_cpu_seconds": _round(self.window_cpu_seconds, 2),
                "window_gc_cpu_seconds": _round(self.window_gc_seconds, 2),
                "whole_run_wall_seconds_per_virtual_second_per_peer": round(
                    (self.wall_seconds - self.check_wall_seconds)
                    / max(self.virtual_seconds, 1e-9)
                    / self.peers,
                    5,
                ),
                "build_wall_seconds": round(self.build_wall_seconds, 2),
                "window_rounds": _round(self.rounds_per_play, 2),
                "cpu_seconds_per_round_per_peer": _round(self.cpu_per_round_per_peer, 5),
                "busiest_peer": self.busiest_peer,
                "busiest_peer_bytes_by_kind": self.busiest_peer_kinds,
                "holder": self.holder,
                "holder_inbound_delta_bytes_per_round": _round(self.holder_inbound_delta_bytes_per_round, 0),
                "propagation_samples": len(self.propagation),
                "terms_claimed_twice": self.terms_claimed_twice,
                "versions": self.versions,
                "dht_records_read_per_peer_per_second": _round(self.dht_records_read_per_peer_per_second, 1),
                "run": self.run,
            },
        }


def _round(value: float | None, digits: int) -> float | None:
    if value is None:
        return None
    return round(value, digits) if digits else float(round(value))


def _window_figures(sim: MeasuredSimulation) -> dict[str, Any]:
    """Bytes per round of the busiest peer and of the busiest synchronizer, over the measured window."""
    start, end = sim.marks.get("window_start"), sim.marks.get("window_end")
    fragments = sim.manifest.diloco.fragments
    none = {
        "window_rounds": None,
        "busiest_peer": None,
        "busiest_peer_bytes_per_round": None,
        "busiest_peer_kinds": {},
        "holder": None,
        "holder_inbound_bytes_per_round": None,
        "holder_inbound_delta_bytes_per_round": None,
        "dht_records_read_per_peer_per_second": None,
    }
    if start is None or end is None:
        return none
    a: Traffic = start["traffic"]
    b: Traffic = end["traffic"]
    sent, received = _minus(b.sent, a.sent), _minus(b.received, a.received)
    kinds = _minus(b.sent_kind, a.sent_kind) + _minus(b.received_kind, a.received_kind)
    received_kind = _minus(b.received_kind, a.received_kind)
    seconds = end["t"] - start["t"]
    reads = _minus(end["dht_reads"], start["dht_reads"])
    out = dict(none)
    out["dht_records_read_per_peer_per_second"] = sum(reads.values()) / sim.scenario.nodes / seconds
    rounds = sum(sim.window_published.values()) / fragments
    out["window_rounds"] = rounds
    if rounds <= 0:
        return out
    total = sent + received
    busiest = max(sorted(total), key=lambda p: total[p]) if total else None
    if busiest is not None:
        out["busiest_peer"] = busiest
        out["busiest_peer_bytes_per_round"] = total[busiest] / rounds
        out["busiest_peer_kinds"] = {k: v for (p, k), v in sorted(kinds.items()) if p == busiest}
    per_shard = fragments / sim.manifest.diloco.synchronizer_shards
    holders = {p: n / per_shard for p, n in sim.window_published.items() if n}
    if holders:
        holder = max(sorted(holders), key=lambda p: received[p] / holders[p])
        out["holder"] = holder
        out["holder_inbound_bytes_per_round"] = received[holder] / holders[holder]
        deltas = received_kind.get((holder, "delta"), 0) + received_kind.get((holder, "relay"), 0)
        out["holder_inbound_delta_bytes_per_round"] = deltas / holders[holder]
    return out


def measure_size(
    run: ScaleRun, workdir: Path | None = None, profile: Path | None = None, trace: Path | None = None
) -> SizeResult:
    """Play `run` (module docstring); with `profile`, the measured window runs under cProfile (warm-up and
    settling left out) and the top functions by cumulative and by own time are written there; with
    `trace`, a run that broke a rule writes its trace there."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix=f"scale-{run.peers}-") as tmp, _young_generation(run):
        root = Path(workdir) if workdir is not None else Path(tmp)
        built = time.perf_counter()
        profiler = cProfile.Profile() if profile is not None else None
        sim = MeasuredSimulation(run, root, profiler)
        build_wall = time.perf_counter() - built
        try:
            sim.run()
        finally:
            running = [n for n in sim.nodes if n.phase == Phase.RUNNING and n.peer is not None]
            versions = {tuple(n.peer.replica.versions()) for n in running}
            digests = {n.peer.replica.digest() for n in running}
            for node in sim.nodes:
                if node.up:
                    node.kill()
    if profiler is not None:
        _write_profile(profiler, profile, run, sim)
    completed = not sim.out_of_time and "end" in sim.marks
    window = _window_figures(sim)
    window_seconds, window_wall, window_cpu, window_gc = _window_costs(sim)
    violation = sim.invariants.violation
    if trace is not None and violation is not None:
        trace.write_text(sim.world.trace.text())
    return SizeResult(
        peers=run.peers,
        shards=run.s,
        fragments=sim.manifest.diloco.fragments,
        completed=completed,
        violation=str(violation) if violation is not None else None,
        virtual_seconds=sim.world.now(),
        wall_seconds=sim.loop_wall,
        check_wall_seconds=sim.check_wall,
        window_seconds=window_seconds,
        window_wall_seconds=window_wall,
        window_cpu_seconds=window_cpu,
        window_gc_seconds=window_gc,
        build_wall_seconds=build_wall,
        propagation=sim.delays,
        terms_held_twice=len(sim.held_twice),
        terms_claimed_twice=sum(1 for who in sim.claimers.values() if len(who) > 1),
        replicas_equal=(len(running) == run.peers and len(versions) == 1 and len(digests) == 1)
        if completed
        else None,
        versions=list(max(versions, key=sum)) if versions else [],
        run={**asdict(run), "link": asdict(run.link)},
        min_quorum=sim.manifest.diloco.min_quorum,
        **window,
    )


@contextlib.contextmanager
def _young_generation(run: ScaleRun) -> Iterator[None]:
    """The collector's youngest generation sized `run.young_per_peer` objects per peer while `run` plays
    (module docstring, "The collector"); the process's own thresholds after."""
    before = gc.get_threshold()
    if run.young_per_peer > 0:
        gc.set_threshold(run.young_per_peer * run.peers, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _window_costs(
    sim: MeasuredSimulation,
) -> tuple[float | None, float | None, float | None, float | None]:
    """(virtual seconds, wall seconds, CPU seconds, of which the collector's) of the measured window, the
    checks' excluded; Nones if the window did not end."""
    start, end = sim.marks.get("window_start"), sim.marks.get("window_end")
    if start is None or end is None:
        return None, None, None, None
    wall = (end["loop_wall"] - start["loop_wall"]) - (end["check_wall"] - start["check_wall"])
    cpu = (end["loop_cpu"] - start["loop_cpu"]) - (end["check_cpu"] - start["check_cpu"])
    return end["t"] - start["t"], wall, cpu, end["gc_cpu"] - start["gc_cpu"]


def _write_profile(profiler: cProfile.Profile, path: Path, run: ScaleRun, sim: MeasuredSimulation) -> None:
    text = io.StringIO()
    text.write(
        f"cProfile of the {run.peers}-peer clean run's measured window (S = {run.s}, P = {run.p}), "
        f"{run.window:.1f} of {sim.world.now():.1f} virtual s; the whole loop {sim.loop_wall:.1f} s wall "
        f"(invariant checks {sim.check_wall:.1f} s)\n\n"
    )
    for order in ("cumulative", "tottime"):
        text.write(f"==== top 15 by {order} ====\n")
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats(order).print_stats(15)
    # below the driver's layers: the peer's own rules (swarm, protocol, wire) and the simulator's parts
    text.write("==== top 30 by cumulative, the project's functions below the drivers ====\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(
        r"p2p_diloco/(swarm/(?!driver|tasks)|protocol|wire|model|node)", 30
    )
    text.write("==== the simulator's own parts (invariants, DHT replicas, links) ====\n")
    stats.print_stats(r"invariants.py.*\(check\)|memory.py.*(store_from|get_for)|transport.py.*_deliver", 10)
    profiler.dump_stats(str(path.with_suffix(".prof")))
    path.write_text(text.getvalue())


# ---- the figures over sizes ---------------------------------------------------------------------------


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue #40's done-means: the largest size's cost and busiest-peer bytes each <= 2x the smallest's."""
    done = [r for r in rows if r.get("completed")]
    measured = [r for r in rows if r.get("wall_seconds_per_virtual_second_per_peer") is not None]
    out: dict[str, Any] = {}
    for key, pool in (
        ("wall_seconds_per_virtual_second_per_peer", measured),
        ("cpu_seconds_per_virtual_second_per_peer", measured),
        ("busiest_peer_bytes_per_round", done),
    ):
        have = [r for r in pool if r.get(key)]
        if len(have) < 2:
            continue
        small, large = min(have, key=lambda r: r["peers"]), max(have, key=lambda r: r["peers"])
        ratio = large[key] / small[key]
        out[key] = {
            "from_peers": small["peers"],
            "to_peers": large["peers"],
            "ratio": round(ratio, 2),
            "target": 2.0,
            "met": ratio <= 2.0,
        }
    return out


def _mark_cost_target(ax: Any, rows: list[dict[str, Any]], peers: list[int]) -> None:
    """The #40 target line (2x the smallest size's cost) and a note on sizes stopped at the wall budget."""
    if rows and rows[0].get("wall_seconds_per_virtual_second_per_peer"):
        base = rows[0]["wall_seconds_per_virtual_second_per_peer"]
        ax.plot(peers, [2 * base] * len(peers), "k--", lw=0.8, label="2x smallest (#40 target)")
    for r in rows:
        if not r.get("completed") and r.get("wall_seconds_per_virtual_second_per_peer"):
            played = r.get("detail", {}).get("virtual_seconds", 0.0)
            ax.annotate(
                f"stopped at the wall budget:\nfirst {played:.0f} virtual s only",
                (r["peers"], r["wall_seconds_per_virtual_second_per_peer"]),
                textcoords="offset points",
                xytext=(-150, -25),
                fontsize=8,
            )


def _style(ax: Any, title: str, *, log_y: bool) -> None:
    """One panel's title and axes: peers on a log2 axis."""
    ax.set_title(title)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("peers M (S = M / 16)")
    ax.legend(fontsize=8)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = [r["peers"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))

    def series(ax: Any, key: str, label: str, scale: float = 1.0, marker: str = "o") -> None:
        xs = [p for p, r in zip(peers, rows) if r.get(key) is not None]
        ys = [r[key] / scale for r in rows if r.get(key) is not None]
        if xs:
            ax.plot(xs, ys, marker=marker, label=label)

    cost, traffic, spread = axes
    series(cost, "wall_seconds_per_virtual_second_per_peer", "measured")
    _mark_cost_target(cost, rows, peers)
    _style(cost, "wall s per virtual s per peer", log_y=True)
    series(traffic, "busiest_peer_bytes_per_round", "busiest peer (sent + received)", 1e3)
    series(traffic, "holder_inbound_bytes_per_round", "synchronizer inbound", 1e3, "s")
    _style(traffic, "kB per round (one update of every fragment)", log_y=True)
    series(spread, "propagation_p50_s", "p50")
    series(spread, "propagation_p99_s", "p99", marker="s")
    _style(spread, "publish -> applied at each replica (virtual s)", log_y=False)
    notes = ", ".join(
        f"M={r['peers']}: twice={r['terms_held_twice']} equal={r['replicas_equal']}"
        + ("" if r.get("completed") else " (stopped at the wall budget)")
        for r in rows
    )
    fig.suptitle(f"Swarm in a bottle, clean runs, real Peer code. {notes}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _measured_apart(run: ScaleRun, profile: Path | None, trace: Path) -> SizeResult:
    """`measure_size` in a fresh process: what one size leaves in a process (its heap, module caches) would
    weigh on the next size's figures (one run of 16, 64 and 256 in one process measured 64 peers 27 %
    dearer than a process of its own, a third of it in the collector, which scans the whole heap)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_size, run, None, profile, trace).result()


def _played_enough(run: ScaleRun, profile: Path | None, trace: Path, min_cpu: float) -> list[SizeResult]:
    """`run` played (each time in a fresh process) until its measured windows add up to `min_cpu` CPU
    seconds, at most `MAX_PLAYS` times (module docstring, "Plays")."""
    plays = [_measured_apart(run, profile, trace)]
    while (
        plays[-1].completed
        and plays[-1].window_cpu_seconds is not None
        and sum(p.window_cpu_seconds or 0.0 for p in plays) < min_cpu
        and len(plays) < MAX_PLAYS
    ):
        plays.append(_measured_apart(run, None, trace))
    return plays


def pool_plays(plays: list[SizeResult]) -> SizeResult:
    """The first play, its window's time, CPU, collector time and rounds summed over every play (the same
    seed replays the same run: the traffic, rounds and propagation are the first play's)."""
    first = plays[0]
    cpu_by_play = [p.cpu_per_virtual_per_peer for p in plays if p.cpu_per_virtual_per_peer is not None]
    if len(plays) == 1 or first.window_seconds is None:
        return dataclasses.replace(first, cpu_by_play=cpu_by_play)

    def total(name: str) -> float:
        return sum(getattr(p, name) or 0.0 for p in plays)

    return dataclasses.replace(
        first,
        window_seconds=total("window_seconds"),
        window_wall_seconds=total("window_wall_seconds"),
        window_cpu_seconds=total("window_cpu_seconds"),
        window_gc_seconds=total("window_gc_seconds"),
        window_rounds=total("window_rounds"),
        plays=len(plays),
        cpu_by_play=cpu_by_play,
    )


def sim_peers_main(
    sizes: Sequence[int],
    out: Path,
    *,
    warmup: float = 40.0,
    window: float = 20.0,
    quiet: float = 30.0,
    seed: int = 0,
    wall_budget: float | None = None,
    check_every: float = 0.0,
    profile_at: int | None = None,
    link: LinkSpec | None = None,
    fragments: int | None = None,
    young_per_peer: int | None = None,
    min_window_cpu: float = MIN_WINDOW_CPU,
    min_quorum: int | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every size in `sizes`, write OUT/sim_peers.json and OUT/sim_peers.png; the report."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sim_peers.json"
    kept = json.loads(path.read_text())["sizes"] if path.exists() else []
    rows: list[dict[str, Any]] = [r for r in kept if r["peers"] not in sizes]  # other sizes' earlier runs
    report = {"sizes": rows, "figures": ratios(rows)}
    young = YOUNG_PER_PEER if young_per_peer is None else young_per_peer
    fields = dict(warmup=warmup, window=window, quiet=quiet, seed=seed, link=link or LinkSpec())
    fields.update(wall_budget=wall_budget, check_every=check_every, fragments=fragments, young_per_peer=young)
    runs = {peers: ScaleRun(peers=peers, min_quorum=min_quorum, **fields) for peers in sizes}
    plays: dict[int, list[SizeResult]] = {}

    def record(peers: int) -> None:
        nonlocal rows, report
        row = pool_plays(plays[peers]).row()
        rows = sorted([*(r for r in rows if r["peers"] != peers), row], key=lambda r: r["peers"])
        say(json.dumps({k: v for k, v in row.items() if k != "detail"}))
        report = {"sizes": rows, "figures": ratios(rows)}
        path.write_text(json.dumps(report, indent=2) + "\n")

    for peers, run in runs.items():
        say(f"M={peers} S={run.s} P={run.p}: {run.warmup + run.window + run.quiet:.0f} virtual s ...")
        profile = out / f"profile_{peers}.txt" if profile_at == peers else None
        plays[peers] = _played_enough(run, profile, out / f"trace_{peers}.txt", min_window_cpu)
        record(peers)
    for peers, run in runs.items():  # replayed sizes again after the others: plays from either side of them
        if len(plays[peers]) > 1 and peers != max(sizes):
            say(f"M={peers}: {len(plays[peers])} more plays, after the larger sizes ...")
            plays[peers] += [_measured_apart(run, None, out / f"trace_{peers}.txt") for _ in plays[peers]]
            record(peers)
    plot(rows, out / "sim_peers.png")
    return report
