"""The faults of a simulated run, drawn from its seed: what happens to which node, when, for how long.

`schedule(seed, ...)` draws a list of `Fault`s; `apply` turns one into its start and end on the world's
loop. Every kind ends by itself (a killed node restarts, a frozen one thaws, a partition heals), and the
run heals whatever is left when its fault window closes, so a run always ends with every node back.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.sim.bottle.node import Phase, SimNode
from p2p_diloco.sim.bottle.routing import BOOTSTRAP, Routing
from p2p_diloco.sim.bottle.world import World


class Kind(StrEnum):
    KILL = "kill"  # SIGKILL, restart from the state directory after `length` s
    # SIGTERM (at any point: while claiming, holding or stepping down), restart `length` s after the exit
    TERM = "term"
    FREEZE = "freeze"  # SIGSTOP for `length` s, then SIGCONT: a frozen node's timers fire late
    DHT_SLOW = "dht_slow"  # the node's DHT calls take `amount` s more for `length` s
    DHT_DROP = "dht_drop"  # the node's DHT calls are lost (time out) with probability `amount`
    STARVED_READS = "starved_reads"  # the node's DHT reads return only its own records for `length` s
    STARVE = "starve"  # the node's owner thread wakes up to `amount` s late (a peer starved of CPU)
    PARTITION = "partition"  # the nodes split in two groups (links and DHT) for `length` s, then heal
    NEWCOMER = "newcomer"  # the node first starts at `at` (not at 0)
    BOOTSTRAP = "bootstrap"  # the bootstrap node restarts for `length` s; `amount` 1: it lost its memory


ALL_KINDS: tuple[Kind, ...] = tuple(Kind)


@dataclass(frozen=True)
class Fault:
    kind: Kind
    at: float
    node: int  # the node's index (PARTITION: unused)
    length: float = 0.0
    amount: float = 0.0
    group: tuple[int, ...] = ()  # PARTITION: the nodes on one side

    def describe(self) -> str:
        extra = f" x{self.amount:.2f}" if self.amount else ""
        side = f" {list(self.group)}" if self.group else (f" node {self.node}" if self.node >= 0 else "")
        return f"{self.kind}{side} at {self.at:.1f} s for {self.length:.1f} s{extra}"


def schedule(
    seed: int, nodes: int, window: tuple[float, float], kinds: Sequence[Kind], count: int
) -> list[Fault]:
    """`count` faults of `kinds` at times in `window`, on random nodes, sorted by time. At most a third of
    the nodes (at least one) are newcomers."""
    rng = random.Random(f"faults:{seed}")
    start, end = window
    faults: list[Fault] = []
    newcomers = set()
    for _ in range(count):
        kind = rng.choice(list(kinds))
        node = rng.randrange(nodes)
        at = round(rng.uniform(start, end), 3)
        if kind == Kind.NEWCOMER:
            if len(newcomers) >= max(1, nodes // 3) or node in newcomers:
                continue
            newcomers.add(node)
            faults.append(Fault(kind, round(rng.uniform(start, end / 2), 3), node))
        elif kind == Kind.PARTITION:
            group = tuple(sorted(rng.sample(range(nodes), rng.randint(1, nodes // 2))))
            faults.append(Fault(kind, at, -1, round(rng.uniform(4.0, 30.0), 3), group=group))
        else:
            faults.append(_draw(rng, kind, node, at))
    return sorted(faults, key=lambda f: (f.at, f.kind, f.node))


def _draw(rng: random.Random, kind: Kind, node: int, at: float) -> Fault:
    match kind:
        case Kind.KILL:  # below and above `rejoin_grace` (60 s): replay and snapshot restarts
            return Fault(
                kind, at, node, round(rng.choice([rng.uniform(0.5, 15.0), rng.uniform(15.0, 80.0)]), 3)
            )
        case Kind.TERM:
            return Fault(kind, at, node, round(rng.uniform(0.5, 30.0), 3))
        case Kind.STARVED_READS:
            return Fault(kind, at, node, round(rng.uniform(3.0, 20.0), 3))
        case Kind.BOOTSTRAP:
            return Fault(kind, at, -1, round(rng.uniform(2.0, 40.0), 3), amount=float(rng.random() < 0.5))
        case Kind.FREEZE:  # shorter and longer than a lease (6 s): zombies
            return Fault(kind, at, node, round(rng.uniform(1.0, 20.0), 3))
        case Kind.DHT_SLOW:
            return Fault(
                kind, at, node, round(rng.uniform(3.0, 30.0), 3), amount=round(rng.uniform(0.3, 4.0), 3)
            )
        case Kind.DHT_DROP:
            return Fault(
                kind, at, node, round(rng.uniform(3.0, 30.0), 3), amount=round(rng.uniform(0.2, 0.9), 3)
            )
        case Kind.STARVE:
            return Fault(
                kind, at, node, round(rng.uniform(3.0, 30.0), 3), amount=round(rng.uniform(0.2, 3.0), 3)
            )
    raise ValueError(f"no draw for {kind}")


def apply(fault: Fault, world: World, nodes: Sequence[SimNode], routing: Routing) -> None:
    """Schedule `fault`'s start and end on the world's loop."""
    world.loop.call_at(fault.at, lambda: _begin(fault, world, nodes, routing))


def _restart(node: SimNode) -> None:
    if node.phase in (Phase.DOWN, Phase.EXITED):
        node.start()


def _begin(fault: Fault, world: World, nodes: Sequence[SimNode], routing: Routing) -> None:
    world.note("sim", "fault", fault=fault.describe())
    node = nodes[fault.node] if fault.node >= 0 else None
    match fault.kind:
        case Kind.NEWCOMER:
            _restart(node)
        case Kind.KILL:
            if node.up:
                node.kill()
                world.later(fault.length, lambda: _restart(node))
        case Kind.TERM:
            node.terminate(then=lambda: world.later(fault.length, lambda: _restart(node)))
        case Kind.FREEZE:
            incarnation = node.incarnation
            node.freeze()
            world.later(fault.length, lambda: node.thaw() if node.incarnation == incarnation else None)
        case Kind.DHT_SLOW:
            node.dht.extra = fault.amount
            world.later(fault.length, lambda: setattr(node.dht, "extra", 0.0))
        case Kind.DHT_DROP:
            node.dht.drop = fault.amount
            world.later(fault.length, lambda: setattr(node.dht, "drop", 0.0))
        case Kind.BOOTSTRAP:
            routing.restart_bootstrap(fault.length, amnesia=fault.amount > 0)
        case Kind.STARVED_READS:
            node.dht.starved_reads = True
            world.later(fault.length, lambda: setattr(node.dht, "starved_reads", False))
        case Kind.STARVE:
            node.starve(fault.amount)
            world.later(fault.length, lambda: node.starve(0.0))
        case Kind.PARTITION:
            side = frozenset(nodes[i].peer_id for i in fault.group)
            rest = (frozenset(n.peer_id for n in nodes) - side) | {BOOTSTRAP}
            if world.cut is None:
                world.split([side, rest])
                world.later(fault.length, world.heal)
