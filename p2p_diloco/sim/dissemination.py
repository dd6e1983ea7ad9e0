"""How deltas and updates move through a swarm of M peers, on the in-memory network with a link model.

Why a model and not the in-process swarm of real `Peer` objects (`swarm.inprocess`): on the shared
2-core machine of issue #29 that swarm (tiny GPT, batch 1) cost 0.36 s of wall time per fake second at 16
peers and 9 to 21 s at 64 (two runs, the machine loaded by other work), and its cost grows faster than
M²: every peer reads every other peer's heartbeat each period, and `swarm.vouching.Vouchers.trusted_tips`
compares every pair of tips per fragment (M² per peer per period, M³ for the swarm). At 1024 peers that is
days for a minute of fake time. `scripts/bench_swarm.py --inprocess` runs the real swarm at the small
sizes as the reference (its busiest peer's bytes beside this model's) and this model at every size.

What is modelled, at the byte and frame level (`SpreadSpec`): P fragments, each owned by the holder of its
synchronizer shard (fragment % S, holders on S distinct peers, `protocol.shards`' rule); every round of a
fragment, every other peer sends its delta (`delta_bytes`) to the shard's holder, which publishes the
update (`update_bytes`) once every delta has arrived. The update then spreads by one of two rules:

* ``fanout = 0``: today's rule, the holder pushes it to every other peer (`swarm.role`'s tick);
* ``fanout = f``: the relay tree of issue #29 (as `swarm.relay` describes it): the peers ordered by a
  rendezvous hash of (update, peer) with the holder first; the holder pushes the update to positions
  1 .. f, and the peer at position i > 0 offers it (`offer_bytes`) to positions i*f+1 .. i*f+f, which
  answer with a small request and get the payload.

Every frame crosses `swarm.links.LinkModel` (each peer's serialized uplink, latency, downlink) on a
`swarm.memory.SimNetwork` under a fake clock. Reported per size: bytes per peer per round (a round: one
update of every fragment), split into delta and update bytes, the busiest peer, and per update the time
from publish to the last peer and the depth in hops. Merging, checks and repairs are not modelled; peers
never fail; every peer gets every update (the tree covers all peers, as every peer here has the same view).
"""

from __future__ import annotations

import hashlib
import statistics
import struct
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.swarm.links import LinkModel, LinkSpec
from p2p_diloco.swarm.memory import EventLoop, FakeClock, SimNetwork
from p2p_diloco.wire.codecs.codec import encode_tensors
from p2p_diloco.wire.replies import Reply, ReplyStatus

HEAD = struct.Struct(">BHI")  # kind, fragment, round
DELTA, OFFER, PAYLOAD = 1, 2, 3
HORIZON = 1e9  # fake seconds: the run ends when every frame has arrived, long before this


class Answer(StrEnum):
    SEND = "send"  # an offered update this peer lacks: send me the payload
    HAVE = "have"  # this peer holds it already
    TAKEN = "taken"  # a delta or payload arrived


@dataclass(frozen=True)
class SpreadSpec:
    peers: int
    update_bytes: int
    delta_bytes: int
    fragments: int = 4
    shards: int = 1
    fanout: int = 0  # 0: the holder pushes to every peer; f > 0: the relay tree
    rounds: int = 4  # rounds of every fragment
    round_seconds: float = 16.0  # H inner steps of 1 s: each fragment's round starts every 16 s
    offer_bytes: int = 120
    link: LinkSpec = field(default_factory=LinkSpec)

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= self.fragments or self.shards > self.peers:
            raise ValueError(f"shards must be in [1, min(fragments, peers)], got {self.shards}")
        if self.peers < 2 or self.fanout < 0 or self.rounds < 1:
            raise ValueError("need peers >= 2, fanout >= 0, rounds >= 1")


def peer_name(i: int) -> str:
    return f"p{i:05d}"


def relay_order(peers: list[str], leader: str, fragment: int, rnd: int) -> list[str]:
    """The leader, then the other peers by a rendezvous hash of (update, peer): the relay tree's order."""

    def rank(peer: str) -> bytes:
        return hashlib.blake2b(f"{fragment}:{rnd}:{peer}".encode(), digest_size=8).digest()

    return [leader, *sorted((p for p in peers if p != leader), key=rank)]


