"""The learner's deltas between the training thread and the synchronizer: compression, sending, replies.

`Outbox` runs on the peer's owner thread and keeps the one record of this learner's deltas in flight
(`InFlight`: seq, synchronizer, time sent, the work it carries and theta when it was taken); the
training thread remembers only which seq of each fragment it handed over. A delta the training thread
took (`DeltaReady`) is compressed with error feedback (the residuals live here, next to the decision to
resend) and sent to the synchronizer this peer follows. It goes back to the learner (`Release`, with its
work, resent with the next delta of that fragment) when the synchronizer refuses it, when a different
synchronizer (or a new term of the same one) takes over, or, as a backstop, after several lease
lifetimes without a merge; a sent-out delta that went back is kept (`released`) so that an old holder's
late merge of it is recognised by its seq. Every applied update comes here (`on_applied`): the outbox
decides whether it merged this learner's delta and tells the learner (`Adopt` with `MergedMine`), or
moves theta-at-send of what is in flight by the global change. A delta taken before the learner had
handled every message about its fragment (`DeltaReady.settled`) goes back at once: the fragment changed
under it. It keeps the `SendGate`
(`swarm.effects`) the training thread reads before it takes a delta: whether a synchronizer is known and
not holding deltas. Under a sparse codec every delta carries this peer's signature over (run, manifest,
learner, fragment, anchor version, seq, tokens, payload digest): the update that merges it lists it, and
every replica checks that signature before merging it itself (`swarm.sparse_rounds`). With synchronizer
shards each fragment's delta goes to the holder of its shard (`follow` per shard's fragments), and a
shard without a holder stalls only its own fragments.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import robust
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.effects import (
    Adopt,
    DeltaReady,
    DeltaReplied,
    DeltaWork,
    Intent,
    LearnerMessage,
    MergedMine,
    Release,
    Reload,
    SendDelta,
    SendGate,
    Target,
    Tensors,
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
    """A delta that left the learner, neither merged nor given back. `theta_at_send` is moved in place by
    every update of its fragment that merged others' deltas (`Outbox.on_applied`)."""

    seq: int
    target: Target
    sent_at: float
    work: DeltaWork
    theta_at_send: dict[str, torch.Tensor]


def follow_global(kept: list[InFlight], old_global: Tensors, new_global: Tensors) -> None:
    """Others' deltas moved Theta_p: theta-at-send of this learner's unmerged deltas moves as theta did
    (`protocol.diloco.follow`), so a later merge of one of them still carries only the progress since."""
    for name in kept[0].theta_at_send if kept else ():
        shift = new_global[name] - old_global[name]
        for delta in kept:
            delta.theta_at_send[name] += shift


class Outbox:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        journal: Journal,
        emit: Callable[[Intent], None],
        signer: RecordSigner | None = None,
        *,
        has_learner: bool = True,
    ):
        self.peer_id = peer_id
        self.has_learner = has_learner
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
        # per fragment, the oldest sent-out delta that went back unmerged (its work is in every later delta of
        # the fragment): an update that merges it after all is adopted as this learner's own
        self.released: dict[int, InFlight] = {}
        # per fragment, a released delta merged after all while the learner may hold a delta that repeats
        # its work, not yet routed: that one goes back without the merged work
        self.absorbed: dict[int, DeltaWork] = {}
        self.posted: Counter[int] = Counter()  # messages posted to the learner, per fragment
        self.gate = SendGate()
        self.targets: dict[int, Target | None] = {}  # fragment -> the synchronizer of its shard
        self.held: tuple[Target, float] | None = None

    def _post(self, message: LearnerMessage) -> None:
        """A message for the learner, counted per fragment it is about (`DeltaReady.settled`)."""
        if isinstance(message, Reload):
            self.posted.update(list(message.fragments))  # the keys: a mapping would add its values
        else:
            self.posted[message.record.fragment if isinstance(message, Adopt) else message.fragment] += 1
        self._emit(ToLearner(message))

    def _release(self, fragment: int, why: str, *, resend: bool = False) -> None:
        sent = self.in_flight.pop(fragment, None)
        if sent is None:
            return
        self.feedback.reset(fragment)
        self.released.setdefault(fragment, sent)
        self._post(Release(fragment, sent.seq, sent.work, resend=resend))
        if why:
            self.journal.note(why)

    def _give_back(self, ready: DeltaReady, *, resend: bool = False) -> None:
        """A delta that never left this peer: its work goes back to the learner."""
        work = ready.work
        absorbed = self.absorbed.pop(ready.fragment, None)
        if absorbed is not None:  # taken before the learner adopted the released delta (`route` pops it else)
            work = work.beyond(absorbed)
        self._post(Release(ready.fragment, ready.seq, work, sent_out=False, resend=resend))

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
        p = ready.fragment
        if ready.settled != self.posted[p]:  # an update, a release or a reload of p reached it meanwhile
            self._give_back(ready, resend=True)
            return None
        self.absorbed.pop(p, None)  # the learner took this delta knowing of it
        target = self.targets.get(p)
        if target is None or ready.now < self._held_until(target):
            self._give_back(ready)
            return None
        try:
            payload, _ = self.feedback.compress(p, ready.delta)
        except ValueError as exc:  # a non-finite delta: never sent, the residual untouched
            self.journal.note(f"delta for fragment {p} not sent: {exc}")
            self._give_back(ready)
            return None
        self.in_flight[p] = InFlight(ready.seq, target, ready.now, ready.work, dict(ready.theta_at_send))
        released = self.released.get(p)
        header = dataclasses.replace(ready.header, since_seq=released.seq if released is not None else 0)
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

    def on_applied(self, record: UpdateRecord, old_global: Tensors, new_global: Tensors) -> None:
        """The replica applied `record` (however it came): settle this learner's delta it merged, if any, or
        move theta-at-send of what is in flight by the global change; then tell the learner (`Adopt`)."""
        p = record.fragment
        sent, released = self.in_flight.get(p), self.released.get(p)
        mine = None
        if sent is not None and record.merged_delta(self.peer_id, sent.seq):
            del self.in_flight[p]
            self.released.pop(p, None)  # its work went out again in this delta, now merged
            mine = MergedMine(sent.seq, sent.work, sent.theta_at_send)
        elif released is not None and record.seq_of(self.peer_id) == released.seq:
            mine = self._merged_released(p, released)
        else:
            follow_global([x for x in (sent, released) if x is not None], old_global, new_global)
        if self.has_learner:
            self._post(Adopt(record, old_global, new_global, record.to_version, mine))

    def _merged_released(self, p: int, released: InFlight) -> MergedMine:
        """An old holder merged a delta that had gone back: the delta in flight that repeats its work is
        dropped (synchronizers refuse it as "already merged"), what it carried beyond goes out again."""
        del self.released[p]
        again = self.in_flight.pop(p, None)
        repeat = None
        if again is not None:
            self.feedback.reset(p)
            repeat = (again.seq, again.work.beyond(released.work))
        else:
            self.absorbed[p] = released.work
        return MergedMine(released.seq, released.work, released.theta_at_send, released=True, repeat=repeat)

    def on_reload(self, message: Reload) -> None:
        """Fragments were replaced by a snapshot: their deltas in flight and residuals are void."""
        for p in message.fragments:
            self.in_flight.pop(p, None)
            self.released.pop(p, None)
            self.absorbed.pop(p, None)
            self.feedback.reset(p)
        self._post(message)

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
