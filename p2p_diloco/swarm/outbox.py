"""The learner's deltas between the training thread and the synchronizer: compression, sending, replies.

`Outbox` runs on the peer's owner thread. A delta the training thread took (`DeltaReady`) is
compressed with error feedback (the residuals live here, next to the decision to resend) and sent to
the synchronizer this peer follows, recorded as in flight with that synchronizer's (holder, term). It
goes back to the learner (`Release`, the work is resent with its next delta of that fragment) when
the synchronizer refuses it, when a different synchronizer (or a new term of the same one) takes
over, or, as a backstop, after several lease lifetimes without a merge. It keeps the `SendGate`
(`swarm.effects`) the training thread reads before it takes a delta: whether a synchronizer is known and
not holding deltas. Under a sparse codec every delta carries this peer's signature over (run, manifest,
learner, fragment, anchor version, seq, tokens, payload digest): the update that merges it lists it, and
every replica checks that signature before merging it itself (`swarm.sparse_rounds`). With synchronizer
shards each fragment's delta goes to the holder of its shard (`follow` per shard's fragments), and a
shard without a holder stalls only its own fragments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import robust
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.effects import (
    DeltaReady,
    DeltaReplied,
    Intent,
    Release,
    SendDelta,
    SendGate,
    Target,
    ToLearner,
)
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.wire.codecs.feedback import ErrorFeedback
from p2p_diloco.wire.delta_signature import SignedDelta, payload_digest, sign_delta
from p2p_diloco.wire.frames import encode_delta
from p2p_diloco.wire.replies import Reply, ReplyStatus
from p2p_diloco.wire.signing import RecordSigner

IN_FLIGHT_TIMEOUT_LEASES = 4
MAX_DELTA_HOLD = 300.0


def delta_hold_seconds(reply: Reply, heartbeat_period: float) -> float:
    """How long to hold further deltas for the synchronizer that refused one with `reply` (0: not at all).

    Without a hold a learner resends the refused work after its next inner step: at tens of steps per
    second a cooled-down or unreachable learner sent the same refused fragment ~10 times a second.
    Held work keeps accumulating and goes out in one delta when the hold ends or the holder changes.
    """
    if reply.tag == robust.RobustTag.COOL_DOWN:
        return min(reply.retry_after, MAX_DELTA_HOLD) if reply.retry_after > 0 else heartbeat_period
    return heartbeat_period if reply.status == ReplyStatus.TRANSIENT else 0.0


@dataclass(frozen=True)
class InFlight:
    seq: int
    target: Target
    sent_at: float


class Outbox:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        journal: Journal,
        emit: Callable[[Intent], None],
        signer: RecordSigner | None = None,
    ):
        self.peer_id = peer_id
        # sparse codecs sign every delta (`wire.delta_signature`): replicas merge the listed deltas
        # themselves and check each one; dense codecs' deltas go out unsigned, as they always did
        self.signer = signer if manifest.wire.codec.sparse else None
        self.manifest = manifest
        self.journal = journal
        self._emit = emit
        wire = manifest.wire
        self.feedback = ErrorFeedback(
            codec=wire.codec,
            block_size=wire.block_size,
            enabled=wire.error_feedback,
            density=wire.density,
            decay=wire.feedback_decay,
        )
        self.in_flight: dict[int, InFlight] = {}
        self.gate = SendGate()
        self.targets: dict[int, Target | None] = {}  # fragment -> the synchronizer of its shard
        self.held: tuple[Target, float] | None = None

    def _release(self, fragment: int, why: str, *, resend: bool = False) -> None:
        sent = self.in_flight.pop(fragment, None)
        if sent is None:
            return
        self.feedback.reset(fragment)
        self._emit(ToLearner(Release(fragment, sent.seq, resend=resend)))
        if why:
            self.journal.note(why)

    def _held_until(self, target: Target | None) -> float:
        return self.held[1] if self.held is not None and self.held[0] == target else 0.0

    def _publish_gate(self) -> None:
        """The gate shows a known synchronizer not holding deltas if there is one (the training thread
        takes a delta; `route` sends it back if its own shard has no holder now)."""
        known = [t for t in dict.fromkeys(self.targets.values()) if t is not None]
        free = [t for t in known if not self._held_until(t)]
        target = (free or known or [None])[0]
        self.gate.state = (target, self._held_until(target))

    def follow(self, target: Target | None, fragments: Collection[int] | None = None) -> None:
        """The synchronizer this peer follows now for `fragments` (all of them: None); deltas sent to any
        other (holder, term) will not be merged (a new term's rounds hold none of them): their work goes
        back and is resent."""
        fragments = range(self.manifest.diloco.fragments) if fragments is None else fragments
        for p in fragments:
            self.targets[p] = target
        if target is not None:  # while none is known (lease grace), what is in flight may still merge
            stale = sorted(p for p, s in self.in_flight.items() if p in fragments and s.target != target)
            if stale:
                self.journal.note(f"synchronizer is now {target}: resending the work of fragments {stale}")
            for p in stale:
                self._release(p, "", resend=True)
        self._publish_gate()

    def route(self, ready: DeltaReady) -> bytes | None:
        """Compress a delta the learner took and mark it in flight to the current synchronizer; the frame
        (the caller sends it, or hands it to itself as synchronizer), or None if it went back."""
        target = self.targets.get(ready.fragment)
        if target is None or ready.now < self._held_until(target):
            self._emit(ToLearner(Release(ready.fragment, ready.seq, sent_out=False)))
            return None
        try:
            payload, _ = self.feedback.compress(ready.fragment, ready.delta)
        except ValueError as exc:  # a non-finite delta: never sent, the residual untouched
            self.journal.note(f"delta for fragment {ready.fragment} not sent: {exc}")
            self._emit(ToLearner(Release(ready.fragment, ready.seq, sent_out=False)))
            return None
        self.in_flight[ready.fragment] = InFlight(ready.seq, target, ready.now)
        header = ready.header
        if self.signer is not None:
            signed = SignedDelta(
                header.run_id,
                header.manifest_hash,
                self.peer_id,
                header.fragment,
                header.anchor_version,
                header.seq,
                header.tokens,
                payload_digest(payload),
            )
            header = dataclasses.replace(header, signature=sign_delta(self.signer, signed))
        return encode_delta(header, payload)

    def send_intent(self, fragment: int, frame: bytes) -> SendDelta:
        holder, term = self.in_flight[fragment].target
        return SendDelta(holder, term, fragment, self.in_flight[fragment].seq, frame)

    def on_reply(self, replied: DeltaReplied) -> None:
        sent = self.in_flight.get(replied.fragment)
        if sent is None or sent.seq != replied.seq or replied.reply.ok:
            return
        hold = delta_hold_seconds(replied.reply, self.manifest.timing.heartbeat_period)
        if hold > 0:
            self.held = (sent.target, replied.now + hold)
            self._publish_gate()
        self._release(
            replied.fragment,
            f"delta for fragment {replied.fragment} refused: {replied.reply}"
            + (f"; holding deltas {hold:.1f}s" if hold else ""),
        )

    def on_merged(self, record: UpdateRecord) -> None:
        """An applied update merged this peer's delta of its fragment: no longer in flight."""
        sent = self.in_flight.get(record.fragment)
        if sent is not None and record.merged_delta(self.peer_id, sent.seq):
            del self.in_flight[record.fragment]

    def expire(self, now: float) -> None:
        """Backstop only: a failover already released deltas sent to the old synchronizer. Releasing one
        that is merely slow would count its work twice once both copies are merged."""
        timing = self.manifest.timing
        timeout = IN_FLIGHT_TIMEOUT_LEASES * (timing.lease_ttl + timing.claim_grace)
        for p in sorted(p for p, s in self.in_flight.items() if now - s.sent_at > timeout):
            self._release(p, f"delta for fragment {p} timed out; its work will be resent")
        if self.held is not None and now >= self.held[1]:
            self.held = None
            self._publish_gate()