def children(order: list[str], position: int, fanout: int) -> list[str]:
    return order[position * fanout + 1 : position * fanout + fanout + 1]


class _Peer:
    """One peer's inbound handlers on the `SimNetwork`: the model's bookkeeping, no training."""

    def __init__(self, swarm: Spread, name: str):
        self.swarm, self.name = swarm, name

    def handle_delta(self, src: str, frame: bytes) -> Reply:
        _, fragment, rnd = HEAD.unpack_from(frame)
        self.swarm.delta_arrived(self.name, fragment, rnd)
        return Reply(ReplyStatus.ACCEPTED, Answer.TAKEN)

    def handle_update(self, src: str, frame: bytes) -> Reply:
        kind, fragment, rnd = HEAD.unpack_from(frame)
        if kind == OFFER:
            held = (fragment, rnd) in self.swarm.held[self.name]
            return Reply(ReplyStatus.ACCEPTED, Answer.HAVE if held else Answer.SEND)
        self.swarm.update_arrived(self.name, src, fragment, rnd)
        return Reply(ReplyStatus.APPLIED, Answer.TAKEN)


class Spread:
    """One run of the model (module docstring)."""

    def __init__(self, spec: SpreadSpec):
        self.spec = spec
        self.loop = EventLoop(FakeClock())
        self.links = LinkModel(default=spec.link)
        latency = 2 * spec.link.latency  # replies (offer answers) come back after one crossing
        self.network = SimNetwork(self.loop, base_delay=latency, links=self.links)
        self.names = [peer_name(i) for i in range(spec.peers)]
        for name in self.names:
            self.network.register(name, _Peer(self, name))
        self.held: dict[str, set[tuple[int, int]]] = {name: set() for name in self.names}
        self.deltas_in: dict[tuple[int, int], int] = {}
        self.published: dict[tuple[int, int], float] = {}
        self.reached: dict[tuple[int, int], dict[str, tuple[float, int]]] = {}  # peer -> (time, hop)
        self.hop_of: dict[tuple[str, int, int], int] = {}
        self.orders: dict[tuple[int, int], list[str]] = {}
        self.positions: dict[tuple[int, int], dict[str, int]] = {}
        self.delta_bytes: dict[str, int] = dict.fromkeys(self.names, 0)
        self.update_bytes: dict[str, int] = dict.fromkeys(self.names, 0)

    def holder(self, fragment: int) -> str:
        return self.names[fragment % self.spec.shards]

    def frame(self, kind: int, fragment: int, rnd: int, size: int) -> bytes:
        head = HEAD.pack(kind, fragment, rnd)
        return head + bytes(max(0, size - len(head)))

    def _send(
        self, src: str, dst: str, frame: bytes, kind: str, count: dict[str, int], on_reply=None
    ) -> None:
        count[src] += len(frame)
        count[dst] += len(frame)
        self.network.deliver(src, dst, frame, kind, on_reply)

    # ---- a round of one fragment ------------------------------------------------------------------

    def start_round(self, fragment: int, rnd: int) -> None:
        holder = self.holder(fragment)
        self.held[holder].add((fragment, rnd))  # its own delta and merge need no wire
        frame = self.frame(DELTA, fragment, rnd, self.spec.delta_bytes)
        for name in self.names:
            if name != holder:
                self._send(name, holder, frame, "delta", self.delta_bytes)

    def delta_arrived(self, holder: str, fragment: int, rnd: int) -> None:
        key = (fragment, rnd)
        self.deltas_in[key] = self.deltas_in.get(key, 0) + 1
        if self.deltas_in[key] == self.spec.peers - 1:
            self.publish(holder, fragment, rnd)

    def publish(self, holder: str, fragment: int, rnd: int) -> None:
        key = (fragment, rnd)
        self.published[key] = self.loop.clock.now()
        self.reached[key] = {holder: (self.loop.clock.now(), 0)}
        if self.spec.fanout == 0:
            payload = self.frame(PAYLOAD, fragment, rnd, self.spec.update_bytes)
            for name in self.names:
                if name != holder:
                    self.hop_of[(name, fragment, rnd)] = 1
                    self._send(holder, name, payload, "update", self.update_bytes)
            return
        self.orders[key] = relay_order(self.names, holder, fragment, rnd)
        self.positions[key] = {p: i for i, p in enumerate(self.orders[key])}
        self.offer_onward(holder, 0, fragment, rnd)

    def offer_onward(self, peer: str, position: int, fragment: int, rnd: int) -> None:
        order = self.orders[(fragment, rnd)]
        hop = self.reached[(fragment, rnd)][peer][1] + 1
        offer = self.frame(OFFER, fragment, rnd, self.spec.offer_bytes)
        payload = self.frame(PAYLOAD, fragment, rnd, self.spec.update_bytes)
        for child in children(order, position, self.spec.fanout):
            if position == 0:  # the publisher pushes to its children; relayers offer first
                self.hop_of[(child, fragment, rnd)] = hop
                self._send(peer, child, payload, "update", self.update_bytes)
                continue

            def answered(reply: Reply, child: str = child) -> None:
                if reply.tag != Answer.SEND:
                    return
                self.update_bytes[child] += self.spec.offer_bytes  # its request for the payload
                self.hop_of[(child, fragment, rnd)] = hop
                self._send(peer, child, payload, "update", self.update_bytes)

            self._send(peer, child, offer, "update", self.update_bytes, on_reply=answered)

    def update_arrived(self, peer: str, src: str, fragment: int, rnd: int) -> None:
        key = (fragment, rnd)
        if key in self.held[peer]:
            return
        self.held[peer].add(key)
        self.reached[key][peer] = (self.loop.clock.now(), self.hop_of[(peer, fragment, rnd)])
        if self.spec.fanout:
            self.offer_onward(peer, self.positions[key][peer], fragment, rnd)

    # ---- the run ----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        spec = self.spec
        stagger = spec.round_seconds / spec.fragments  # one fragment is due every H/P steps
        for rnd in range(spec.rounds):
            for fragment in range(spec.fragments):
                at = rnd * spec.round_seconds + fragment * stagger
                self.loop.call_at(at, lambda f=fragment, r=rnd: self.start_round(f, r))
        self.loop.run_until(HORIZON)
        return self.report()

    def report(self) -> dict[str, Any]:
        spec = self.spec
        total = {n: self.delta_bytes[n] + self.update_bytes[n] for n in self.names}
        busiest = max(self.names, key=lambda n: total[n])
        times = [max(t for t, _ in r.values()) - self.published[k] for k, r in self.reached.items()]
        depths = [max(h for _, h in r.values()) for r in self.reached.values()]
        complete = all(len(r) == spec.peers for r in self.reached.values())
        per_round = {n: v / spec.rounds for n, v in total.items()}
        return {
            "peers": spec.peers,
            "shards": spec.shards,
            "fragments": spec.fragments,
            "frame_bytes": spec.update_bytes,
            "fanout": spec.fanout,
            "rounds": spec.rounds,
            "updates": len(self.published),
            "every_peer_got_every_update": complete,
            "busiest": busiest,
            "busiest_bytes_per_round": per_round[busiest],
            "busiest_delta_bytes_per_round": self.delta_bytes[busiest] / spec.rounds,
            "busiest_update_bytes_per_round": self.update_bytes[busiest] / spec.rounds,
            "median_bytes_per_round": statistics.median(per_round.values()),
            "max_update_bytes_per_round": max(self.update_bytes.values()) / spec.rounds,
            "propagation_p50": statistics.median(times),
            "propagation_max": max(times),
            "depth_max": max(depths),
            "depth_median": statistics.median(depths),
            "fake_seconds": max(t for r in self.reached.values() for t, _ in r.values()),
        }


def run_spread(spec: SpreadSpec) -> dict[str, Any]:
    return Spread(spec).run()


def fragment_frame_bytes(manifest: RunManifest) -> int:
    """The mean int8 frame size of one fragment of `manifest`'s model (an update's or a delta's payload)."""
    model = build_model(manifest.model)
    params = dict(model.named_parameters())
    plan = plan_fragments([(n, tuple(p.shape)) for n, p in params.items()], manifest.diloco.fragments)
    sizes = [
        len(encode_tensors({n: params[n].detach() for n in plan.names(f)}, codec=manifest.wire.codec))
        for f in range(plan.num_fragments)
    ]
    return int(statistics.mean(sizes))
