"""A swarm peer as a state machine: events in, intents out, one owner.

`Peer.handle(event)` is the only entry point; it changes the peer's state and returns the intents
(`swarm.effects`) its driver must perform. The peer never does I/O and never runs on two threads:
its driver (`swarm.driver`) feeds it events one at a time, from timers (`Tick`), inbound frames and
requests, the training thread (`DeltaReady`) and finished I/O (`TaskResult`, `DeltaReplied`).
The same class and driver run the real node (hivemind DHT, libp2p) and the in-process swarm.

Its parts: `Membership` (heartbeats, leases, the election), `UpdateBook` (checking and applying updates,
the replay log), `Repair` (catch-up, snapshots, reconciliation, as tasks), `Outbox` (the learner's
deltas out), `SynchronizerRole` (the term this peer holds), `HolderWatch` (fast succession) and `Handover`
(a new holder's check for updates it lacks); the membership and the last three once per synchronizer
shard (`swarm.election.seats`; with S = 1 one seat, the unsharded peer). A refused update or a lagging
fragment becomes a `RepairNeeded`, which the peer runs as one task per fragment. `Spreading` relays applied
updates onward, as `swarm.relay` decides.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import shards
from p2p_diloco.protocol.election import ElectionDecision
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.gather import GatherTag
from p2p_diloco.protocol.loss_score import LossMeter
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election.handover import Handover
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.election.phase import Phase
from p2p_diloco.swarm.election.seats import Seat, busy, seat_of_delta
from p2p_diloco.swarm.election.succession import HolderWatch
from p2p_diloco.swarm.election.underway import UnderwayGate
from p2p_diloco.swarm.journal import Journal, PeerContext
from p2p_diloco.swarm.outbox import Outbox
from p2p_diloco.swarm.relay import Relay
from p2p_diloco.swarm.repair import Repair
from p2p_diloco.swarm.serving import Serving
from p2p_diloco.swarm.spreading import Spreading
from p2p_diloco.swarm.synchronizer import Synchronizer, SynchronizerRole
from p2p_diloco.swarm.tasks import Tasks
from p2p_diloco.swarm.updates import UpdateBook, UpdateSource
from p2p_diloco.swarm.vouching import Ahead
from p2p_diloco.wire.frames import InboundDelta
from p2p_diloco.wire.records import HeartbeatInfo
from p2p_diloco.wire.replies import Reply, ReplyStatus
from p2p_diloco.wire.signing import PeerKeys


class Peer:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        plan: FragmentPlan,
        replica: GlobalReplica,
        *,
        shapes: dict[str, tuple[int, ...]],
        keys: PeerKeys,
        embedding_names: Collection[str] = (),
        has_learner: bool = True,
        may_sync: bool = True,
        reachable: bool = True,
        loss_probe: LossMeter | None = None,
    ):
        self.peer_id = peer_id
        self.manifest = manifest
        self.plan = plan
        self.replica = replica
        self.shapes = shapes
        self.embedding_names = frozenset(embedding_names)
        self.has_learner = has_learner
        self.may_sync = may_sync and has_learner
        self.reachable = reachable
        self._out: list[fx.Intent] = []
        emit = self._out.append
        self.journal = Journal(peer_id, emit)
        self.context = ctx = PeerContext(peer_id, manifest, plan, replica, self.journal, emit)
        self.tasks = Tasks(emit, self.journal)
        self.spawn = self.tasks.spawn  # run a task until it first needs I/O (`swarm.tasks`)
        self.robust = RobustGuard.from_manifest(manifest)  # shared by every synchronizer term of this peer
        self.robust.loss_probe = loss_probe
        first_args = (peer_id, manifest, plan.num_fragments, self.journal, self.robust.standing)
        self.membership = Membership(*first_args)  # shard 0's, which knows every shard's (`for_fragment`)
        self.book = UpdateBook(ctx, self.robust, keys, self.membership, has_learner=has_learner)
        self.serving = Serving(ctx, self.book, self.membership)
        self.repair = Repair(ctx, self.book, self.membership, self.serving, has_learner=has_learner)
        self.outbox = Outbox(peer_id, manifest, self.journal, emit, keys.signer, has_learner=has_learner)
        self.repair.reloaded = self.outbox.on_reload  # a snapshot replaced a fragment
        self.book.merged = self._merged  # every applied update, replayed ones included
        self.underway = UnderwayGate(
            peer_id, manifest, keys.check, self.journal, distrusted=self.book.vouchers.caught
        )
        self.relay = Relay.for_run(peer_id, manifest)
        self.spreading = Spreading(
            ctx,
            self.book,
            self.membership,
            self.outbox,
            self.relay,
            self.spawn,
            self._repair,
            self.underway.witness,
        )
        self.seats = [self._seat(shard, first_args) for shard in range(manifest.diloco.synchronizer_shards)]
        self.handover, self.role, self.watch = self.seats[0].handover, self.seats[0].role, self.seats[0].watch
        self._electing = False  # an election round's DHT read is in flight
        self._now = float("-inf")  # the latest time an event brought (tasks' results carry none)
        self._sync_due: float | None = None  # the last `SyncDue` sent

    def _seat(self, shard: int, first_args: tuple) -> Seat:
        """Shard `shard`'s seat (`swarm.election.seats`): its membership (shard 0's is the peer's own),
        handover, synchronizer role and successor's watch."""
        first, ctx, count = self.membership, self.context, self.manifest.diloco.synchronizer_shards
        membership = first if shard == 0 else Membership(*first_args, shard=shard, first=first)
        handover = Handover(ctx, membership, self.repair, self.spawn)
        role = SynchronizerRole(
            ctx,
            self.shapes,
            self.embedding_names,
            self.robust,
            self.book,
            self.outbox,
            membership,
            handover,
            self.relay,
        )
        elect = functools.partial(self.elect, shard=shard)
        watch = HolderWatch(self.peer_id, membership, self.journal, self.spawn, elect)
        fragments = frozenset(shards.fragments_of(shard, count, self.plan.num_fragments))
        return Seat(shard, fragments, membership, role, handover, watch, ctx.emit, self.manifest.timing)

    # ---- the entry point ---------------------------------------------------------------------------

    def handle(self, event: fx.Event) -> list[fx.Intent]:
        match event:
            case fx.Tick(kind=fx.TickKind.SWARM):
                self._swarm_tick(event)
            case fx.Tick(kind=fx.TickKind.SYNC):
                self.sync_tick(event.now, sync_seconds=event.sync_seconds)
            case fx.DeltaArrived():
                self._emit(
                    fx.Respond(event.answer, self._delta_arrived(event.sender, event.frame, event.now))
                )
            case fx.UpdateArrived():
                self.spawn(
                    self._receive_update(event.sender, event.frame, event.now), self._respond(event.answer)
                )
            case fx.RelayArrived():
                task = self.spreading.receive(event.sender, event.frame, event.now)
                self.spawn(task, self._respond(event.answer))
            case fx.UpdatesRequested():
                frames = self.serving.serve_updates(event.requester, event.fragment, event.after_version)
                self._emit(fx.Respond(event.answer, frames))
            case fx.SnapshotRequested():
                self._emit(
                    fx.Respond(event.answer, self.serving.serve_snapshot(event.requester, event.fragment))
                )
            case fx.DeltaReady():
                self._route_delta(event)
            case fx.DeltaReplied():
                self.outbox.on_reply(event)
                for seat in self.seats:
                    seat.watch.on_delta_reply(event)
            case fx.TaskResult():
                self.tasks.resume(event.task, event.value, event.error)
            case fx.CatchUpRequested():
                self.spawn(self.repair.catch_up(event.now, replay=event.replay), self._respond(event.answer))
            case fx.Stopping():
                released = self._stop(event.now)
                if event.answer is not None:
                    self._emit(fx.Respond(event.answer, released))
            case _:
                raise TypeError(f"not a peer event: {event!r}")
        self._now = max(self._now, getattr(event, "now", self._now))
        self._schedule_sync(force=isinstance(event, fx.Tick) and event.kind == fx.TickKind.SYNC)
        return self.flush()

    def _schedule_sync(self, *, force: bool) -> None:
        """Tell the driver when the next sync tick is due (`SyncDue`), when that changed or a tick was
        just spent: the peer is woken at its next deadline rather than polled."""
        due = min((at for seat in self.seats if (at := seat.wake_at(self._now)) is not None), default=None)
        if force or due != self._sync_due:
            self._sync_due = due
            self._emit(fx.SyncDue(due))

    def flush(self) -> list[fx.Intent]:
        """The intents produced since the last call (`handle` returns them; after `spawn` outside it)."""
        out = list(self._out)
        self._out.clear()
        return out

    def _emit(self, intent: fx.Intent) -> None:
        self._out.append(intent)

    def _respond(self, answer: fx.Answer | None) -> Callable[[Any], None]:
        """A task's completion callback that answers `answer` (if any) with the task's result."""
        return lambda value: None if answer is None else self._emit(fx.Respond(answer, value))

    # ---- swarm tick: heartbeat, election, anti-entropy ----------------------------------------------

    def heartbeat_info(self, **fields: Any) -> HeartbeatInfo:
        return HeartbeatInfo(
            role="synchronizer" if self.sync else ("learner" if self.has_learner else "observer"),
            may_sync=self.may_sync,
            reachable=self.reachable,
            versions=self.replica.versions(),
            term_seen=self.membership.term_seen,
            digest=self.replica.digest()[:16],
            tips=tuple((tip.term, tip.checksum) for tip in self.book.tips()),
            shard_terms=tuple(seat.membership.term_seen for seat in self.seats[1:]),
            **fields,
        )

    def _swarm_tick(self, tick: fx.Tick) -> None:
        self._emit(self.membership.heartbeat_record(self.heartbeat_info(**tick.heartbeat_fields), tick.now))
        self.outbox.expire(tick.now)
        proof = self.underway.publish(self.book.log, self.plan.num_fragments, tick.now)
        if proof is not None:
            self._emit(proof)
        if not self._electing:  # a slow DHT read (a frozen node) must not pile up reads behind it
            self.spawn(self._election_round(tick.now))

    def _election_round(self, now: float) -> fx.Task:
        self._electing = True
        try:
            records = yield self.membership.read_swarm(self.underway.key if self.underway.reading else None)
        finally:
            self._electing = False
        views = self.membership.ingest_all(records)
        self.underway.ingest(records.underway)
        for seat, view in zip(self.seats, views, strict=True):
            self.elect(view, max(now, records.now), shard=seat.shard)  # on the time the records were read by
            seat.watch.probe_if_successor()
            if seat.sync is not None:
                for info in self.membership.read_peers.values():
                    if info.step_time > 0:
                        seat.sync.observe_step_time(info.step_time)
        self.serving.refresh(now)
        for fragment, winner, sources, decision in self.repair.due_repairs(now):
            reconcile = fx.RepairKind.RECONCILE
            self._repair(fx.RepairNeeded(reconcile, fragment, tuple(sources), theirs=winner, proof=decision))

    def _receive_update(self, sender: str, frame: bytes, now: float) -> fx.Task:
        """A pushed update: `UpdateBook.accept` (which tells the outbox what it merged), then what its
        verdict asks for: relay it on, or repair a fragment it does not follow."""
        verdict = yield from self.book.accept(frame, sender, UpdateSource.PUSHED, now)
        if verdict.record is not None:
            self.underway.witness(verdict.record)
        if verdict.reply.status == ReplyStatus.APPLIED and verdict.record is not None:
            self.spreading.spread(verdict.record, hop=1, now=now, relayed=False)
        elif verdict.repair is not None:
            self._repair(verdict.repair)
        return verdict.reply

    def _repair(self, needed: fx.RepairNeeded) -> None:
        """Start the repair task `needed` names, unless one for its fragment runs already."""
        if needed.fragment in self.repair.busy:
            return
        self.repair.busy.add(needed.fragment)
        self.spawn(self.repair.task_for(needed), lambda _: self.repair.busy.discard(needed.fragment))

    def _catch_up(self, fragment: int, target: int, sources: Collection[str], why: str) -> None:
        """The holder lacks versions of `fragment` that others hold: replay them (each record checked)."""
        if fragment in self.repair.busy:
            return
        self.journal.note(
            f"holder behind on fragment {fragment} (v{self.replica.version(fragment)} < v{target}, {why}): "
            f"catching up from {', '.join(sources)}"
        )
        self._repair(fx.RepairNeeded(fx.RepairKind.CATCH_UP, fragment, tuple(sources), target=target))

    def elect(self, view, now: float, shard: int = 0) -> ElectionDecision:
        """Run `shard`'s election on `view` and move its seat (`Seat.elected`). Versions that trusted tips
        of live peers show count as verified, so a peer that missed updates knows it lags; a holder
        catches such fragments up before merging."""
        seat = self.seats[shard]
        seat.read(view, now)
        role, handover, membership = seat.role, seat.handover, seat.membership
        ahead: dict[int, Ahead] = {}
        view = self.underway.election_view(view, self.replica.versions())  # no fresh start of a run under way
        if role.sync is not None or membership.elects():
            # what only a claim's eligibility and a holder's catch-up need: a peer that may never claim
            # follows the lease it reads, and skips the election and the per-fragment trust rules (#40)
            ceiling = tuple(membership.for_fragment(p).term_seen for p in range(self.plan.num_fragments))
            ahead = self.book.trusted_ahead(membership.read_peers, self.peer_id, ceiling)
            decision = membership.decide(
                view,
                now,
                role.sync.rounds_done if role.sync else 0,
                verified_newest=self.book.verified_newest({p: a.winner.version for p, a in ahead.items()}),
                own_versions=self.replica.versions(),
                busy=busy(self.seats, seat, view, now),
                checks=seat.checks(self.underway.claim_wait()),
            )
        else:
            decision = membership.follow_only(view, now)
        if seat.elected(decision, now, self.may_sync).after == Phase.STOPPING:
            return decision
        holder = membership.holder
        self.outbox.follow((holder, membership.holder_term) if holder is not None else None, seat.fragments)
        if role.sync is not None:  # never publish from behind: those rounds wait for the catch-up
            for fragment, found in ahead.items():
                if fragment in seat.fragments and handover.wait_for(fragment, found.winner.version, now):
                    self._catch_up(fragment, found.winner.version, found.sources, why="trusted tips")
        return decision

    def _stop(self, now: float) -> bool:
        """Shutdown: every seat moves to `Phase.STOPPING` (`Seat.stop`): a holder merges its open rounds
        that have a quorum (the driver flushes their pushes before the transport closes), then releases its
        lease; no seat claims again. Deltas of rounds below quorum go back to their learners when the next
        holder is known."""
        self.may_sync = False
        released = False
        for seat in self.seats:
            released = seat.stop(now) or released
            self.outbox.follow(None, seat.fragments)
        return released

    @property
    def stopping(self) -> bool:
        """Whether `Stopping` arrived: every seat is then in `Phase.STOPPING`."""
        return all(seat.phase == Phase.STOPPING for seat in self.seats)

    def phases(self) -> tuple[Phase, ...]:
        """Each seat's phase, shard 0's first."""
        return tuple(seat.phase for seat in self.seats)

    def sync_tick(
        self, now: float, *, sync_seconds: float = 0.0, cap: float | None = None
    ) -> list[UpdateRecord]:
        published = []
        for seat in self.seats:
            published += seat.role.tick(now, sync_seconds=sync_seconds, cap=cap)
        return published

    def _delta_arrived(self, sender: str, frame: bytes, now: float) -> Reply:
        """A delta from another peer; an accepted one is counted under its shard and term
        (`DeltaAccepted`)."""
        reply, seat = self._handle_delta(sender, frame, now)
        if reply.ok:
            sync = seat.sync
            self._emit(
                fx.DeltaAccepted(seat.shard, sync.term if sync is not None else seat.membership.term_seen)
            )
        return reply

    def _handle_delta(self, sender: str, frame: bytes, now: float) -> tuple[Reply, Seat]:
        """The one place a delta frame is decoded (`InboundDelta`); the seat of its fragment's shard
        checks and offers the decoded delta."""
        delta = InboundDelta.decode(frame, max_bytes=self.manifest.wire.max_message_bytes)
        seat = seat_of_delta(self.seats, delta)
        reply = seat.role.handle_delta(sender, delta, now)
        sync = seat.sync
        if sync is not None and sync.ahead_hints:
            # one learner's word: caught up from it (every record checked), but no round waits for it
            for fragment, learner in sorted(sync.ahead_hints.items()):
                self._catch_up(
                    fragment, self.replica.version(fragment) + 1, [learner], why="a delta anchored ahead"
                )
            sync.ahead_hints.clear()
        return reply, seat

    # ---- learner side ------------------------------------------------------------------------------

    def _merged(self, record: UpdateRecord, old_global: fx.Tensors, new_global: fx.Tensors) -> None:
        """An applied update: the outbox settles the delta in flight it merged and tells the learner; a sparse
        round that left this peer's delta out of its gather set (`protocol.gather`) refuses it as a reply
        would, so the outbox releases it and its work goes out again with the learner's next delta of that
        fragment."""
        self.outbox.on_applied(record, old_global, new_global)
        seq = record.left_out_seq(self.peer_id)
        if seq is not None:
            detail = f"fragment {record.fragment} v{record.to_version} listed {len(record.deltas)} deltas"
            reply = Reply.refused(GatherTag.NOT_GATHERED, detail)
            self.outbox.on_reply(
                fx.DeltaReplied(record.leader, record.term, record.fragment, seq, reply, self._now)
            )

    def _route_delta(self, ready: fx.DeltaReady) -> None:
        frame = self.outbox.route(ready)
        if frame is None:
            return
        send = self.outbox.send_intent(ready.fragment, frame)
        if send.to == self.peer_id:  # the synchronizer's own work: no network
            reply, _ = self._handle_delta(self.peer_id, frame, ready.now)
            self.outbox.on_reply(
                fx.DeltaReplied(send.to, send.term, send.fragment, send.seq, reply, ready.now)
            )
        else:
            self._emit(send)

    # ---- read-only views for telemetry and tests ----------------------------------------------------

    @property
    def sync(self) -> Synchronizer | None:
        """The `Synchronizer` of the term this peer holds (of the first shard it holds); None while it holds
        no lease."""
        return next((seat.sync for seat in self.seats if seat.sync is not None), None)

    @property
    def rejections(self):
        return self.journal.rejections

    @property
    def rejections_by_sender(self):
        return self.journal.rejections_by_sender

    @property
    def decisions(self):
        return self.journal.decisions

    @property
    def live_peers(self):
        return self.membership.live_peers

    @property
    def term_seen(self) -> int:
        return self.membership.term_seen

    @property
    def holder(self) -> str | None:
        return self.membership.holder

    @property
    def updates_applied(self) -> int:
        return self.book.applied

    @property
    def failovers_seen(self) -> int:
        return sum(seat.membership.failovers_seen for seat in self.seats)
