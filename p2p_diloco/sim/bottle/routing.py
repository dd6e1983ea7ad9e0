"""Who finds whom in the DHT: routing tables, the bootstrap node and its restarts (a model of hivemind's).

A DHT member (every running node, and the bootstrap node) knows the members it dialed or was dialed by;
members that know each other through any chain, and that the network lets talk, form one group, and a
group's routing tables fill (everyone in it learns everyone), so a group stays together when the member
that joined it leaves. Records spread within a group only (`PartitionedKeyValueStore.regroup`): two
groups are two DHT islands until a dial joins them, and then their records merge by hivemind's rule.

A node's DHT process starts empty and dials the bootstrap node and the peers its state directory saved
(`PeerState.known_peers`, as `node.assembly.start_node_dht`); a killed process is evicted from every
table. The bootstrap node remembers the peers it watched (`net.bootstrap_state`: every `WATCH_PERIOD`)
and re-dials them after a restart; every node re-dials the bootstrap node while it is not connected to it
(`net.redial`: every `FIRST_BACKOFF`, doubling up to `MAX_BACKOFF`). The trace shows every dial, every
restart of the bootstrap node and every change of the groups.
"""

from __future__ import annotations

from collections.abc import Iterable

from p2p_diloco.net.bootstrap_state import WATCH_PERIOD
from p2p_diloco.net.redial import FIRST_BACKOFF, MAX_BACKOFF
from p2p_diloco.sim.bottle.world import World

BOOTSTRAP = "bootstrap"
ADDRESS_PREFIX = "/sim/"  # a simulated node's announced address is ADDRESS_PREFIX + its peer ID


def address_of(peer_id: str) -> str:
    return ADDRESS_PREFIX + peer_id


def peer_of(address: str) -> str | None:
    return address.removeprefix(ADDRESS_PREFIX) if address.startswith(ADDRESS_PREFIX) else None


class Routing:
    """The routing tables of the run's DHT members (module docstring)."""

    def __init__(self, world: World):
        self.world = world
        self.up: set[str] = set()
        self.known: dict[str, set[str]] = {}
        self.bootstrap_memory: list[str] = []  # the peers the bootstrap node saw (its state file)
        self.groups: list[frozenset[str]] = []
        self._backoff: dict[str, float] = {}
        self.join(BOOTSTRAP, ())
        world.loop.call_at(WATCH_PERIOD, self._watch)

    def join(self, member: str, dial: Iterable[str]) -> bool:
        """`member`'s DHT process starts and dials `dial` (the ones up and reachable answer). False, and
        nothing joins, when it dialed someone and nobody answered: p2pd refuses to start then."""
        if member in self.up:
            return True
        dial = list(dial)
        if dial and not any(p in self.up and self.world.reachable(member, p) for p in dial):
            self.world.note(member, "dht_unreachable", dialed=sorted(set(dial)))
            return False
        self.up.add(member)
        self.known[member] = set()
        answered = [peer for peer in dial if self._link(member, peer)]
        self.world.note(member, "dht_start", dialed=sorted(set(dial)), answered=sorted(answered))
        self._regroup()
        if member != BOOTSTRAP:
            self._backoff[member] = FIRST_BACKOFF
            self.world.later(FIRST_BACKOFF, lambda: self._redial(member))
        return True

    def leave(self, member: str) -> None:
        """`member`'s DHT process is gone: evicted from every table, its records with it."""
        if member not in self.up:
            return
        self.up.discard(member)
        self.known.pop(member, None)
        for table in self.known.values():
            table.discard(member)
        self.world.dht.forget(member)
        self._regroup()

    def restart_bootstrap(self, down: float, *, amnesia: bool = False) -> None:
        """The bootstrap node goes down for `down` s; back, it dials the peers it remembers (none with
        `amnesia`: its state directory was lost, as before issue #31)."""
        self.world.note(BOOTSTRAP, "bootstrap_down", seconds=down, amnesia=amnesia)
        self.leave(BOOTSTRAP)
        if amnesia:
            self.bootstrap_memory = []
        self.world.later(down, self.bring_back_bootstrap)

    def bring_back_bootstrap(self) -> None:
        """The bootstrap node starts (if down) and dials its saved peers
        (`bootstrap_state.BootstrapMemory.dial_list`)."""
        if BOOTSTRAP in self.up:
            return
        self.join(BOOTSTRAP, ())
        answered = [peer for peer in self.bootstrap_memory if self._link(BOOTSTRAP, peer)]
        self.world.note(BOOTSTRAP, "dialed_saved", answered=answered)
        self._regroup()

    def _link(self, a: str, b: str) -> bool:
        if a == b or b not in self.up or a not in self.up or not self.world.reachable(a, b):
            return False
        self.known[a].add(b)
        self.known[b].add(a)
        return True

    def _redial(self, member: str) -> None:
        """`net.redial.Redialer` of a running node: ping the bootstrap node while not connected to it."""
        if member not in self.up:
            return
        if BOOTSTRAP in self.known[member]:
            self._backoff[member] = FIRST_BACKOFF
        elif self._link(member, BOOTSTRAP):
            self.world.note(member, "redialed", peer=BOOTSTRAP)
            self._backoff[member] = FIRST_BACKOFF
            self._regroup()
        else:
            self._backoff[member] = min(MAX_BACKOFF, self._backoff[member] * 2)
        self.world.later(self._backoff[member], lambda: self._redial(member))

    def _watch(self) -> None:
        """The bootstrap node's watch of the run: the peers live in its group, newest first."""
        if BOOTSTRAP in self.up:
            group = next((g for g in self.groups if BOOTSTRAP in g), frozenset())
            seen = sorted(group - {BOOTSTRAP})
            self.bootstrap_memory = [*seen, *(p for p in self.bootstrap_memory if p not in seen)][:16]
        self.world.later(WATCH_PERIOD, self._watch)

    def _regroup(self) -> None:
        groups: list[frozenset[str]] = []
        left = set(self.up)
        while left:
            start = min(left)
            group, frontier = {start}, [start]
            while frontier:
                member = frontier.pop()
                for other in sorted(self.known.get(member, ())):
                    if other in left and other not in group and self.world.reachable(member, other):
                        group.add(other)
                        frontier.append(other)
            left -= group
            for member in group:  # routing tables fill within a group
                self.known[member] |= group - {member}
            groups.append(frozenset(group))
        groups.sort(key=min)
        if groups != self.groups:
            self.world.note("sim", "dht_groups", groups=[sorted(g) for g in groups])
        self.groups = groups
        self.world.dht.regroup(groups)

    def regroup(self) -> None:
        """After the network changed (a partition or its heal)."""
        self._regroup()
