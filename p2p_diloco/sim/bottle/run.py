"""A simulated run from a seed to a `Result`: the scenario, the nodes, the faults, the checks.

`simulate(seed, scenario)` builds the world and the nodes (state directories under a temporary folder),
draws the faults from the seed, runs the loop on virtual time with every invariant checked after every
event, closes the fault window (heals, thaws, restarts whatever is down), lets the swarm settle, stops
training and waits for quiet, then checks the end state. The same seed gives the same trace, byte for
byte, in one process or another (`PYTHONHASHSEED` fixed, as `scripts/explore.py` runs it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.model.data import Corpus, load_corpus
from p2p_diloco.model.gpt import build_model, embedding_parameter_names
from p2p_diloco.packaged import packaged_manifest
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.sim.bottle.faults import ALL_KINDS, Fault, Kind, apply, schedule
from p2p_diloco.sim.bottle.invariants import Invariants, Violation
from p2p_diloco.sim.bottle.node import NodeSpec, Phase, Shared, SimNode
from p2p_diloco.sim.bottle.routing import Routing
from p2p_diloco.sim.bottle.world import LinkSpec, World
from p2p_diloco.wire.signing import InMemoryKeys


@dataclass(frozen=True)
class Scenario:
    """What a simulated run does; the faults themselves come from the seed."""

    nodes: int = 5
    shards: int = 1
    fault_window: float = 90.0  # faults happen in [10 s, fault_window]
    faults: int = 7
    kinds: tuple[Kind, ...] = ALL_KINDS
    settle: float = 30.0  # after the window: every node back, still training
    quiet: float = 35.0  # then training stops; deltas and updates must settle within this
    step_time: float = 1.0  # virtual seconds per inner step (each node draws up to 1.5x of it)
    clock_skew: float = 0.2  # each node's clock is off by up to this many seconds either way
    link: LinkSpec = field(default_factory=LinkSpec)

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError(f"a scenario needs at least 2 nodes, got {self.nodes}")
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.fault_window < 10.0:
            raise ValueError(f"fault_window must be >= 10 s (faults start at 10 s), got {self.fault_window}")


@dataclass
class Result:
    seed: int
    scenario: Scenario
    faults: list[Fault]
    violation: Violation | None
    trace_text: str
    trace_digest: str
    virtual_seconds: float
    wall_seconds: float
    versions: tuple[int, ...]
    claims: int
    published: int
    events_digest: str  # every node's events.jsonl, in node order

    @property
    def ok(self) -> bool:
        return self.violation is None


def sim_manifest(
    shards: int = 1, base: RunManifest | None = None, inner_steps: int = 8, fragments: int | None = None
) -> RunManifest:
    """The demo manifest at simulator scale: a smaller model, H = `inner_steps` (8), batch 8, `shards`
    synchronizer shards over `fragments` fragments (default max(4, shards); H >= fragments, so more than 8
    need a larger H)."""
    base = base or RunManifest.load(packaged_manifest("demo"))
    return dataclasses.replace(
        base,
        run_id="bottle",
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
        diloco=dataclasses.replace(
            base.diloco,
            inner_steps=inner_steps,
            batch_size=8,
            fragments=fragments if fragments is not None else max(4, shards),
            synchronizer_shards=shards,
        ),
    )


_CORPORA: dict[str, Corpus] = {}


def _corpus(manifest: RunManifest) -> Corpus:
    """The run's corpus, loaded once per process (every seed trains on the same text)."""
    key = repr(manifest.data)
    if key not in _CORPORA:
        _CORPORA[key] = load_corpus(manifest.data)
    return _CORPORA[key]


def _shared(manifest: RunManifest, seed: int) -> Shared:
    torch.manual_seed(0)  # initial weights: the same for every seed (the run's, not the faults')
    template = build_model(manifest.model)
    shapes = {name: tuple(p.shape) for name, p in template.named_parameters()}
    plan = plan_fragments(list(shapes.items()), manifest.diloco.fragments, manifest.diloco.fragment_pattern)
    return Shared(
        manifest=manifest,
        corpus=_corpus(manifest),
        plan=plan,
        shapes=shapes,
        initial={name: p.detach().clone() for name, p in template.named_parameters()},
        embeddings=frozenset(embedding_parameter_names(template)),
        keys=InMemoryKeys(seed=f"bottle:{seed}"),
    )


def _specs(seed: int, scenario: Scenario) -> list[NodeSpec]:
    rng = World(seed).node_rng("specs", "specs")
    return [
        NodeSpec(
            index=i,
            peer_id=f"node-{i}",
            step_time=round(scenario.step_time * rng.uniform(1.0, 1.5), 3),
            clock_offset=round(rng.uniform(-scenario.clock_skew, scenario.clock_skew), 4),
        )
        for i in range(scenario.nodes)
    ]


