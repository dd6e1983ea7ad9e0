"""`PeerNode`: the real peer process behind `p2p-diloco join`, one `Peer` on hivemind's DHT and libp2p.

Lifecycle (`run`):

1. start: check the device, open the state directory, fork the DHT node, build model, plan, replica
   (the persisted one if there is one) and optimizer while p2pd starts, wait for the DHT node (a restart
   of this peer from its own state directory skips hivemind's identity check: `identity_check_needed`),
   start the transport, build the learner, the `Peer` and its `ThreadedDriver`; then catch up:
   a peer away less than `timing.rejoin_grace` replays the update logs of its peers, any other peer
   (fresh, or away longer) downloads snapshots of the fragments it lacks, spread over several peers.
2. loop: the main thread trains (`node.training.TrainingLoop`): one inner step, then the due delta (if
   any) goes to the peer as an event. After `--max-steps` it stops training but keeps serving the
   swarm. The peer's owner thread (`node.threads`) runs everything else: swarm ticks every heartbeat
   period, the synchronizer's rounds, inbound frames, replica saves (written on the I/O thread),
   progress lines and snapshots, the observability jobs.
3. shutdown (SIGINT/SIGTERM sets `stop`; the current step finishes first): the peer gives up its role
   and releases the lease if held, in-flight sends are flushed, the replica persisted, transport and
   DHT stopped; each step bounded so SIGTERM -> exit stays near `SHUTDOWN_SECONDS`.

The clock is hivemind's DHT time, since DHT records expire at absolute times. Which thread owns what:
`docs/architecture.md`; the node's reports (heartbeat fields, progress, snapshots, error counts) are
`node.upkeep`'s, on the owner thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import sys
import threading
import time
from typing import TextIO

import torch

from p2p_diloco.net.admission import admission_for
from p2p_diloco.net.dht_store import EXIT_DHT_DIED, DhtKeyValueStore, DhtPeer
from p2p_diloco.net.limits import run_transport_options
from p2p_diloco.net.redial import FIRST_BACKOFF, Redialer
from p2p_diloco.net.transport import P2PTransport
from p2p_diloco.node.assembly import (
    BuiltModel,
    build_training,
    catch_up_at_start,
    make_learner,
    make_peer,
    start_node_dht,
)
from p2p_diloco.node.events import PeerEventLog, ReplicaSaver
from p2p_diloco.node.guard import DhtClock, HandlerSlot
from p2p_diloco.node.island import Island
from p2p_diloco.node.island_learner import finish_island
from p2p_diloco.node.ledger import ContributionLedger
from p2p_diloco.node.metrics import MetricsServer, make_registry
from p2p_diloco.node.observing import ObserveOptions, Observing
from p2p_diloco.node.options import NodeOptions, check_device
from p2p_diloco.node.reporting import (
    NodeSnapshot,
    make_display,
    seconds_since_launch,
)
from p2p_diloco.node.standby import Takeover
from p2p_diloco.node.state import PeerState, StateDir
from p2p_diloco.node.threads import ThreadedDriver
from p2p_diloco.node.training import TrainingLoop, TrainingView
from p2p_diloco.node.upkeep import Upkeep
from p2p_diloco.owner import Owner
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.peer import Peer

log = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 10.0  # SIGTERM -> exit target of `PeerNode.shutdown` (a lease release may add to it)
TEARDOWN_SECONDS = 2.0  # grace for the transport and the DHT process to stop after the state is saved
HOT_SPARE_LOCK_SECONDS = 15.0  # at most this long for a dead predecessor's helpers to release the lock
CATCH_UP_SECONDS = 300.0  # at most this long for the start's catch-up; repair continues it later


class PeerNode:
    """One swarm peer in this process (module docstring). `stop` ends `run` after the current step."""

    def __init__(
        self,
        options: NodeOptions,
        *,
        stop: threading.Event | None = None,
        out: TextIO = sys.stdout,
        island: Island | None = None,
        observe: ObserveOptions | None = None,
        takeover: Takeover | None = None,
    ):
        self.options = options
        self.takeover = takeover  # set: this process is a hot spare that took over (node/standby.py)
        self.island = island  # set: this process is rank 0 of an island (node/island.py)
        self.manifest = options.manifest
        self.stop = stop or threading.Event()
        self.exit_status = 0
        self.out = out
        self.clock = DhtClock()
        self.state: StateDir | None = None
        self.dht_peer: DhtPeer | None = None
        self.addresses: tuple[str, ...] = ()  # this peer's multiaddrs, announced in every heartbeat
        self.p2p: P2PTransport | None = None
        self.guard = HandlerSlot(Owner("p2p-transport"))  # its owner: the transport's loop thread
        self.peer: Peer | None = None
        self.driver: ThreadedDriver | None = None
        self.learner: Learner | None = None
        self.training: TrainingLoop | None = None
        self.finish_training = threading.Event()  # set (e.g. by SIGUSR1) to stop training, keep serving
        self.owner = Owner("peer-owner")  # handed to the driver's owner thread when it starts
        self.ledger: ContributionLedger | None = None
        self.metrics: MetricsServer | None = None
        self.display = make_display(out, self.manifest.run_id, options.display)
        self.upkeep = Upkeep(self.owner, self.event, self.display)  # the owner thread's reports
        self.saver: ReplicaSaver | None = None
        self.observe = observe or ObserveOptions()  # global eval, stats record, --log-to (node.observing)
        self.observing: Observing | None = None

    # ---- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the state, build while the DHT starts, assemble and schedule the peer, announce it, catch
        up."""
        # restart costs, in the `start` event; a hot spare's imports and build came before its takeover
        startup = {"imports": self._since_launch(), "hot_spare": self.takeover is not None}
        saved = self._open_state(startup)
        built_model = self._build_while_dht_starts(saved, startup)
        joined = time.monotonic()
        last_in_sync = saved.last_in_sync if saved is not None and built_model.restored else 0.0
        self._assemble_peer(built_model, saved)
        self._schedule_jobs(built_model, last_in_sync)
        # the named successor probes them (`swarm.election.succession.HolderWatch`) to see this process gone
        self.addresses = tuple(self.dht_peer.visible_addresses())
        self.driver.start()
        startup["assemble"] = round(time.monotonic() - joined, 2)
        self._announce_start(built_model, startup)
        self._catch_up(self.clock.now(), last_in_sync)

    def _open_state(self, startup: dict) -> PeerState | None:
        """Check the device, lock the state directory (a hot spare waits for its predecessor's helpers) and
        read what it saved; opens the contribution ledger. Times it into `startup`."""
        opts = self.options
        check_device(opts.device)
        torch.set_num_threads(opts.threads)
        # a hot spare waits for the lock its dead predecessor's exiting helpers may still hold
        lock_wait = HOT_SPARE_LOCK_SECONDS if self.takeover is not None else 0.0
        opened = time.monotonic()
        self.state = StateDir(opts.state_dir, self.manifest, lock_wait=lock_wait)
        saved = self.state.read_peer_state()
        self.ledger = ContributionLedger(self.state.path, self.manifest)
        startup["state_dir"] = round(time.monotonic() - opened, 2)
        return saved

    def _build_while_dht_starts(self, saved: PeerState | None, startup: dict) -> BuiltModel:
        """Fork the DHT node, build model, plan, replica and optimizer while p2pd starts, then wait for the
        DHT node (`self.dht_peer`). Times each part into `startup`."""
        opts = self.options
        # hivemind forks its DHT process here: before corpus and model exist, the child inherits (and
        # copies on write) less; measured 190 -> 138 MiB PSS for the DHT child of a tiny-model peer.
        # The child also inherits the state directory's lock, so while it lives no successor starts.
        forking = time.monotonic()
        pending = start_node_dht(
            opts,
            saved.peer_id if saved is not None else None,
            known_peers=saved.known_peers if saved is not None else (),
        )
        began = time.monotonic()
        startup["dht_start"] = round(began - forking, 2)
        try:  # the CPU work (torch imports its compiler stack for the optimizer) overlaps p2pd's start
            prepared = self.takeover.prepared if self.takeover is not None else None
            built_model = build_training(self.manifest, opts.device, self.state, prepared)
        except BaseException:
            pending.abort()
            raise
        built = time.monotonic()
        self.dht_peer = pending.wait()
        startup["build"], startup["dht_wait"] = round(built - began, 2), round(time.monotonic() - built, 2)
        return built_model

    def _assemble_peer(self, built_model: BuiltModel, saved: PeerState | None) -> None:
        """The transport, learner, `Peer` (with the terms it trusted before a restart) and its driver."""
        opts, manifest = self.options, self.manifest
        peer_id = self.dht_peer.peer_id
        self.p2p = P2PTransport(
            self.dht_peer.dht,
            run_id=manifest.run_id,
            manifest_hash=manifest.manifest_hash,
            handlers=self.guard,
            owner=self.guard.owner,
            **run_transport_options(manifest, built_model.plan, built_model.shapes),
            fetch_timeout=opts.fetch_timeout,
            send_timeout=opts.fetch_timeout,
        )
        self.learner = make_learner(manifest, opts, built_model, peer_id, self.island)
        self.peer = make_peer(manifest, opts, built_model, peer_id)
        if saved is not None:
            # Terms climb one at a time from the highest this peer trusted (`protocol.lease_rules`). A
            # restart that forgot it would trust whatever it reads first, and a first read can come back
            # empty: it would start its own terms from 1 and refuse the swarm's as a jump. Each shard has its
            # own terms (a state saved before shards were remembered holds shard 0's only).
            for seat, term in zip(self.peer.seats, saved.shard_terms or (saved.term_seen,)):
                seat.membership.saw_term(term)
        self.driver = ThreadedDriver(
            self.peer,
            kv=DhtKeyValueStore(self.dht_peer, timeout=opts.dht_timeout, admission=admission_for(manifest)),
            transport=self.p2p,
            clock=self.clock,
            learner=self.learner,
            observer=PeerEventLog(self.event, self.ledger, verbose=self.options.verbose, clock=self.clock),
            on_error=self.upkeep.on_error,
            bind=False,
            owner=self.owner,
        )
        self.guard.attach(self.driver)

    def _schedule_jobs(self, built_model: BuiltModel, last_in_sync: float) -> None:
        """The training loop, and the driver's periodic jobs: swarm ticks, redials, replica saves, progress,
        the observability jobs; binds the owner thread's reports to the peer."""
        opts, manifest, driver = self.options, self.manifest, self.driver
        peer_id = self.dht_peer.peer_id
        self.observing = Observing(self.observe, manifest, peer_id, self.clock)
        self.training = TrainingLoop(
            opts,
            self.learner,
            gate=lambda: self.peer.outbox.gate,
            post=driver.post,
            clock=self.clock,
            stop=self.stop,
            finish_training=self.finish_training,
            tokens_per_step=self._tokens_per_step(),
            after_step=self.observing.after_step,
            event=self.event,
            say=self.say,
        )
        driver.every(manifest.timing.heartbeat_period, self._swarm_tick)
        redial = Redialer(self.dht_peer.dht, opts.initial_peers, peer_id)  # a restarted bootstrap (#31)
        driver.every(FIRST_BACKOFF, lambda: redial.tick(time.monotonic()))
        self.saver = ReplicaSaver(self.state, self.peer, driver, self.clock, last_in_sync, self.event)
        driver.every(opts.persist_every, self.saver.save)
        driver.every(self.display.period(opts.progress_every), self.upkeep.progress)
        self.observing.attach(
            driver, self.peer, built_model.corpus.eval, opts.device, self.ledger, self._counts, self.event
        )
        self.upkeep.bind(
            self.peer,
            view=self._view,
            counts=self._counts,
            guard=self.guard,
            accepts=driver.accepts,
            ledger=self.ledger,
            observing=self.observing,
        )

    def _announce_start(self, built_model: BuiltModel, startup: dict) -> None:
        """The `start` event (with the restart costs), the peer's id and addresses, the metrics server, and
        the line that says the peer joined."""
        opts, manifest = self.options, self.manifest
        peer_id = self.dht_peer.peer_id
        self.event(
            "start",
            peer_id=peer_id,
            run_id=manifest.run_id,
            manifest_hash=manifest.manifest_hash,
            restored=built_model.restored,
            versions=list(built_model.replica.versions()),
            addresses=list(self.addresses),
            startup={**startup, "total": self._since_launch()},
        )
        self.say(f"peer id: {peer_id}")
        for address in self.dht_peer.visible_addresses():
            self.say(f"address: {address}")
        if opts.metrics_port:
            self.metrics = MetricsServer(make_registry(self.snapshot), opts.metrics_host, opts.metrics_port)
            self.say(f"metrics: {self.metrics.url}")
        plan = built_model.plan
        self.say(
            f"joined run {manifest.run_id} (manifest {manifest.manifest_hash}), "
            f"{plan.num_fragments} fragments, {sum(plan.sizes())} parameters, device {opts.device}"
        )

    def _since_launch(self) -> float | None:
        """Seconds since this process started, or since it took over as a hot spare."""
        if self.takeover is not None:
            return round(time.monotonic() - self.takeover.promoted_at, 2)
        return seconds_since_launch()

    def _catch_up(self, now: float, last_in_sync: float) -> None:
        """`last_in_sync`: the restored state's (0 for a fresh replica); the saver's own copy belongs to
        the I/O thread, which writes the saves."""
        assert self.peer is not None and self.driver is not None
        away = now - last_in_sync if last_in_sync > 0 else math.inf
        fields = catch_up_at_start(self.driver, self.peer, now, away, CATCH_UP_SECONDS)
        if fields is None:  # anti-entropy catches up later
            self.event("catch_up_failed", error=f"no catch-up within {CATCH_UP_SECONDS:.0f} s")
            self.say("catch-up unfinished; training from where the replica is, repairing as we go")
            return
        self.event("catch_up", **fields)
        how = f"away {away:.1f} s" if not math.isinf(away) else "fresh state"
        self.say(
            f"caught up by {fields['mode']} ({how}): versions {fields['before']} -> {fields['after']} "
            f"in {fields['seconds']:.1f} s"
        )

    # ---- the loop (the training thread) ------------------------------------------------------------

    def run(self) -> int:
        """start, loop until `stop`, shut down; returns the exit status (0, or `EXIT_DHT_DIED`)."""
        try:
            self.start()
            self.loop()
        finally:
            self.shutdown()
        return self.exit_status

    def loop(self) -> None:
        assert self.training is not None and self.driver is not None
        self.driver.call(self._swarm_tick, timeout=self.options.dht_timeout + 1.0)  # announce ourselves first
        self.training.run()

    def _tokens_per_step(self) -> int:
        ranks = self.island.world_size if self.island is not None else 1
        return self.manifest.diloco.batch_size * self.manifest.model.block_size * ranks

    def _view(self) -> TrainingView | None:
        """The training thread's last published numbers (immutable)."""
        return self.training.view if self.training is not None else None

    def _counts(self):  # noqa: ANN202 - the transport's immutable counts, None before it exists
        return self.p2p.counts if self.p2p is not None else None

    # ---- the owner thread's jobs -------------------------------------------------------------------

    def _swarm_tick(self) -> None:
        """Heartbeat, election and anti-entropy (`Peer` on a `Tick`); DHT failures come back as errors.
        A peer whose DHT process died can neither renew a lease nor see the swarm: it stops (its state is
        saved), with `EXIT_DHT_DIED`, so that its supervisor restarts it whole."""
        peer, driver = self.peer, self.driver
        assert peer is not None and driver is not None
        if self.dht_peer is not None and not self.dht_peer.alive():
            if self.exit_status == 0:
                self.exit_status = EXIT_DHT_DIED
                self.event("dht_died")
                self.say("error: the DHT process died; stopping (state saved) so that a restart rejoins")
                self.stop.set()
            return
        ranks = self.island.world_size if self.island is not None else None
        driver.swarm_tick(self.upkeep.heartbeat_fields(self.clock.now(), self.addresses, ranks))

    # ---- events, progress, persistence -------------------------------------------------------------

    def event(self, kind: str, **fields) -> None:
        if self.state is not None:
            self.state.event(kind, t=self.clock.now(), **fields)

    def say(self, line: str) -> None:
        self.display.say(line)

    def snapshot(self) -> NodeSnapshot | None:
        """A fresh `NodeSnapshot` (metrics scrapes, from the owner thread); the last one if it is busy."""
        if self.driver is None or self.peer is None:
            return self.upkeep.last_snapshot
        try:
            return self.driver.call(self.upkeep.take_snapshot, timeout=1.0)
        except Exception:
            return self.upkeep.last_snapshot

    # ---- shutdown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release the lease, flush sends, persist, stop transport and DHT; safe after a failed start.

        Bounded for peers that stop together (their DHT requests to each other then time out): the
        owner thread gets `dht_timeout` + 1 s to give up the role (the released lease is stored on the
        I/O thread, which the driver's stop waits for), flushing gets what is left of
        `SHUTDOWN_SECONDS`, and transport and DHT get `TEARDOWN_SECONDS` each, after the replica is
        persisted.
        """
        deadline = time.monotonic() + SHUTDOWN_SECONDS
        peer, driver = self.peer, self.driver
        released = False
        finish_island(self.learner)
        if driver is not None:
            answer: concurrent.futures.Future = concurrent.futures.Future()
            try:
                driver.post(fx.Stopping(self.clock.now(), answer))
                released = bool(answer.result(timeout=self.options.dht_timeout + 1.0))
            except Exception as exc:
                log.warning("could not give up the role cleanly: %r", exc)
            self.guard.detach()
            saved = driver.call(self.saver.save, timeout=self.options.dht_timeout) if self.saver else None
            driver.stop(timeout=self.options.dht_timeout + 1.0)  # waits for the I/O thread (lease, save)
            if saved is not None and not saved.done():
                log.warning("replica save still running at shutdown")
        flush_timeout = min(self.options.flush_timeout, max(0.5, deadline - time.monotonic()))
        flushed = self.p2p.flush(flush_timeout) if self.p2p is not None else True
        if self.metrics is not None:
            self.metrics.close()
        if self.observing is not None:
            self.observing.close()
        self.display.stop()
        if peer is not None:
            self.event(
                "stopped",
                step=self.learner.step if self.learner else 0,
                versions=list(peer.replica.versions()),
                digest=peer.replica.digest(),
                released_lease=released,
                flushed=flushed,
            )
        if self.p2p is not None:  # the state is on disk: what follows only stops processes and threads
            self.p2p.close(timeout=TEARDOWN_SECONDS)
        if self.dht_peer is not None:
            self.dht_peer.shutdown(timeout=TEARDOWN_SECONDS)
        if self.ledger is not None:
            self.ledger.close()
        if self.state is not None:
            self.state.close()
        if peer is not None:
            self.say(
                f"stopped: versions {list(peer.replica.versions())}, digest {peer.replica.digest()[:16]}"
                f"{', lease released' if released else ''}"
            )
