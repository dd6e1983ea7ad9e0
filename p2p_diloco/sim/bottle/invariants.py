"""What must hold in every simulated run, each rule with a name, checked after every event of the loop
(`check`), on every telemetry intent a peer emits (`on_intent`) and once the run is quiet (`final`).

The first broken rule is kept as a `Violation` (its name, the virtual time, the seed); the run stops
there, and `scripts/explore.py --replay SEED` shows the trace up to that point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import shards
from p2p_diloco.sim.bottle.node import STOP_DEADLINE, Phase, SimNode
from p2p_diloco.sim.bottle.world import World
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election.phase import Phase as SeatPhase


class Rule(StrEnum):
    # no shard term held by two peers for longer, once each one's DHT view holds the other's lease, than the
    # next election read takes to show the tie (a heartbeat period, the slower one's DHT latency and owner
    # lag) plus the lease margin
    ONE_HOLDER_PER_TERM = "one_holder_per_term"
    # no shard term published by two peers whose claims of it were not cut apart (a partition, two DHT
    # islands) from the second claim to the second publication: the holder of a term is one peer
    ONE_PUBLISHER_PER_TERM = "one_publisher_per_term"
    FENCING_MONOTONE = "fencing_monotone"  # a peer's highest term seen (per shard) never goes back
    APPLIED_ONCE = "applied_once"  # no update applied twice to one replica
    VERSIONS_MONOTONE = "versions_monotone"  # no fragment's version goes back on a running replica
    MERGED_ONCE = "merged_once"  # a learner's delta (fragment, seq) is merged by at most one update
    NO_CLAIM_WHILE_STOPPING = "no_claim_while_stopping"  # a stopping peer never claims a lease
    PHASE_MATCHES_ROLE = "phase_matches_role"  # a seat is HOLDING exactly while it holds its shard's term
    EXITS_IN_TIME = "exits_in_time"  # SIGTERM -> exit within `STOP_DEADLINE`
    OWNER_NEVER_RAISES = "owner_never_raises"  # the peer and its driver never raise on the owner
    REPLICAS_IDENTICAL = "replicas_identical"  # once quiet, every running replica is bit-identical
    DELTAS_SETTLED = "deltas_settled"  # once quiet, no delta is still in flight: merged or released
    EVERYONE_REJOINED = "everyone_rejoined"  # once healed and quiet, every node runs at the swarm's versions


@dataclass(frozen=True)
class Violation:
    rule: Rule
    t: float
    detail: str
    seed: int

    def __str__(self) -> str:
        return f"seed {self.seed}: {self.rule} broken at t={self.t:.3f}: {self.detail}"


class Invariants:
    """The rules above over one run's nodes (module docstring)."""

    def __init__(self, world: World, nodes: Sequence[SimNode], manifest: RunManifest):
        self.world, self.nodes, self.manifest = world, nodes, manifest
        self.shared_terms: dict[tuple[int, int], float] = {}  # (shard, term) -> since when two peers hold it
        self.terms_seen: dict[tuple[str, int, int], int] = {}  # (peer, incarnation, shard) -> highest
        self.refusals: dict[tuple[str, int, int], int] = {}  # the same -> `Membership.refused_terms`
        self.versions: dict[tuple[str, int], tuple[int, ...]] = {}
        self.applied: set[tuple[str, int, int, int, int, str]] = set()
        self.merged: dict[tuple[str, int, int], tuple[int, int, str]] = {}
        self.claimants: dict[tuple[int, int], list[str]] = {}  # (shard, term) -> its claimants, in order
        self.contested: set[tuple[int, int]] = set()  # the (shard, term)s claimed by two peers or more
        self.apart: set[tuple[int, int, frozenset[str]]] = set()  # (shard, term, pair) cut apart meanwhile
        self.publishers: dict[tuple[int, int], str] = {}  # (shard, term) -> its first publisher
        self.claims = 0
        self.published = 0
        self.violation: Violation | None = None  # the first rule broken

    def fail(self, rule: Rule, detail: str) -> None:
        if self.violation is None:
            self.violation = Violation(rule, self.world.now(), detail, self.world.seed)
            self.world.note("sim", "violation", rule=str(rule), detail=detail)

    # ---- on every intent -------------------------------------------------------------------------------

    def on_intent(self, node: SimNode, intent: fx.Intent) -> None:
        match intent:
            case fx.Claimed():
                self.claims += 1
                self.world.note(node.peer_id, "claim", shard=intent.shard, term=intent.term)
                self._claimed(node.peer_id, (intent.shard, intent.term))
                if node.stopping_since is not None:
                    self.fail(
                        Rule.NO_CLAIM_WHILE_STOPPING,
                        f"{node.peer_id} claimed shard {intent.shard} term {intent.term} "
                        f"{self.world.now() - node.stopping_since:.2f} s after it began stopping",
                    )  # noqa: E501
            case fx.Published():
                self.published += 1
                record = intent.record
                self.world.note(
                    node.peer_id,
                    "published",
                    fragment=record.fragment,
                    version=record.to_version,
                    term=record.term,
                    contributors=[f"{who}:{seq}" for (who, _), seq in zip(record.contributors, record.seqs)],
                )
                self._merged_once(record)
                self._one_publisher(node.peer_id, record)
            case fx.Applied():
                record = intent.record
                key = (
                    node.peer_id,
                    node.incarnation,
                    record.fragment,
                    record.to_version,
                    record.term,
                    record.leader,
                )
                self.world.note(
                    node.peer_id,
                    "applied",
                    fragment=record.fragment,
                    version=record.to_version,
                    how=str(intent.how),
                )
                if key in self.applied:
                    self.fail(
                        Rule.APPLIED_ONCE,
                        f"{node.peer_id} applied fragment {record.fragment} "
                        f"v{record.to_version} of term {record.term} twice",
                    )
                self.applied.add(key)
            case fx.LeaseReleased():
                self.world.note(node.peer_id, "released", term=intent.term, rounds=intent.rounds)

    def _claimed(self, peer: str, term: tuple[int, int]) -> None:
        claimants = self.claimants.setdefault(term, [])
        if peer not in claimants:
            claimants.append(peer)
        if len(claimants) > 1:
            self.contested.add(term)
            self._mark_apart()

    def _mark_apart(self) -> None:
        """Pairs of claimants of one shard term that cannot see each other now (cut apart): two sides of
        a partition may each hold a term, and reconciliation settles it after the heal. Only terms claimed
        twice are looked at, so this costs nothing in a run without such claims."""
        for shard, term in self.contested:
            who = self.claimants[(shard, term)]
            for i, a in enumerate(who):
                for b in who[i + 1 :]:
                    if not (self.world.reachable(a, b) and self.world.dht.reachable(a, b)):
                        self.apart.add((shard, term, frozenset((a, b))))

    def _one_publisher(self, peer: str, record) -> None:  # noqa: ANN001 - protocol.messages.UpdateRecord
        term = (shards.shard_of(record.fragment, self.manifest.diloco.synchronizer_shards), record.term)
        first = self.publishers.setdefault(term, peer)
        if first != peer and (*term, frozenset((first, peer))) not in self.apart:
            self.fail(
                Rule.ONE_PUBLISHER_PER_TERM,
                f"shard {term[0]} term {term[1]} published by {first} and by {peer} "
                f"(claimed by {self.claimants.get(term, [])})",
            )

    def _merged_once(self, record) -> None:  # noqa: ANN001 - protocol.messages.UpdateRecord
        update = (record.to_version, record.term, record.leader)
        if len(record.seqs) != len(record.contributors):
            return
        for (learner, _), seq in zip(record.contributors, record.seqs):
            key = (learner, record.fragment, seq)
            first = self.merged.setdefault(key, update)
            if first != update:
                self.fail(
                    Rule.MERGED_ONCE,
                    f"{learner}'s delta seq {seq} of fragment {record.fragment} merged "
                    f"by v{first[0]} (term {first[1]}, {first[2]}) and v{update[0]} (term {update[1]}, "
                    f"{update[2]})",
                )

    # ---- after every event -----------------------------------------------------------------------------

    def check(self) -> None:
        now = self.world.now()
        if self.contested:
            self._mark_apart()
        holders: dict[tuple[int, int], list[SimNode]] = {}
        for node in self.nodes:
            if not node.up or node.peer is None:
                continue
            self._node_checks(node, now)
            for seat in node.peer.seats:
                if seat.sync is not None:
                    holders.setdefault((seat.shard, seat.sync.term), []).append(node)
        timing = self.manifest.timing
        seen_twice = set()
        for (shard, term), who in holders.items():
            pairs = [
                (a, b) for i, a in enumerate(who) for b in who[i + 1 :] if self._see_each_other(a, b, shard)
            ]
            if not pairs:
                continue
            seen_twice.add((shard, term))
            since = self.shared_terms.setdefault((shard, term), now)
            # the next election read shows the tie: a heartbeat period, the slower reader's DHT latency and
            # owner lag, then the lease margin
            allowed = timing.heartbeat_period + timing.lease_margin + max(self._slowness(n) for n in who)
            if now - since > allowed:
                names = sorted(n.peer_id for n in who)
                self.fail(
                    Rule.ONE_HOLDER_PER_TERM,
                    f"shard {shard} term {term} held by {names} for {now - since:.2f} s "
                    f"after both leases were readable (allowed {allowed:.2f} s)",
                )
        for key in [k for k in self.shared_terms if k not in seen_twice]:
            del self.shared_terms[key]

    @staticmethod
    def _slowness(node: SimNode) -> float:
        dht, driver = node.dht, node.driver
        return dht.latency + dht.extra + (driver.cpu_lag if driver is not None else 0.0)

    def _see_each_other(self, a: SimNode, b: SimNode, shard: int) -> bool:
        """Whether `a` and `b` can talk and each one's DHT view holds the other's lease of `shard`: holders
        cut apart (a partition, two DHT islands) or whose leases are not stored yet cannot see the tie."""
        if not (
            self.world.reachable(a.peer_id, b.peer_id) and self.world.dht.reachable(a.peer_id, b.peer_id)
        ):
            return False
        key = a.peer.seats[shard].membership.lease_key
        now = self.world.now()
        return b.peer_id in self.world.dht.get_for(
            a.peer_id, key, now
        ) and a.peer_id in self.world.dht.get_for(b.peer_id, key, now)

    def _node_checks(self, node: SimNode, now: float) -> None:
        peer = node.peer
        if node.errors:
            self.fail(Rule.OWNER_NEVER_RAISES, f"{node.peer_id}: {node.errors[0]}")
        for seat in peer.seats:
            if (seat.phase == SeatPhase.HOLDING) != (seat.sync is not None):
                held = "holds a term" if seat.sync is not None else "holds none"
                self.fail(
                    Rule.PHASE_MATCHES_ROLE, f"{node.peer_id} shard {seat.shard}: {seat.phase} but {held}"
                )
            key = (node.peer_id, node.incarnation, seat.shard)
            seen = seat.membership.term_seen
            refusals = seat.membership.refused_terms
            if refusals != self.refusals.get(key, 0):  # it stepped down from a claim no reader accepted:
                self.refusals[key] = refusals  # that term was never valid, its fence starts anew
                self.terms_seen.pop(key, None)
            if seen < self.terms_seen.get(key, 0):
                self.fail(
                    Rule.FENCING_MONOTONE,
                    f"{node.peer_id} shard {seat.shard}: term seen {self.terms_seen[key]} -> {seen}",
                )
            self.terms_seen[key] = seen
        versions = peer.replica.versions()
        before = self.versions.get((node.peer_id, node.incarnation))
        if before is not None and any(v < b for v, b in zip(versions, before)):
            self.fail(Rule.VERSIONS_MONOTONE, f"{node.peer_id}: versions {list(before)} -> {list(versions)}")
        self.versions[(node.peer_id, node.incarnation)] = versions
        if node.phase == Phase.STOPPING and node.terminated_at is not None:
            if now - node.terminated_at > STOP_DEADLINE:
                self.fail(
                    Rule.EXITS_IN_TIME,
                    f"{node.peer_id} still running {now - node.terminated_at:.1f} s after SIGTERM "
                    f"(deadline {STOP_DEADLINE:.0f} s)",
                )

    # ---- once quiet ------------------------------------------------------------------------------------

    def final(self) -> None:
        running = [n for n in self.nodes if n.phase == Phase.RUNNING and n.peer is not None]
        down = [n.peer_id for n in self.nodes if n.phase != Phase.RUNNING]
        if down:
            self.fail(Rule.EVERYONE_REJOINED, f"not running at the end: {down}")
        versions = {n.peer_id: n.peer.replica.versions() for n in running}
        newest = tuple(
            max(v[p] for v in versions.values()) for p in range(len(next(iter(versions.values()))))
        )
        behind = {who: list(v) for who, v in versions.items() if v != newest}
        if behind:
            self.fail(Rule.EVERYONE_REJOINED, f"behind the swarm's {list(newest)}: {behind}")
        digests = {n.peer_id: n.peer.replica.digest()[:16] for n in running}
        if len(set(digests.values())) > 1:
            self.fail(Rule.REPLICAS_IDENTICAL, f"replicas differ at versions {list(newest)}: {digests}")
        unsettled = {n.peer_id: sorted(n.peer.outbox.in_flight) for n in running if n.peer.outbox.in_flight}
        if unsettled:
            self.fail(Rule.DELTAS_SETTLED, f"deltas still in flight once quiet (fragments): {unsettled}")