class Simulation:
    """One run's world, nodes and checks; `run()` plays it to the end (or to the first violation)."""

    def __init__(
        self,
        seed: int,
        scenario: Scenario,
        root: Path,
        manifest: RunManifest | None = None,
        faults: list[Fault] | None = None,
    ):
        """`faults`: these instead of the seed's draw (a scenario written out by hand)."""
        self.seed, self.scenario = seed, scenario
        self.manifest = manifest or sim_manifest(scenario.shards)
        self.world = World(seed, scenario.link)
        shared = _shared(self.manifest, seed)
        self.nodes: list[SimNode] = []
        self.invariants = Invariants(self.world, self.nodes, self.manifest)
        self.routing = Routing(self.world)
        self.world.network_listeners.append(self.routing.regroup)
        for spec in _specs(seed, scenario):
            self.nodes.append(
                SimNode(self.world, spec, shared, root, self.invariants.on_intent, self.routing)
            )
        window = (10.0, scenario.fault_window)
        drawn = (
            faults
            if faults is not None
            else schedule(seed, scenario.nodes, window, scenario.kinds, scenario.faults)
        )
        self.faults = sorted(drawn, key=lambda f: (f.at, f.kind, f.node))

    def _stopped(self) -> bool:
        self.invariants.check()
        return self.invariants.violation is not None

    def _until(self, t: float) -> bool:
        """Run the loop to virtual time `t`; False once a rule broke."""
        self.world.loop.run_until(t, stop=self._stopped)
        return self.invariants.violation is None

    def run(self) -> None:
        late = {f.node for f in self.faults if f.kind == Kind.NEWCOMER}
        for node in self.nodes:
            self.world.note(
                "sim",
                "node",
                peer=node.peer_id,
                step_time=node.spec.step_time,
                clock_offset=node.spec.clock_offset,
                newcomer=node.spec.index in late,
            )  # noqa: E501
            if node.spec.index not in late:
                self.world.loop.call_at(0.0, node.start)
        for fault in self.faults:
            apply(fault, self.world, self.nodes, self.routing)
        window_end = self.scenario.fault_window
        if not self._until(window_end):
            return
        self._end_faults()
        if not self._until(window_end + self.scenario.settle):
            return
        self.world.note("sim", "stop_training")
        for node in self.nodes:
            node.training = False
        if not self._until(window_end + self.scenario.settle + self.scenario.quiet):
            return
        self.invariants.final()

    def _end_faults(self) -> None:
        """Close the fault window: heal, thaw, fair weather, and every node that is not running starts
        (a stopping one once it exited)."""
        self.world.note("sim", "faults_over")
        self.world.heal()
        self.routing.bring_back_bootstrap()
        for node in self.nodes:
            node.thaw()
            node.dht.extra = node.dht.drop = 0.0
            node.dht.starved_reads = False
            node.starve(0.0)
            if node.phase in (Phase.DOWN, Phase.EXITED):
                node.start()
            elif node.phase == Phase.STOPPING:
                node.after_exit = node.start

    def versions(self) -> tuple[int, ...]:
        running = [n.peer.replica.versions() for n in self.nodes if n.peer is not None and n.up]
        return max(running, key=sum) if running else ()


def simulate(
    seed: int,
    scenario: Scenario | None = None,
    workdir: Path | None = None,
    *,
    manifest: RunManifest | None = None,
    faults: list[Fault] | None = None,
) -> Result:
    """Play seed `seed` of `scenario` (module docstring); state directories under `workdir` (kept) or a
    temporary folder (removed). `manifest` replaces `sim_manifest(scenario.shards)`; `faults` replace the
    seed's draw."""
    scenario = scenario or Scenario()
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"bottle-{seed}-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        sim = Simulation(seed, scenario, root, manifest, faults)
        try:
            sim.run()
            versions = sim.versions()
        finally:
            for node in sim.nodes:
                if node.up:
                    node.kill()
        events = b"".join(
            (root / n.peer_id / "events.jsonl").read_bytes()
            for n in sim.nodes
            if (root / n.peer_id / "events.jsonl").exists()
        )
    trace = sim.world.trace
    return Result(
        seed=seed,
        scenario=scenario,
        faults=sim.faults,
        violation=sim.invariants.violation,
        trace_text=trace.text(),
        trace_digest=trace.digest(),
        virtual_seconds=sim.world.now(),
        wall_seconds=time.perf_counter() - started,
        versions=versions,
        claims=sim.invariants.claims,
        published=sim.invariants.published,
        events_digest=hashlib.blake2b(events, digest_size=16).hexdigest(),
    )
