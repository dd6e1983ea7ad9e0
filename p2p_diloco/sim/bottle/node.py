"""`SimNode`: one whole simulated node and its lifecycle, on the project's own code.

An incarnation is one process: it opens its `StateDir` (the persisted replica and peer state, if any,
as `node.runtime.PeerNode.start` reads them: term floors per shard, `last_in_sync`), builds the real
`Learner` and `Peer`, runs them under a `SimDriver` with the real node's timers (swarm tick every
heartbeat period, sync tick while holding, `ReplicaSaver` every `persist_every`), logs through the real
`PeerEventLog` and `ContributionLedger`, catches up (replay within `rejoin_grace`, else snapshots), then
trains. Signals:

* SIGKILL (`kill`): the process vanishes; its state directory stays as the last save left it.
* SIGSTOP / SIGCONT (`freeze`, `thaw`): nothing of the process runs; its timers fire late, once.
* SIGTERM (`terminate`): `PeerNode.shutdown`'s steps, each bounded as there: the peer gets `Stopping`
  (gives up its roles, releases its leases), the replica is saved, the I/O thread drains, the process
  exits. `exited_at - terminated_at` is checked against `STOP_DEADLINE`.

A restart (`start` again) is a new incarnation on the same state directory and peer ID.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import Corpus, make_sampler
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.model.probe import loss_probe_for
from p2p_diloco.node.events import PeerEventLog, ReplicaSaver
from p2p_diloco.node.ledger import ContributionLedger
from p2p_diloco.node.runtime import CATCH_UP_SECONDS, SHUTDOWN_SECONDS, TEARDOWN_SECONDS
from p2p_diloco.node.state import PeerState, StateDir
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.sim.bottle.driver import DhtWeather, Freezer, SimDriver
from p2p_diloco.sim.bottle.routing import BOOTSTRAP, Routing, address_of, peer_of
from p2p_diloco.sim.bottle.transport import SimTransport
from p2p_diloco.sim.bottle.world import World
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.memory import StarvedReads
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.wire.signing import InMemoryKeys

DHT_TIMEOUT = 5.0  # `NodeOptions.dht_timeout`'s default
FETCH_TIMEOUT = 30.0  # `NodeOptions.fetch_timeout`'s default
PERSIST_EVERY = 10.0  # seconds between replica saves (the real default is 30 s; a short run needs more)
SUPERVISOR_RETRY = 10.0  # seconds before a supervisor starts a `join` again that could not start
POLL_SECONDS = 0.05  # how often a stopping node looks whether the step it waits for is done
# The most SIGTERM -> exit may take: `PeerNode.shutdown`'s bounded steps added up (role, save, I/O drain,
# flush, teardown of transport and DHT).
STOP_DEADLINE = SHUTDOWN_SECONDS + 3 * (DHT_TIMEOUT + 1.0) + 2 * TEARDOWN_SECONDS


class Phase(StrEnum):
    DOWN = "down"  # not started, or killed
    STARTING = "starting"  # catching up
    RUNNING = "running"
    STOPPING = "stopping"  # SIGTERM received, shutting down
    EXITED = "exited"


@dataclass(frozen=True)
class Shared:
    """What every node of a run builds the same: the corpus, the plan, shapes, initial weights, keys."""

    manifest: RunManifest
    corpus: Corpus
    plan: FragmentPlan
    shapes: dict[str, tuple[int, ...]]
    initial: dict[str, torch.Tensor]
    embeddings: frozenset[str]
    keys: InMemoryKeys


@dataclass(frozen=True)
class NodeSpec:
    index: int
    peer_id: str
    step_time: float = 1.0
    may_sync: bool = True
    clock_offset: float = 0.0  # this node's clock minus the world's


class NodeClock:
    """A node's clock: the world's plus its offset (hivemind's DHT time is each machine's own)."""

    def __init__(self, world: World, offset: float):
        self.world, self.offset = world, offset

    def now(self) -> float:
        return self.world.now() + self.offset


Hooks = Callable[["SimNode", fx.Intent], None]


class SimNode:
    """One node, across its incarnations (module docstring)."""

    def __init__(
        self, world: World, spec: NodeSpec, shared: Shared, root: Path, on_intent: Hooks, routing: Routing
    ):
        self.world, self.spec, self.shared = world, spec, shared
        self.routing = routing
        self.peer_id = spec.peer_id
        self.path = root / spec.peer_id
        self.clock = NodeClock(world, spec.clock_offset)
        self.on_intent = on_intent
        self.phase = Phase.DOWN
        self.incarnation = 0
        self.freezer = Freezer()
        self.dht = DhtWeather()
        self.peer: Peer | None = None
        self.learner: Learner | None = None
        self.driver: SimDriver | None = None
        self.state: StateDir | None = None
        self.ledger: ContributionLedger | None = None
        self.saver: ReplicaSaver | None = None
        self.training = False
        self.stopping_since: float | None = None  # world time the peer took `Stopping`
        self.terminated_at: float | None = None
        self.exited_at: float | None = None
        self.errors: list[str] = []
        self.steps = 0
        self.after_exit: Callable[[], None] | None = None  # what runs once a SIGTERMed incarnation exited

    # ---- start ---------------------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.phase in (Phase.STARTING, Phase.RUNNING, Phase.STOPPING)

    def start(self) -> None:
        assert not self.up, f"{self.peer_id} is running"
        self.incarnation += 1
        self.freezer = Freezer()
        self.stopping_since = self.terminated_at = self.exited_at = None
        self.after_exit = None
        manifest, shared = self.shared.manifest, self.shared
        self.state = StateDir(self.path, manifest)
        saved = self.state.read_peer_state()
        known = [peer_of(a) for a in saved.known_peers] if saved is not None else []
        if not self.routing.join(self.peer_id, [BOOTSTRAP, *(p for p in known if p)]):  # `start_node_dht`
            self._start_failed()
            return
        replica = self.state.load_replica(shared.plan)
        restored = replica is not None
        replica = replica or GlobalReplica(shared.plan, shared.initial)
        last_in_sync = saved.last_in_sync if saved is not None and restored else 0.0
        self.ledger = ContributionLedger(self.path, manifest)
        self.learner = self._make_learner(replica)
        self.peer = peer = self._make_peer(replica, saved)
        self.driver = driver = self._make_driver(peer)
        incarnation = self.incarnation
        self.saver = ReplicaSaver(self.state, peer, driver, self.clock, last_in_sync, self.event)
        period = manifest.timing.heartbeat_period
        driver.every(period, self._swarm_tick)
        driver.on_sync_due(self._sync_tick)
        driver.every(PERSIST_EVERY, self.saver.save)
        driver.start()
        self.phase = Phase.STARTING
        self.event("start", peer_id=self.peer_id, restored=restored, versions=list(replica.versions()))
        self.world.note(
            self.peer_id,
            "start",
            incarnation=incarnation,
            restored=restored,
            versions=list(replica.versions()),
        )
        self._catch_up(last_in_sync, incarnation)

    def _start_failed(self) -> None:
        """No initial peer answered: `join` exits (status 2) and its supervisor starts it again later."""
        self.event("dht_unreachable")
        self.state.close()
        self.state = None
        self.phase = Phase.EXITED
        self.world.later(
            SUPERVISOR_RETRY, lambda: self.start() if self.phase in (Phase.DOWN, Phase.EXITED) else None
        )

    def _make_peer(self, replica: GlobalReplica, saved: PeerState | None) -> Peer:
        manifest, shared = self.shared.manifest, self.shared
        peer = Peer(
            self.peer_id,
            manifest,
            shared.plan,
            replica,
            shapes=shared.shapes,
            keys=shared.keys.for_peer(self.peer_id),
            embedding_names=shared.embeddings,
            may_sync=self.spec.may_sync,
            loss_probe=loss_probe_for(manifest, replica, shared.corpus.eval),
        )
        if saved is not None:  # as `PeerNode.start`: each shard's term floor
            for seat, term in zip(peer.seats, saved.shard_terms or (saved.term_seen,)):
                seat.membership.saw_term(term)
        return peer

    def _make_driver(self, peer: Peer) -> SimDriver:
        incarnation = self.incarnation
        transport = SimTransport(
            self.world,
            self.peer_id,
            lambda: self.incarnation == incarnation and self.up,
            send_timeout=FETCH_TIMEOUT,
            fetch_timeout=FETCH_TIMEOUT,
        )
        events = PeerEventLog(self.event, self.ledger, verbose=False, clock=self.clock)
        return SimDriver(
            peer,
            kv=StarvedReads(
                self.world.dht_view(self.peer_id), self.peer_id, lambda now: self.dht.starved_reads
            ),
            transport=transport,
            clock=self.clock,
            learner=self.learner,
            observer=lambda intent: self._observe(events, intent),
            world=self.world,
            freezer=self.freezer,
            dht=self.dht,
            dht_timeout=DHT_TIMEOUT,
            rng=self.world.node_rng(self.peer_id, f"driver{incarnation}"),
            on_error=self._owner_error,
        )

    def _make_learner(self, replica: GlobalReplica) -> Learner:
        manifest, shared = self.shared.manifest, self.shared
        torch.manual_seed(self.spec.index * 1000 + self.incarnation)
        model = build_model(manifest.model)
        optimizer = make_inner_optimizer(model, manifest.diloco.inner_lr, manifest.diloco.inner_weight_decay)
        sampler = make_sampler(
            manifest, self.peer_id, shared.corpus, salt=self.world.seed * 1000 + self.incarnation
        )
        first_seq = int(self.world.now() * 1000) + self.incarnation  # above every seq of earlier lives
        return Learner(
            self.peer_id, manifest, shared.plan, replica, model, optimizer, sampler, first_seq=first_seq
        )

    def _catch_up(self, last_in_sync: float, incarnation: int) -> None:
        """As `node.assembly.catch_up_at_start`: replay within `rejoin_grace`, else snapshots; then the
        first swarm tick and training."""
        assert self.driver is not None
        now = self.clock.now()
        away = now - last_in_sync if last_in_sync > 0 else math.inf
        replay = away < self.shared.manifest.timing.rejoin_grace
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.driver.post(fx.CatchUpRequested(now, replay, done))
        started = self.world.now()

        def check() -> None:
            if self.incarnation != incarnation or self.phase != Phase.STARTING:
                return
            if not done.done() and self.world.now() - started < CATCH_UP_SECONDS:
                self.world.later(POLL_SECONDS, lambda: self.freezer.run_or_hold(check))
                return
            stats = done.result() if done.done() else None
            self.event("catch_up" if stats is not None else "catch_up_failed", replay=replay)
            self.world.note(
                self.peer_id,
                "caught_up",
                replay=replay,
                ok=stats is not None,
                versions=list(self.peer.replica.versions()),
            )
            self.phase = Phase.RUNNING
            self.driver.post_call(self._swarm_tick)
            self.training = True
            self.world.later(self.spec.step_time, lambda: self._step(incarnation))

        check()

    # ---- the owner's jobs and the training thread -----------------------------------------------------

    def _swarm_tick(self) -> None:
        learner = self.learner
        loss = learner.last_loss if learner.last_loss == learner.last_loss else 0.0
        fields = {"step_time": self.spec.step_time, "step": learner.step, "loss": loss}
        fields["addresses"] = (address_of(self.peer_id),)  # what a restart of another peer dials
        self.driver.process(fx.Tick(fx.TickKind.SWARM, self.clock.now(), fields))

    def _sync_tick(self) -> None:
        self.driver.process(fx.Tick(fx.TickKind.SYNC, self.clock.now(), sync_seconds=0.0))

    def _step(self, incarnation: int) -> None:
        if self.incarnation != incarnation or not self.training or not self.up:
            return
        if self.freezer.frozen:
            self.freezer.run_or_hold(lambda: self._step(incarnation))
            return
        learner = self.learner
        learner.train_step(compute_seconds=self.spec.step_time)
        self.steps += 1
        ready = learner.take_due(self.clock.now(), self.peer.outbox.gate)
        if ready is not None:
            self.driver.post(ready)
        self.world.later(self.spec.step_time, lambda: self._step(incarnation))

    def _observe(self, events: PeerEventLog, intent: fx.Intent) -> None:
        events(intent)
        if isinstance(intent, fx.Note):
            self.world.note(self.peer_id, "note", line=intent.line)
        self.on_intent(self, intent)

    def _owner_error(self, what: str, exc: BaseException) -> None:
        if what == "dht":  # a lost or failed DHT call: the real node counts it as a tick error
            self.event("tick_error", error=f"{what}: {type(exc).__name__}: {exc}")
            return
        self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
        self.world.note(self.peer_id, "owner_error", job=what, error=f"{type(exc).__name__}: {exc}")

    def event(self, kind: str, **fields: object) -> None:
        if self.state is not None:
            self.state.event(kind, t=self.clock.now(), **fields)

    # ---- signals -------------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL: gone at once; the state directory keeps what the last save wrote."""
        if not self.up:
            return
        self.world.note(self.peer_id, "sigkill", phase=str(self.phase))
        self._gone(Phase.DOWN)

    def _gone(self, phase: Phase) -> None:
        self.training = False
        if self.driver is not None:
            self.driver.kill()
        self.world.frozen.discard(self.peer_id)
        self.routing.leave(self.peer_id)
        self.freezer = Freezer()
        if self.ledger is not None:
            self.ledger.close()
        if self.state is not None:
            self.state.close()
        self.state = None
        self.phase = phase

    def freeze(self) -> None:
        if self.up and not self.freezer.frozen:
            self.world.note(self.peer_id, "sigstop")
            self.freezer.frozen = True
            self.world.frozen.add(self.peer_id)

    def thaw(self) -> None:
        if self.freezer.frozen:
            self.world.note(self.peer_id, "sigcont")
            self.world.frozen.discard(self.peer_id)
            self.freezer.thaw()

    def starve(self, lag: float) -> None:
        if self.driver is not None and self.driver.cpu_lag != lag:
            self.driver.cpu_lag = lag
            self.world.note(self.peer_id, "cpu_lag", seconds=round(lag, 3))

    def terminate(self, then: Callable[[], None] | None = None) -> None:
        """SIGTERM: `PeerNode.shutdown`'s steps on virtual time; `then` runs once the process exited."""
        if self.phase not in (Phase.STARTING, Phase.RUNNING):
            return
        self.world.note(self.peer_id, "sigterm", phase=str(self.phase))
        self.phase = Phase.STOPPING
        self.terminated_at = self.world.now()
        self.training = False  # the current step finishes first: steps are instants here
        incarnation, driver = self.incarnation, self.driver
        answer: concurrent.futures.Future = concurrent.futures.Future()
        driver.post_call(self._mark_stopping)
        driver.post(fx.Stopping(self.clock.now(), answer))

        def save() -> None:
            saved = driver.call(self.saver.save)
            self._wait(lambda: saved.done(), DHT_TIMEOUT, incarnation, drain)

        def drain() -> None:
            self._wait(driver.idle_io, DHT_TIMEOUT + 1.0, incarnation, lambda: self._exit(answer))

        self.after_exit = then
        self._wait(answer.done, DHT_TIMEOUT + 1.0, incarnation, save)

    def _mark_stopping(self) -> None:
        self.stopping_since = self.world.now()

    def _wait(
        self,
        ready: Callable[[], bool],
        seconds: float,
        incarnation: int,
        then: Callable[[], None],
    ) -> None:
        """Run `then` once `ready()` or after `seconds` of this incarnation (frozen time counts too)."""
        deadline = self.world.now() + seconds

        def check() -> None:
            if self.incarnation != incarnation or self.phase != Phase.STOPPING:
                return
            if ready() or self.world.now() >= deadline:
                then()
            else:
                self.world.later(POLL_SECONDS, lambda: self.freezer.run_or_hold(check))

        check()

    def _exit(self, answer: concurrent.futures.Future) -> None:
        peer = self.peer
        released = bool(answer.result()) if answer.done() else False
        self.event(
            "stopped",
            versions=list(peer.replica.versions()),
            digest=peer.replica.digest(),
            released_lease=released,
        )
        self.world.note(
            self.peer_id, "exited", released_lease=released, versions=list(peer.replica.versions())
        )
        self._gone(Phase.EXITED)
        self.exited_at = self.world.now()
        after, self.after_exit = self.after_exit, None
        if after is not None:
            after()
