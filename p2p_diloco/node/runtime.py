"""`PeerNode`: the real peer process behind `p2p-diloco join`, one `Peer` on hivemind's DHT and libp2p.

Lifecycle (`run`):

1. start: check the device, open the state directory, fork the DHT node, build model, plan, replica
   (the persisted one if there is one) and optimizer while p2pd starts, wait for the DHT node (a restart
   of this peer from its own state directory skips hivemind's identity check: `identity_check_needed`),
   start the transport, build learner and `Peer`; then catch up:
   a peer away less than `timing.rejoin_grace` replays the update logs of its peers, any other peer
   (fresh, or away longer) downloads snapshots of the fragments it lacks, spread over several peers.
2. loop: the main thread trains: one inner step, then, when a delta is due, `prepare_delta` (the send
   thread compresses and sends it with `send_prepared` while the next step runs). After
   `--max-steps` it stops training but keeps serving the swarm. The swarm thread runs `heartbeat`,
   `election_tick` and `repair_tick` every heartbeat period (so lease renewals never wait for a long
   training step), follows the ledger, persists the replica and prints progress lines; the sync
   thread closes the synchronizer's rounds (`sync_tick`) as they become ready, so merging and
   publishing run beside the inner steps.
3. shutdown (SIGINT/SIGTERM sets `stop`; the current step finishes first): stop the swarm thread,
   release the lease if held, flush in-flight sends, persist, stop the transport and the DHT; each
   step bounded so SIGTERM -> exit stays near `SHUTDOWN_SECONDS` (`PeerNode.shutdown`).

Threads: every call into the `Peer` holds one `PeerLock`; inbound requests and send replies reach it
only through `guard`; DHT and fetch I/O run with the lock released (`node.guard`). The inner step
itself runs without the `PeerLock`, under the learner's own lock only, so pushed updates are checked
and applied to the replica while the model trains; their adoption into the model is queued until the
step's end (`swarm.learner`), so no thread waits for a step (locks are always taken in the order peer
lock, then learner lock). The clock is hivemind's DHT time, since DHT records expire at absolute times.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TextIO

import torch

from p2p_diloco.model.data import BatchSampler, load_corpus
from p2p_diloco.model.gpt import build_model, embedding_parameter_names, make_inner_optimizer
from p2p_diloco.net.dht_store import DhtKeyValueStore, DhtPeer, PendingDht, identity_check_needed, start_dht
from p2p_diloco.net.identity import peer_id_of
from p2p_diloco.net.transport import P2PTransport
from p2p_diloco.node.guard import DhtClock, GuardedHandlers, LockedTransport, PeerLock, UnlockedKeyValueStore
from p2p_diloco.node.island import Island, IslandLearner, finish_island, island_sampler
from p2p_diloco.node.ledger import ContributionLedger
from p2p_diloco.node.metrics import MetricsServer, make_registry
from p2p_diloco.node.options import NodeOptions, check_device
from p2p_diloco.node.reporting import (
    NodeSnapshot,
    Telemetry,
    make_display,
    rejection_counts,
    seconds_since_launch,
)
from p2p_diloco.node.state import StateDir
from p2p_diloco.protocol import election
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.peer import Peer, PreparedDelta
from p2p_diloco.wire.frames import decode_update
from p2p_diloco.wire.records import encode_lease

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.05  # how often a peer that does not train (max steps reached) checks for work
SYNC_POLL_SECONDS = 0.02  # how often the sync thread polls the synchronizer's rounds
SHUTDOWN_SECONDS = 10.0  # SIGTERM -> exit target of `PeerNode.shutdown` (a lease release may add to it)
TEARDOWN_SECONDS = 2.0  # grace for the transport and the DHT process to stop after the state is saved


def update_fields(record: UpdateRecord) -> dict[str, object]:
    """What `published` and `applied` events say of an update (the demo's books read them)."""
    return {
        "fragment": record.fragment,
        "version": record.to_version,
        "term": record.term,
        "leader": record.leader,
    }


class PeerNode:
    """One swarm peer in this process (module docstring). `stop` ends `run` after the current step."""

    def __init__(
        self,
        options: NodeOptions,
        *,
        stop: threading.Event | None = None,
        out: TextIO = sys.stdout,
        island: Island | None = None,
    ):
        self.options = options
        self.island = island  # set: this process is rank 0 of an island (node/island.py)
        self.manifest = options.manifest
        self.stop = stop or threading.Event()
        self.out = out
        self.lock = PeerLock()
        self.clock = DhtClock()
        self.state: StateDir | None = None
        self.dht_peer: DhtPeer | None = None
        self.p2p: P2PTransport | None = None
        self.guard: GuardedHandlers | None = None
        self.peer: Peer | None = None
        self.learner: Learner | None = None
        self.training = True
        self.finish_training = threading.Event()  # set (e.g. by SIGUSR1) to stop training, keep serving
        self.tick_errors: Counter[str] = Counter()
        self.telemetry = Telemetry(self.manifest)
        self.ledger: ContributionLedger | None = None
        self.metrics: MetricsServer | None = None
        self.display = make_display(out, self.manifest.run_id, options.display)
        self._last_snapshot: NodeSnapshot | None = None
        self.bytes = ByteCounter("")
        self.loop_started = 0.0  # monotonic start of the training loop (demo accounting)
        self._blocked = 0.0
        self.sync_seconds = 0.0
        self.last_in_sync = 0.0
        self.last_connected = 0.0
        self._swarm_thread: threading.Thread | None = None
        self._sync_thread: threading.Thread | None = None
        self._send_thread: threading.Thread | None = None
        self._outbox: queue.SimpleQueue[PreparedDelta] = queue.SimpleQueue()  # for the send thread
        self._swarm_stop = threading.Event()  # stops the swarm, sync and send threads
        self._persist_lock = threading.Lock()  # one save at a time (swarm thread, shutdown); before `lock`

    # ---- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        opts, manifest = self.options, self.manifest
        startup = {"imports": seconds_since_launch()}  # restart costs, in the `start` event
        check_device(opts.device)
        torch.set_num_threads(opts.threads)
        self.state = StateDir(opts.state_dir, manifest)
        saved = self.state.read_peer_state()
        self.ledger = ContributionLedger(self.state.path, manifest)
        # hivemind forks its DHT process here: before corpus and model exist, the child inherits (and
        # copies on write) less; measured 190 -> 138 MiB PSS for the DHT child of a tiny-model peer.
        # The child also inherits the state directory's lock, so while it lives no successor starts.
        pending = self._start_dht(saved.peer_id if saved is not None else None)
        began = time.monotonic()
        try:  # the CPU work (torch imports its compiler stack for the optimizer) overlaps p2pd's start
            corpus = load_corpus(manifest.data)
            model = build_model(manifest.model)
            shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
            plan = plan_fragments(
                list(shapes.items()), manifest.diloco.fragments, manifest.diloco.fragment_pattern
            )
            replica = self.state.load_replica(plan)
            restored = replica is not None
            if replica is None:
                replica = GlobalReplica(
                    plan, {name: p.detach().clone() for name, p in model.named_parameters()}
                )
            model.to(opts.device)
            optimizer = make_inner_optimizer(
                model, manifest.diloco.inner_lr, manifest.diloco.inner_weight_decay
            )
        except BaseException:
            pending.abort()
            raise
        built = time.monotonic()
        self.dht_peer = pending.wait()
        startup["build"], startup["dht_wait"] = round(built - began, 2), round(time.monotonic() - built, 2)
        self.last_in_sync = saved.last_in_sync if saved is not None and restored else 0.0

        peer_id = self.dht_peer.peer_id
        self.guard = GuardedHandlers(self.lock, on_applied=self._on_update_applied)
        self.bytes = ByteCounter(peer_id)
        self.p2p = P2PTransport(
            self.dht_peer.dht,
            run_id=manifest.run_id,
            manifest_hash=manifest.manifest_hash,
            handlers=self.bytes.counting_handlers(self.guard),
            max_frame_bytes=manifest.wire.max_message_bytes,
            allowed_peers=manifest.allowlist or None,
            fetch_timeout=opts.fetch_timeout,
            send_timeout=opts.fetch_timeout,
        )
        seed = int.from_bytes(hashlib.blake2b(f"{peer_id}:{time.time_ns()}".encode(), digest_size=7).digest())
        sampler = BatchSampler(
            corpus.train,
            block_size=manifest.model.block_size,
            batch_size=manifest.diloco.batch_size,
            shard=0,
            num_shards=1,
            seed=seed,
        )
        if self.island is None:
            self.learner = Learner(
                peer_id, manifest, plan, replica, model, optimizer, sampler, device=opts.device
            )
        else:  # the island's ranks sample shards of one seed and step together
            sampler = island_sampler(corpus.train, opts, self.island, self.island.share_seed(seed))
            self.learner = IslandLearner(
                self.island, peer_id, manifest, plan, replica, model, optimizer, sampler,
                device=opts.device, state_dir=opts.state_dir,
            )  # fmt: skip
            self.telemetry.tokens_per_step *= self.island.world_size
        with self.lock:
            self.peer = Peer(
                peer_id,
                manifest,
                plan,
                replica,
                kv=UnlockedKeyValueStore(
                    DhtKeyValueStore(self.dht_peer, timeout=opts.dht_timeout), self.lock
                ),
                transport=LockedTransport(self.bytes.counting_transport(self.p2p), self.lock, self.guard),
                clock=self.clock,
                shapes=shapes,
                embedding_names=embedding_parameter_names(model),
                learner=self.learner,
                may_sync=opts.may_sync,
                reachable=not opts.behind_nat,
                log=self._on_note,
                on_published=self._on_published,
            )
        now = self.clock.now()
        self.event(
            "start",
            peer_id=peer_id,
            run_id=manifest.run_id,
            manifest_hash=manifest.manifest_hash,
            restored=restored,
            versions=list(replica.versions()),
            addresses=self.dht_peer.visible_addresses(),
            startup={**startup, "total": seconds_since_launch()},
        )
        self.say(f"peer id: {peer_id}")
        for address in self.dht_peer.visible_addresses():
            self.say(f"address: {address}")
        if opts.metrics_port:
            self.metrics = MetricsServer(make_registry(self.snapshot), opts.metrics_host, opts.metrics_port)
            self.say(f"metrics: {self.metrics.url}")
        self.say(
            f"joined run {manifest.run_id} (manifest {manifest.manifest_hash}), {plan.num_fragments} fragments, "
            f"{sum(plan.sizes())} parameters, device {opts.device}"
        )
        self._catch_up(now, restored)

    def _start_dht(self, previous_peer_id: str | None) -> PendingDht:
        """Fork the DHT node (`start_dht`); hivemind's identity check only where it is needed.

        A restart of this peer (the state directory we hold the lock of says this key ran here
        before) skips the check: it would spend seconds dialing our own dead predecessor
        (`identity_check_needed`). A key new to this state directory is still checked.
        """
        opts = self.options
        check = identity_check_needed(
            peer_id_of(opts.identity),
            previous_peer_id=previous_peer_id,
            holds_state_dir=self.state is not None,
        )
        nat = (
            # Nobody can dial this peer: serve no DHT requests, reserve relay slots on the initial peers.
            dict(
                client_mode=True,
                use_auto_relay=True,
                force_reachability="private",
                trusted_relays=opts.initial_peers,
            )
            if opts.behind_nat
            else {}
        )
        return start_dht(
            initial_peers=opts.initial_peers,
            identity_path=opts.identity,
            host_maddrs=opts.listen,
            announce_maddrs=opts.announce,
            check_identity=check,
            **nat,
        )

    def _catch_up(self, now: float, restored: bool) -> None:
        assert self.peer is not None
        away = now - self.last_in_sync if restored and self.last_in_sync > 0 else math.inf
        replay = away < self.manifest.timing.rejoin_grace
        before = self.peer.replica.versions()
        started = time.monotonic()
        try:
            with self.lock:
                stats = self.peer.catch_up(now, replay=replay)
        except (TimeoutError, ConnectionError) as exc:  # anti-entropy (repair_tick) catches up later
            self.event("catch_up_failed", error=f"{type(exc).__name__}: {exc}")
            self.say(f"catch-up failed ({exc}); training from versions {list(before)}, repairing as we go")
            return
        seconds = time.monotonic() - started
        after = self.peer.replica.versions()
        mode = "replay" if replay else "snapshot"
        sizes = self.peer.plan.sizes()
        moved = [p for p in range(len(sizes)) if after[p] != before[p]]
        if mode == "snapshot":  # params and momentum, fp32
            stats["bytes"] = sum(8 * sizes[p] for p in moved)
        self.event(
            "catch_up",
            mode=mode,
            away=None if math.isinf(away) else away,
            seconds=seconds,
            before=list(before),
            after=list(after),
            **stats,
        )
        how = f"away {away:.1f} s" if not math.isinf(away) else "fresh state"
        self.say(
            f"caught up by {mode} ({how}): versions {list(before)} -> {list(after)} in {seconds:.1f} s, {stats}"
        )

    # ---- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        """start, loop until `stop`, shut down; returns the exit status (0)."""
        try:
            self.start()
            self.loop()
        finally:
            self.shutdown()
        return 0

    def loop(self) -> None:
        opts = self.options
        self._swarm_tick()  # announce ourselves and learn the holder before the first step
        self.loop_started = time.monotonic()
        self._swarm_thread = threading.Thread(target=self._swarm_loop, name="swarm-ticks", daemon=True)
        self._swarm_thread.start()
        self._sync_thread = threading.Thread(target=self._sync_loop, name="sync-rounds", daemon=True)
        self._sync_thread.start()
        self._send_thread = threading.Thread(target=self._send_loop, name="send-deltas", daemon=True)
        self._send_thread.start()
        while not self.stop.is_set():
            started = time.monotonic()
            if self.training and self._training_done():
                self.training = False
                with self.lock:
                    finish_island(self.learner)  # an island's other ranks stop with the training
            if self.training:
                self._train_step()
            if not self.training:
                self.learner.settle()  # adopt updates queued by other threads: no step does it now
                self.stop.wait(IDLE_POLL_SECONDS)
            elif opts.min_step_time > 0:
                self._pace(started)

    def _pace(self, step_started: float) -> None:
        """Wait out the rest of a paced step (the sync thread keeps closing rounds meanwhile)."""
        self.stop.wait(max(0.0, step_started + self.options.min_step_time - time.monotonic()))

    def _send_loop(self) -> None:
        """Compress and send the deltas the training thread prepared, in order, until stopped."""
        assert self.peer is not None
        while not (self.stop.is_set() or self._swarm_stop.is_set()):
            try:
                prepared = self._outbox.get(timeout=IDLE_POLL_SECONDS)
            except queue.Empty:
                continue
            try:
                with self.lock:
                    self.peer.send_prepared(prepared)
            except Exception:  # a bug: log it, keep sending (the delta times out and is resent)
                log.exception("sending a delta failed")
                self.tick_errors["unexpected"] += 1

    def _sync_loop(self) -> None:
        """Close the synchronizer's rounds as they become ready, until stopped (the sync thread)."""
        while not (self.stop.is_set() or self._swarm_stop.wait(SYNC_POLL_SECONDS)):
            self._sync_tick()

    def _swarm_loop(self) -> None:
        """Until stopped, every heartbeat period: heartbeat, election, repair and the ledger; every
        `--persist-every` s the replica on disk; every `--progress-every` s a progress line. The swarm
        thread, so the training thread never waits for any of them."""
        jobs: list[tuple[float, Callable[[], None]]] = [
            (self.manifest.timing.heartbeat_period, self._swarm_tick_and_ledger),
            (self.options.persist_every, self.persist),
            (self.display.period(self.options.progress_every), self.progress),
        ]
        due = [time.monotonic() + every for every, _ in jobs]
        while not (self.stop.is_set() or self._swarm_stop.is_set()):
            if self._swarm_stop.wait(max(0.0, min(due) - time.monotonic())) or self.stop.is_set():
                return
            for i, (every, job) in enumerate(jobs):
                if time.monotonic() < due[i]:
                    continue
                due[i] = max(due[i] + every, time.monotonic())
                try:
                    job()
                except Exception:  # never let the thread die: the lease would lapse silently
                    log.exception("swarm thread: %s failed", job.__name__)
                    self.tick_errors["unexpected"] += 1

    def _swarm_tick_and_ledger(self) -> None:
        self._swarm_tick()
        self._follow_ledger()

    def _training_done(self) -> bool:
        assert self.learner is not None
        max_steps = self.options.max_steps
        reached = max_steps is not None and self.learner.step >= max_steps
        if reached or self.finish_training.is_set():
            why = f"reached --max-steps {max_steps}" if reached else "asked to finish training"
            self.event("training_stopped", step=self.learner.step, why=why)
            self.say(f"{why}: training stopped at step {self.learner.step}; still serving the swarm")
            return True
        return False

    def _train_step(self) -> None:
        assert self.peer is not None and self.learner is not None
        # a paced (--min-step-time) learner emulates a slower device: its step counts as that long
        paced = (
            max(self.options.min_step_time, self.telemetry.step_time) if self.options.min_step_time else None
        )
        self.learner.train_step(compute_seconds=paced)  # not under the peer lock: module docstring
        if self.learner.delta_pending():  # else nothing to send: no lock handoff
            with self.lock:
                prepared = self.peer.prepare_delta(self.clock.now())
            if prepared is not None:
                self._outbox.put(prepared)  # compressed and sent by the send thread
        self.telemetry.step_finished(time.monotonic())

    def _swarm_tick(self) -> None:
        """Heartbeat, election and anti-entropy; a failing DHT call is counted and retried next period."""
        peer = self.peer
        assert peer is not None
        with self.lock:
            now = self.clock.now()
            try:
                fields = self.telemetry.heartbeat_fields(
                    now, peer, self.learner, self.guard, self.p2p, training=self.training
                )
                if self.island is not None:
                    fields["ranks"] = self.island.world_size
                peer.heartbeat(now, **fields)
                decision = peer.election_tick(now)
                self.last_connected = self.clock.now()  # heartbeat stored and swarm read just now
                if decision.action == election.CLAIM:
                    self.event("claim", term=decision.term, reason=decision.reason)
                peer.repair_tick(now)
            except Exception as exc:  # DHT timeouts, unreachable peers: the next tick tries again
                self.tick_errors[type(exc).__name__] += 1
                self.event("tick_error", error=f"{type(exc).__name__}: {exc}")
                log.warning("swarm tick failed: %r", exc)
            if peer.sync is not None:
                for info in peer.live_peers.values():
                    if info.step_time > 0:
                        peer.sync.observe_step_time(info.step_time)

    def _sync_tick(self) -> None:
        peer = self.peer
        assert peer is not None
        if peer.sync is None:  # checked again under the lock; a learner's sync thread only polls this
            return
        with self.lock:
            if peer.sync is None:
                return
            started = time.monotonic()
            try:
                published = peer.sync_tick(self.clock.now(), sync_seconds=self.sync_seconds)
            except Exception as exc:
                self.tick_errors[type(exc).__name__] += 1
                self.event("sync_error", error=f"{type(exc).__name__}: {exc}")
                log.exception("sync tick failed")
                return
            if published:
                self.sync_seconds = (time.monotonic() - started) / len(published)

    def _on_published(self, record: UpdateRecord) -> None:
        """Every update this peer merged and pushed (sync rounds, and open rounds at the end of a term)."""
        contributors = [peer_id for peer_id, _ in record.contributors]
        self.event("published", **update_fields(record), contributors=contributors)

    # ---- events, progress, persistence -------------------------------------------------------------

    def event(self, kind: str, **fields) -> None:
        if self.state is not None:
            self.state.event(kind, t=self.clock.now(), **fields)

    def say(self, line: str) -> None:
        self.display.say(line)

    def _on_note(self, line: str) -> None:
        prefix = f"[{self.peer.peer_id}] " if self.peer is not None else ""
        text = line.removeprefix(prefix) if prefix else line.split("] ", 1)[-1]
        self.event("note", line=text)
        if self.options.verbose:
            print(text, file=sys.stderr, flush=True)

    def _on_update_applied(self, sender: str, frame: bytes, reply: str) -> None:
        try:
            record = decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
        except Exception:  # it was applied, so it decoded; never let logging break the handler
            return
        self.event("applied", **update_fields(record), source=sender)

    def progress(self) -> None:
        peer, learner = self.peer, self.learner
        assert peer is not None and learner is not None
        with self.lock:
            line = self.telemetry.progress_line(peer, learner, self.guard, self.p2p, training=self.training)
            versions = list(peer.replica.versions())
            snapshot = self._snapshot_locked()
        fields = {**snapshot.event_fields(), **self._counters()}  # the demo's counters win a name clash
        self.event("progress", step=learner.step, loss=learner.last_loss, versions=versions, **fields)
        self.display.show(snapshot, line)

    def _snapshot_locked(self) -> NodeSnapshot:
        assert self.peer is not None
        self._last_snapshot = self.telemetry.snapshot(
            self.peer,
            self.learner,
            self.guard,
            self.p2p,
            training=self.training,
            bytes_sent=self.bytes.sent,
            bytes_received=self.bytes.received,
            ledger=self.ledger.totals if self.ledger is not None else None,
            tick_errors=self.tick_errors,
        )
        return self._last_snapshot

    def snapshot(self) -> NodeSnapshot | None:
        """A fresh `NodeSnapshot` (metrics scrapes); the last one if the peer stays busy for a second."""
        if self.peer is None or not self.lock.acquire(timeout=1.0):
            return self._last_snapshot
        try:
            return self._snapshot_locked()
        finally:
            self.lock.release()

    def _follow_ledger(self) -> None:
        """Record updates applied since the last call (pushed, replayed or our own) in the ledger."""
        if self.peer is None or self.ledger is None:
            return
        if self.peer.replica.versions() == tuple(self.ledger.last_version):  # nothing new: no lock handoff
            return
        with self.lock:
            self.ledger.follow(self.peer.replica.versions(), self.peer.update_log, self.clock.now())

    def _counters(self) -> dict[str, object]:
        """Cumulative goodput counters of this process lifetime (read by `p2p_diloco.demo.accounting`)."""
        learner, peer = self.learner, self.peer
        assert learner is not None and peer is not None
        alive = time.monotonic() - self.loop_started if self.loop_started else 0.0
        return {
            "tokens": learner.tokens_trained,
            "compute_seconds": learner.compute_seconds,
            "compute_merged": learner.compute_merged,
            "blocked_seconds": self._blocked_seconds(alive - learner.compute_seconds),
            "bytes_sent": self.bytes.sent,
            "bytes_received": self.bytes.received,
            "role": "synchronizer" if peer.sync is not None else "learner",
            "term": peer.term_seen,
            "tokens_per_s": self.telemetry.tokens_per_s(self.training),
        }

    def _blocked_seconds(self, not_computing: float) -> float:
        """Loop time not spent in inner steps, kept monotone (paced steps may count more than wall)."""
        if self.training:
            self._blocked = max(self._blocked, not_computing)
        return self._blocked

    def rejection_counts(self) -> Counter[str]:
        return rejection_counts(self.peer, self.guard, self.p2p)

    def persist(self) -> None:
        """Save replica and peer state: one moment of the replica, taken under the lock, written outside it
        (from the swarm thread, and once more at shutdown)."""
        peer, state = self.peer, self.state
        if peer is None or state is None:
            return
        with self._persist_lock:  # taken first: a later save never writes an older moment
            with self.lock:
                now = self.clock.now()
                # in sync while the swarm still sees our last heartbeat as live
                connected = now - self.last_connected < self.manifest.timing.heartbeat_ttl
                replica = peer.replica.frozen()
            try:
                state.save(replica, peer.peer_id, now=now, in_sync=connected, previous=self.last_in_sync)
            except OSError as exc:
                self.event("persist_failed", error=str(exc))
                log.error("could not persist the replica: %s", exc)
                return
            if connected:
                self.last_in_sync = now

    # ---- shutdown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release the lease, flush sends, persist, stop transport and DHT; safe after a failed start.

        Bounded for peers that stop together (their DHT requests to each other then time out): the
        swarm thread gets `dht_timeout` + 1 s to finish its tick (after that it may no longer claim
        the lease and is left behind, a daemon thread), flushing gets what is left of
        `SHUTDOWN_SECONDS`, and transport and DHT get `TEARDOWN_SECONDS` each, after the replica is
        persisted. A synchronizer may add one `dht_timeout` to release its lease.
        """
        deadline = time.monotonic() + SHUTDOWN_SECONDS
        peer = self.peer
        released = False
        self._swarm_stop.set()
        for thread in (self._sync_thread, self._send_thread):  # at most one tick or send to finish
            if thread is not None:
                thread.join(timeout=SHUTDOWN_SECONDS / 4)
        if self._swarm_thread is not None:
            self._swarm_thread.join(timeout=self.options.dht_timeout + 1.0)
            if self._swarm_thread.is_alive() and peer is not None:
                log.warning("swarm tick still running at shutdown; leaving it behind")
                with self.lock:  # its tick may finish after the release below: it must not claim again
                    peer.may_sync = False
        if peer is not None:
            with self.lock:
                finish_island(self.learner)
                released = self._release_lease()
        flush_timeout = min(self.options.flush_timeout, max(0.5, deadline - time.monotonic()))
        flushed = self.p2p.flush(flush_timeout) if self.p2p is not None else True
        if self.metrics is not None:
            self.metrics.close()
        self.display.stop()
        if peer is not None and self.guard is not None:
            with self.lock:
                self.guard.detach()
            self._follow_ledger()
            self.persist()
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

    def _release_lease(self) -> bool:
        peer = self.peer
        assert peer is not None
        lease, sync = peer.my_lease, peer.sync
        peer.sync, peer.my_lease, peer.holder = None, None, None
        if lease is None or sync is None:
            return False
        timing = self.manifest.timing
        released = election.release_lease(lease, self.clock.now(), timing, sync.rounds_done)
        try:
            stored = peer.kv.store(
                peer.lease_key,
                peer.peer_id,
                encode_lease(released),
                election.dht_expiration(released, timing),
            )
        except Exception as exc:
            stored, error = False, f"{type(exc).__name__}: {exc}"
        else:
            error = "" if stored else "the DHT did not confirm the store"
        if not stored:  # the lease then simply lapses after its TTL
            self.event("release_failed", term=lease.term, error=error)
            return False
        self.event("released_lease", term=lease.term, rounds=sync.rounds_done)
        return True


# ---- demo accounting: payload bytes through the transport -----------------------------------------


class ByteCounter:
    """Counts frame bytes this peer sends and receives over the transport (deltas, updates, fetches and
    what it serves); calls to itself and DHT traffic are not counted. Read by the progress events."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.sent = 0
        self.received = 0

    def _count(self, other: str, sent: int = 0, received: int = 0) -> None:
        if other != self.peer_id:
            self.sent += sent
            self.received += received

    def counting_transport(self, inner):  # noqa: ANN001, ANN201 - same interface as `inner`
        counter = self

        class Counting:
            def __getattr__(self, name: str):  # noqa: ANN204
                return getattr(inner, name)

            def send_delta(self, to_peer: str, frame: bytes, on_reply=None) -> None:  # noqa: ANN001
                counter._count(to_peer, sent=len(frame))
                inner.send_delta(to_peer, frame, on_reply)

            def push_update(self, to_peer: str, frame: bytes, on_reply=None) -> None:  # noqa: ANN001
                counter._count(to_peer, sent=len(frame))
                inner.push_update(to_peer, frame, on_reply)

            def fetch_updates(self, from_peer: str, fragment: int, after_version: int) -> list[bytes]:
                frames = inner.fetch_updates(from_peer, fragment, after_version)
                counter._count(from_peer, received=sum(len(f) for f in frames))
                return frames

            def fetch_snapshot(self, from_peer: str, fragment: int) -> bytes:
                frame = inner.fetch_snapshot(from_peer, fragment)
                counter._count(from_peer, received=len(frame))
                return frame

        return Counting()

    def counting_handlers(self, inner):  # noqa: ANN001, ANN201 - same interface as `inner`
        counter = self

        class Counting:
            def __getattr__(self, name: str):  # noqa: ANN204
                return getattr(inner, name)

            def handle_delta(self, sender: str, frame: bytes) -> str:
                counter._count(sender, received=len(frame))
                return inner.handle_delta(sender, frame)

            def handle_update(self, sender: str, frame: bytes) -> str:
                counter._count(sender, received=len(frame))
                return inner.handle_update(sender, frame)

            def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
                frames = inner.serve_updates(requester, fragment, after_version)
                counter._count(requester, sent=sum(len(f) for f in frames))
                return frames

            def serve_snapshot(self, requester: str, fragment: int) -> bytes:
                frame = inner.serve_snapshot(requester, fragment)
                counter._count(requester, sent=len(frame))
                return frame

        return Counting()
