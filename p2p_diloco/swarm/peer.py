"""A swarm peer: a learner (optional), the replica, the update log and the synchronizer role.

Driven by ticks that pass `now` in (heartbeat, election, sync poll, after each inner step) and by the
transport calling its `InboundHandlers` methods. It knows the swarm only through the `KeyValueStore`
and `Transport` interfaces, so the in-process swarm (fake clock, in-memory network) and the real peer
(hivemind DHT and libp2p) run exactly this code. Catching up, repairing and serving the replica
(update-log replay, snapshots, partition reconciliation) live in `swarm.catchup`.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import election, reconcile, robust
from p2p_diloco.protocol.election import LeaseRecord, PeerHeartbeat
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.protocol.replica import (
    APPLY,
    CHECKSUM_MISMATCH,
    DUPLICATE_UPDATE,
    OUT_OF_ORDER,
    GlobalReplica,
)
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.swarm.catchup import REJECT_NOT_ALLOWED, PeerCatchUp
from p2p_diloco.swarm.learner import DueDelta, Learner
from p2p_diloco.swarm.synchronizer import Synchronizer
from p2p_diloco.wire.codec import decode_tensors
from p2p_diloco.wire.frames import (
    decode_delta,
    decode_update,
    encode_update,
)
from p2p_diloco.wire.interfaces import Clock, KeyValueStore, Transport
from p2p_diloco.wire.keys import heartbeat_key, lease_key
from p2p_diloco.wire.records import HeartbeatInfo, RecordError, decode_heartbeat, decode_lease, encode_lease

UPDATE_LOG_LENGTH = 256
IN_FLIGHT_TIMEOUT_LEASES = 4
REJECT_NOT_SYNCHRONIZER = "not synchronizer"
# Refusals that say nothing about the delta, only that the synchronizer cannot take deltas right now
# (net.transport.REPLY_UNREACHABLE, node.guard.REJECT_BUSY and REJECT_NOT_READY): wait a heartbeat period.
TRANSIENT_REFUSALS = frozenset({"transport unreachable", "busy", "not ready"})
MAX_DELTA_HOLD = 300.0
_COOL_DOWN_LEFT = re.compile(r"ignored for ([0-9.]+)s more")


def delta_hold_seconds(reply: str, heartbeat_period: float) -> float:
    """How long to hold further deltas for the synchronizer that refused one with `reply` (0: not at all).

    Without a hold a learner resends the refused work after its next inner step: at tens of steps per
    second a cooled-down or unreachable learner sent the same refused fragment ~10 times a second.
    Held work keeps accumulating and goes out in one delta when the hold ends or the holder changes.
    """
    tag = reply.split(":", 1)[0]
    if tag == robust.COOL_DOWN:
        match = _COOL_DOWN_LEFT.search(reply)
        return min(float(match.group(1)), MAX_DELTA_HOLD) if match else heartbeat_period
    return heartbeat_period if tag in TRANSIENT_REFUSALS else 0.0


@dataclass(frozen=True)
class PreparedDelta:
    """A delta taken at a step boundary (`Peer.prepare_delta`) and the holder it goes to."""

    holder: str
    due: DueDelta


class Peer(PeerCatchUp):
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        plan: FragmentPlan,
        replica: GlobalReplica,
        *,
        kv: KeyValueStore,
        transport: Transport,
        clock: Clock,
        shapes: dict[str, tuple[int, ...]],
        embedding_names: Collection[str] = (),
        learner: Learner | None = None,
        may_sync: bool = True,
        reachable: bool = True,
        log: Callable[[str], None] | None = None,
        on_published: Callable[[UpdateRecord], None] | None = None,
    ):
        self.peer_id = peer_id
        self.manifest = manifest
        self.plan = plan
        self.replica = replica
        self.kv = kv
        self.transport = transport
        self.clock = clock
        self.shapes = shapes
        self.embedding_names = frozenset(embedding_names)
        self.learner = learner
        self.may_sync = may_sync and learner is not None
        self.reachable = reachable
        self._log = log or (lambda line: None)
        self._on_published = on_published or (lambda record: None)
        self.hb_key = heartbeat_key(manifest.run_id, manifest.manifest_hash)
        self.lease_key = lease_key(manifest.run_id, manifest.manifest_hash)
        self.update_log: list[deque[bytes]] = [
            deque(maxlen=UPDATE_LOG_LENGTH) for _ in range(plan.num_fragments)
        ]
        self.sync: Synchronizer | None = None
        self.my_lease: LeaseRecord | None = None
        self.holder: str | None = None
        self.holder_term = 0  # the term of `holder`'s lease
        self.term_seen = 0
        self.last_election = ""
        self.rejections: Counter[str] = Counter()
        self.rejections_by_sender: Counter[tuple[str, str]] = Counter()
        self.decisions: deque[str] = deque(maxlen=64)
        self.updates_applied = 0
        self.failovers_seen = 0
        self.live_peers: dict[str, HeartbeatInfo] = {}
        self.behind_since: dict[int, float] = {}
        # (holder, term) this peer last sent a delta to: a new term, even of the same holder, is a new
        # synchronizer whose rounds hold none of the deltas sent before
        self.sent_to: tuple[str, int] | None = None
        self.delta_hold: tuple[str, float] | None = None  # (holder, until): see `delta_hold_seconds`
        # term -> every peer seen holding a lease of it (two claims of one term can race; the tie's loser
        # steps down, but either may have published updates of that term)
        self.lease_holders: dict[int, set[str]] = {}
        self._last_lease_reread = float("-inf")
        # Per fragment, the term of the update that produced the replica's version (0: initial or unknown,
        # e.g. restored from disk); see protocol/reconcile.py.
        self.tip_terms: list[int] = [0] * plan.num_fragments
        self.reconciliations: list[str] = []  # every `reconciled` line, in order
        # Robust-aggregation state, shared by every synchronizer term of this peer (protocol/robust.py).
        self.robust = RobustGuard.from_manifest(manifest)
        transport.bind(self)

    # ---- bookkeeping ----------------------------------------------------------------------------

    def note(self, line: str) -> None:
        self.decisions.append(line)
        self._log(f"[{self.peer_id}] {line}")

    def allowed(self, peer: str) -> bool:
        """False for peers outside the manifest's allowlist (an empty allowlist allows everyone)."""
        return not self.manifest.allowlist or peer in self.manifest.allowlist

    def tip(self, fragment: int) -> BranchTip:
        """This replica's branch tip of `fragment` (protocol/reconcile.py)."""
        return BranchTip(
            self.tip_terms[fragment], self.replica.version(fragment), self.replica.checksum(fragment)
        )

    def tips(self) -> list[BranchTip]:
        return [self.tip(p) for p in range(self.plan.num_fragments)]

    def _reject(self, sender: str, tag: str, detail: str) -> str:
        self.rejections[tag] += 1
        self.rejections_by_sender[(sender, tag)] += 1
        self.note(f"rejected from {sender}: {tag}: {detail}")
        return f"{tag}: {detail}"

    # ---- heartbeats and election ----------------------------------------------------------------

    def heartbeat(self, now: float, **extra) -> None:
        learner = self.learner
        info = HeartbeatInfo(
            role="synchronizer" if self.sync else ("learner" if learner else "observer"),
            may_sync=self.may_sync,
            reachable=self.reachable,
            versions=self.replica.versions(),
            term_seen=self.term_seen,
            step=learner.step if learner else 0,
            loss=learner.last_loss if learner and learner.last_loss == learner.last_loss else 0.0,
            digest=self.replica.digest()[:16],
            tips=tuple((tip.term, tip.checksum) for tip in self.tips()),
            **extra,
        )
        self.kv.store(self.hb_key, self.peer_id, info.to_bytes(), now + self.manifest.timing.heartbeat_ttl)

    def read_swarm(self, now: float) -> tuple[list[PeerHeartbeat], list[LeaseRecord]]:
        heartbeats, leases = [], []
        live: dict[str, HeartbeatInfo] = {}
        for peer, stored in self.kv.get(self.hb_key, now).items():
            if not self.allowed(peer):
                continue
            try:
                info = decode_heartbeat(stored.value, self.plan.num_fragments)
            except RecordError as exc:
                self.rejections["bad heartbeat"] += 1
                self.note(f"ignored heartbeat of {peer}: {exc}")
                continue
            live[peer] = info
            heartbeats.append(info.as_election_record(peer, stored.expiration))
        for holder, stored in self.kv.get(self.lease_key, now).items():
            if not self.allowed(holder):
                continue
            try:
                lease = decode_lease(holder, stored.value)
                leases.append(lease)
                self.lease_holders.setdefault(lease.term, set()).add(lease.holder)
            except RecordError as exc:
                self.rejections["bad lease"] += 1
                self.note(f"ignored lease of {holder}: {exc}")
        self.live_peers = live
        return heartbeats, leases

    def live_learners(self) -> frozenset[str]:
        return frozenset(p for p, info in self.live_peers.items() if info.role in ("learner", "synchronizer"))

    def election_tick(self, now: float) -> election.ElectionDecision:
        heartbeats, leases = self.read_swarm(now)
        rounds = self.sync.rounds_done if self.sync else 0
        decision = election.decide(
            self.peer_id,
            self.manifest.run_id,
            heartbeats,
            leases,
            now,
            self.manifest.timing,
            my_lease=self.my_lease,
            rounds_done=rounds,
        )
        self.term_seen = max(self.term_seen, election.highest_term_seen(leases, heartbeats), decision.term)
        quiet = decision.action in (election.HOLD, election.RENEW, election.FOLLOW)
        if not quiet or decision.reason.split(":")[0] != self.last_election.split(":")[0]:
            self.note(f"election: {decision}")
        self.last_election = decision.reason
        timing = self.manifest.timing
        if decision.action in (election.CLAIM, election.RENEW):
            lease = decision.lease_to_write()
            assert lease is not None
            self.kv.store(
                self.lease_key, self.peer_id, encode_lease(lease), election.dht_expiration(lease, timing)
            )
            if decision.action == election.CLAIM or self.sync is None:
                self._become_synchronizer(lease.term)
            self.my_lease = lease
            self.holder, self.holder_term = self.peer_id, lease.term
        elif decision.action == election.STEP_DOWN:
            if self.my_lease is not None and decision.reason.startswith(election.TAG_TERM_ENDED):
                self._finish_open_rounds(now)
                released = election.release_lease(self.my_lease, now, timing, rounds)
                self.kv.store(
                    self.lease_key,
                    self.peer_id,
                    encode_lease(released),
                    election.dht_expiration(released, timing),
                )
            self.sync = None
            self.my_lease = None
            self.holder = None
        elif decision.action == election.FOLLOW:
            if (decision.holder, decision.term) != (
                self.holder,
                self.holder_term,
            ) and self.holder is not None:
                self.failovers_seen += decision.holder != self.holder
                if self.learner is not None and self.learner.sent:
                    # Deltas sent to the previous term will not be merged: their work is resent now.
                    released = self.learner.expire_in_flight(now, timeout=-1.0)
                    self.note(
                        f"new synchronizer {decision.holder} (term {decision.term}): resending the work of "
                        f"fragments {released}"
                    )
            self.holder, self.holder_term = decision.holder, decision.term
            if self.sync is not None:
                self.sync = None
                self.my_lease = None
        elif decision.action == election.HOLD and self.sync is not None:
            self.holder, self.holder_term = self.peer_id, self.sync.term
        else:
            self.holder = None
        return decision

    def _become_synchronizer(self, term: int) -> None:
        self.sync = Synchronizer(
            self.peer_id,
            self.manifest,
            self.plan,
            self.replica,
            term=term,
            embedding_names=self.embedding_names,
            shapes=self.shapes,
            guard=self.robust,
        )
        self.term_seen = max(self.term_seen, term)
        self.note(f"became synchronizer for term {term} at versions {self.replica.versions()}")

    # ---- synchronizer role ----------------------------------------------------------------------

    def sync_tick(
        self, now: float, *, sync_seconds: float = 0.0, cap: float | None = None
    ) -> list[UpdateRecord]:
        """Close ready rounds, apply each update locally, push it to every live peer."""
        if self.sync is None:
            return []
        published = []
        for outcome in self.sync.poll(now, self.live_learners(), cap):
            record = outcome.record
            frame = encode_update(record)
            reply = self._apply_update(record, frame, source=self.peer_id)
            if not reply.startswith("applied"):
                self.note(f"own update refused: {reply}")
                self.sync.rounds.abort(record.fragment)
                continue
            for peer in sorted(self.live_peers):
                if peer != self.peer_id:
                    self.transport.push_update(peer, frame)
            self.sync.finish(record.fragment, sync_seconds)
            published.append(record)
            self._on_published(record)
        return published

    def _finish_open_rounds(self, now: float) -> None:
        """At the end of a term (the lease still valid), merge every open round that has its quorum now,
        cutting the grace windows short; rounds below quorum are dropped, and their learners resend to
        the next holder once they see the released lease."""
        if self.sync is None:
            return
        open_before = self.sync.rounds.open_fragments
        merged = [record.fragment for record in self.sync_tick(now, cap=0.0)]
        if open_before:
            dropped = sorted(set(open_before) - set(merged))
            self.note(
                f"term ended: merged the open rounds of fragments {merged}, dropped {dropped} (no quorum)"
            )

    # ---- learner side ---------------------------------------------------------------------------

    def _release_if_holder_changed(self) -> None:
        """Deltas sent to a previous holder or term will not be merged: their work goes back and is resent."""
        learner = self.learner
        current = (self.holder, self.holder_term) if self.holder is not None else None
        if learner is None or not learner.sent or self.sent_to in (None, current):
            return
        released = learner.expire_in_flight(float("inf"), timeout=0.0)
        self.note(f"synchronizer changed from {self.sent_to} to {current}: resending fragments {released}")
        self.sent_to = current

    def after_train_step(self, now: float) -> int | None:
        """Send the due fragment's delta to the synchronizer, if one is due and a holder is known."""
        prepared = self.prepare_delta(now)
        return None if prepared is None else self.send_prepared(prepared)

    def prepare_delta(self, now: float) -> PreparedDelta | None:
        """The step-boundary half of `after_train_step`: pick the due delta and its destination. A real
        peer calls `send_prepared` from another thread, so compressing never holds up the next step."""
        learner = self.learner
        if learner is None or self.holder is None:
            return None
        self._release_if_holder_changed()
        if learner.sent:
            # Backstop only: a failover already released deltas sent to the old holder. Releasing one that
            # is merely slow would count its work twice once both copies are merged.
            timing = self.manifest.timing
            timeout = IN_FLIGHT_TIMEOUT_LEASES * (timing.lease_ttl + timing.claim_grace)
            for p in learner.expire_in_flight(now, timeout):
                self.note(f"delta for fragment {p} timed out; its work will be resent")
        if self.delta_hold is not None:
            held_for, until = self.delta_hold
            if held_for == self.holder and now < until:
                return None
            self.delta_hold = None
        due = learner.snapshot_due_delta(now)
        if due is None:
            return None
        self.sent_to = (self.holder, self.holder_term)
        return PreparedDelta(self.holder, due)

    def send_prepared(self, prepared: PreparedDelta) -> int | None:
        """Compress and send a prepared delta (skipped if it was released meanwhile); its fragment."""
        assert self.learner is not None
        frame = self.learner.encode_due(prepared.due)
        if frame is None:
            return None
        holder, fragment, seq = prepared.holder, prepared.due.fragment, prepared.due.header.seq
        if holder == self.peer_id:
            self._on_delta_reply(holder, fragment, seq, self.handle_delta(self.peer_id, frame))
        else:
            self.transport.send_delta(
                holder, frame, on_reply=lambda reply: self._on_delta_reply(holder, fragment, seq, reply)
            )
        return fragment

    def _on_delta_reply(self, holder: str, fragment: int, seq: int, reply: str) -> None:
        if self.learner is None or not self.learner.on_delta_reply(fragment, seq, reply):
            return
        hold = delta_hold_seconds(reply, self.manifest.timing.heartbeat_period)
        if hold > 0:
            self.delta_hold = (holder, self.clock.now() + hold)
        self.note(
            f"delta for fragment {fragment} refused: {reply}"
            + (f"; holding deltas {hold:.1f}s" if hold else "")
        )

    # ---- updates --------------------------------------------------------------------------------

    def _apply_update(self, record: UpdateRecord, frame: bytes, *, source: str) -> str:
        p = record.fragment
        wire = self.manifest.wire
        try:
            grad = decode_tensors(
                record.payload, expected_shapes=self.replica.shapes(p), max_bytes=wire.max_message_bytes
            )
        except DecodeError as exc:
            return self._reject(source, exc.reason, f"update payload: {exc}")
        old = self.replica.params_of(p) if self.learner is not None else {}
        cfg = self.manifest.diloco
        decision = self.replica.apply(
            p,
            record.from_version,
            grad,
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            expected_checksum=record.checksum,
        )
        if decision.action != APPLY:
            return decision.reason
        self.robust.observe_update(p, grad)
        self.tip_terms[p] = record.term
        self.update_log[p].append(frame)
        self.updates_applied += 1
        if self.learner is not None:
            self.learner.adopt(record, old)
        return decision.reason

    def handle_update(self, sender: str, frame: bytes) -> str:
        if not self.allowed(sender):
            return self._reject(sender, REJECT_NOT_ALLOWED, "sender is not in the run's allowlist")
        try:
            record = decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
        except DecodeError as exc:
            return self._reject(sender, exc.reason, str(exc))
        bad = self._check_record(record.run_id, record.manifest_hash, record.fragment)
        if bad:
            return self._reject(sender, bad[0], bad[1])
        fencing = election.should_accept_update(record.term, self.term_seen)
        if fencing.action != election.ACCEPT:
            return self._reject(sender, election.TAG_LOWER_TERM, fencing.reason)
        if record.leader != sender:
            return self._reject(
                sender, "not the leader", f"update of term {record.term} names {record.leader}"
            )
        if not self._held_lease(record.leader, record.term):
            return self._reject(sender, "no lease", f"{sender} never held the lease of term {record.term}")
        self.term_seen = max(self.term_seen, record.term)
        before = self.tip(record.fragment)
        reply = self._apply_update(record, frame, source=sender)
        tag = reply.split(":")[0]
        if record.term > before.term and tag in (DUPLICATE_UPDATE, OUT_OF_ORDER, CHECKSUM_MISMATCH):
            # An update of a newer term that does not follow my state: maybe a branch from a partition.
            theirs = BranchTip(record.term, record.to_version, record.checksum)
            if tag == CHECKSUM_MISMATCH:
                proof = reconcile.fork_proven(
                    before, theirs, update_term=record.term, from_version=record.from_version
                )
                self.reconcile_fragment(record.fragment, theirs, [sender], proof)
            else:
                self.reconcile_fragment(record.fragment, theirs, [sender])
            return reply
        if tag == OUT_OF_ORDER:
            self.catch_up_fragment(record.fragment, [sender], target=record.to_version)
            return reply
        if tag not in ("applied", DUPLICATE_UPDATE):
            self.note(f"update from {sender} refused: {reply}")
            if tag == CHECKSUM_MISMATCH:
                self.fetch_fragment(record.fragment, [sender])
        return reply

    def _held_lease(self, leader: str, term: int) -> bool:
        """Whether `leader` held the lease of `term`, by the lease records seen (re-read if unknown, at most
        once per heartbeat period: every frame of a replayed log used to cost a DHT read)."""
        if leader not in self.lease_holders.get(term, ()):
            now = self.clock.now()
            if now - self._last_lease_reread >= self.manifest.timing.heartbeat_period:
                self._last_lease_reread = now
                self.read_swarm(now)
        return leader in self.lease_holders.get(term, ())

    def _check_record(self, run_id: str, manifest_hash: str, fragment: int) -> tuple[str, str] | None:
        if run_id != self.manifest.run_id:
            return ("wrong run", f"{run_id!r} is not this run ({self.manifest.run_id!r})")
        if manifest_hash != self.manifest.manifest_hash:
            return ("wrong manifest", "the sender runs a different manifest")
        if not 0 <= fragment < self.plan.num_fragments:
            return ("unknown fragment", f"{fragment} not in [0, {self.plan.num_fragments})")
        return None

    def handle_delta(self, sender: str, frame: bytes) -> str:
        if not self.allowed(sender):
            return self._reject(sender, REJECT_NOT_ALLOWED, "sender is not in the run's allowlist")
        if self.sync is None:
            try:
                decode_delta(frame, max_bytes=self.manifest.wire.max_message_bytes)
            except DecodeError as exc:
                return self._reject(sender, exc.reason, str(exc))
            return self._reject(sender, REJECT_NOT_SYNCHRONIZER, f"{self.peer_id} does not hold the lease")
        reply = self.sync.handle_delta(sender, frame, self.clock.now())
        return reply
