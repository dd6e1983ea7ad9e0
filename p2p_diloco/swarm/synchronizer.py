"""The synchronizer role: validate incoming deltas, run the fragment rounds, merge, build updates.

Sans-IO: `handle_delta` takes a frame and returns a typed `Reply`, `poll` returns the updates to
publish, each with its outer step computed once (`MergeOutcome.pending`). It never mutates the replica:
the peer installs that step through the same `UpdateBook.apply` path every update takes, which keeps the
holder's replica identical to all others.

Every delta goes through, in order: the allowlist, the sender's cool-down, frame decoding, run and
manifest, fragment, tensor decoding, `merge.validate_delta`, then the robust checks of
`protocol.robust` (token claim, replay, norm, direction) before it is offered to its round; rounds of
three or more contributions are screened again when they close (pairwise cosines, majority rule),
and until a fragment has a direction reference its rounds wait (briefly) for three contributions.
Every rejection is counted in `rejections` and `rejections_by_sender`, logged in `decisions` and reported
to the `RobustGuard`, which cools repeat offenders down. Senders cooling down are not contributors and
are not waited for (a round closes early once every other live learner reported), but they still count
as live learners in the outer scaling: a cool-down must not change the honest swarm's outer step size
(scaling by three learners instead of four cost 12 % eval loss in scripts/bench_byzantine.py, seed 1).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.decisions import AdmissionTag, Decision
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.kernels import QuantizedTensor
from p2p_diloco.protocol.merge import merge_deltas, validate_delta
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica, PendingUpdate
from p2p_diloco.protocol.robust import ACCEPT, CLIP, RobustGuard, Screened
from p2p_diloco.protocol.robust_config import RobustTag
from p2p_diloco.protocol.sync_round import Contribution, RoundTag, SynchronizerRounds
from p2p_diloco.wire.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.feedback import ErrorFeedback
from p2p_diloco.wire.frames import decode_delta
from p2p_diloco.wire.replies import Reply, ReplyStatus


@dataclass(frozen=True)
class MergeOutcome:
    """A closed round: the update to publish, and its outer step already computed (applied as is)."""

    record: UpdateRecord
    reason: str
    pending: PendingUpdate
    outer_grad: dict[str, torch.Tensor | QuantizedTensor]  # int8 gradients stay int8 (decode_tensors lazy)


class Synchronizer:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        plan: FragmentPlan,
        replica: GlobalReplica,
        *,
        term: int,
        embedding_names: Collection[str] = (),
        shapes: dict[str, tuple[int, ...]],
        guard: RobustGuard | None = None,
        outer_feedback: ErrorFeedback | None = None,
        merged_already: Callable[[str, int, int], int | None] = lambda sender, fragment, since: None,
    ):
        self.peer_id = peer_id
        self.manifest = manifest
        self.plan = plan
        self.replica = replica
        self.term = term
        self.merged_already = merged_already  # `UpdateBook.merged_already`: work an update merged before
        self.embedding_names = frozenset(embedding_names)
        self.expected = [{n: tuple(shapes[n]) for n in plan.names(p)} for p in range(plan.num_fragments)]
        cfg = manifest.diloco
        self.rounds = SynchronizerRounds(
            plan.num_fragments,
            replica.versions(),
            min_quorum=cfg.min_quorum,
            max_staleness=cfg.max_staleness,
            gamma=cfg.grace_gamma,
            tau=cfg.max_in_flight,
        )
        self.rounds_done = 0
        self.rejections: Counter[str] = Counter()
        self.rejections_by_sender: Counter[tuple[str, str]] = Counter()
        self.decisions: deque[str] = deque(maxlen=64)
        self.accepted_tokens: Counter[str] = Counter()
        # fragment -> a learner whose delta was anchored at a version this replica lacks (a hint: the
        # catch-up from it checks every record; a lying learner costs one failed fetch)
        self.ahead_hints: dict[int, str] = {}
        self.guard = guard if guard is not None else RobustGuard.from_manifest(manifest)
        # Sparse codecs: what an update leaves out is carried into the fragment's next update. Lost with
        # this object (failover, rotation) unless the peer passes one store to every term (docs/wire_codecs.md).
        self.outer_feedback = outer_feedback or outer_feedback_for(manifest)

    def _reject(self, sender: str, tag: str, detail: str, now: float, retry_after: float = 0.0) -> Reply:
        reply = Reply.refused(tag, detail, retry_after)
        self.rejections[tag] += 1
        self.rejections_by_sender[(sender, tag)] += 1
        self.decisions.append(f"reject delta from {sender}: {reply.reason}")
        started = self.guard.note_rejection(sender, tag, now)
        if started is not None:
            self.decisions.append(started.reason)
        return reply

    def _refuse(self, sender: str, decision: Decision, now: float) -> Reply:
        return self._reject(sender, decision.tag, decision.detail, now)

    def handle_delta(self, sender: str, frame: bytes, now: float) -> Reply:
        """Validate and offer one delta frame; returns the reply for the sender. Never raises on bad input."""
        if self.manifest.allowlist and sender not in self.manifest.allowlist:
            return self._reject(sender, AdmissionTag.NOT_ALLOWED, "sender is not in the run's allowlist", now)
        admitted = self.guard.admit(sender, now)
        if admitted.action != ACCEPT and sender != self.peer_id:
            return self._reject(
                sender, admitted.tag, admitted.detail, now, self.guard.cool_down_left(sender, now)
            )
        wire = self.manifest.wire
        try:
            header, payload = decode_delta(frame, max_bytes=wire.max_message_bytes)
        except DecodeError as exc:
            return self._reject(sender, exc.reason, exc.detail, now)
        if header.run_id != self.manifest.run_id:
            return self._reject(
                sender, AdmissionTag.WRONG_RUN, f"{header.run_id!r} != {self.manifest.run_id!r}", now
            )
        if header.manifest_hash != self.manifest.manifest_hash:
            return self._reject(
                sender, AdmissionTag.WRONG_MANIFEST, "peer runs a different manifest; update it", now
            )
        p = header.fragment
        if not 0 <= p < self.plan.num_fragments:
            return self._reject(
                sender, AdmissionTag.UNKNOWN_FRAGMENT, f"{p} not in [0, {self.plan.num_fragments})", now
            )
        merged = self.merged_already(sender, p, header.carries_since)
        if merged is not None and header.seq <= merged:  # this very delta was merged: resent as is
            return self._reject(
                sender, RobustTag.REPLAY, f"delta {header.seq} of fragment {p} was merged already", now
            )
        if merged is not None:
            # a delta released at a term change that the old holder merged after all: its work is in the
            # model; the learner adopts that update and resends only what came after
            detail = (
                f"fragment {p}: delta {header.seq} carries work since delta {header.carries_since}, and "
                f"delta {merged} was merged already; adopt that update and resend the rest"
            )
            return self._reject(sender, AdmissionTag.ALREADY_MERGED, detail, now)
        try:
            kept = decode_tensors(
                payload, expected_shapes=self.expected[p], max_bytes=wire.max_message_bytes, lazy=True
            )
        except DecodeError as exc:
            return self._reject(sender, exc.reason, exc.detail, now)
        tensors = dense(kept)  # screened in float32, then dropped: the round keeps the int8 form
        check = validate_delta(tensors, self.expected[p], norm_bound=wire.norm_bound)
        if check.action != "accept":
            return self._refuse(sender, check, now)
        counters = self.guard.check_counters(header.tokens, header.steps, for_weight=True)
        if counters.decision.action not in (ACCEPT, CLIP):
            return self._refuse(sender, counters.decision, now)
        replay = self.guard.check_replay(sender, payload)
        if replay.action != ACCEPT:
            return self._refuse(sender, replay, now)
        if (
            sender == self.peer_id
        ):  # its own work: the holder applies the merge anyway, screening gains nothing
            screened = Screened(Decision(ACCEPT, RobustTag.OWN_DELTA), dict(tensors))
        else:
            # norms per step use the claimed steps (the guard caps them at max_steps); H is for weight only
            screened = self.guard.screen(p, tensors, header.steps, sender)
        if screened.decision.action not in (ACCEPT, CLIP):
            return self._refuse(sender, screened.decision, now)
        contribution = Contribution(
            sender=sender,
            anchor_version=header.anchor_version,
            tokens=counters.tokens,
            steps=counters.steps,
            received_at=now,
            # a clipped delta is new values; an accepted one waits for its round in int8 (a quarter of
            # float32: with rounds open on several fragments, the synchronizer's largest holding)
            payload=kept if screened.decision.action == ACCEPT else screened.tensors,
            seq=header.seq,
        )
        self._follow_replica(now)
        decision = self.rounds.offer(p, contribution, now)
        if decision.action != "accept":
            if decision.tag == RoundTag.FUTURE_ANCHOR:
                self.ahead_hints[p] = sender  # this learner adopted a version I lack: catch up from it
            return self._refuse(sender, decision, now)
        self.guard.note_accepted(p, screened.tensors, header.steps)
        self.guard.standing.heard((sender,), now)  # an unlisted learner is awaited from its first delta on
        clips = [d.reason for d in (counters.decision, screened.decision) if d.action == CLIP]
        self.decisions.append(
            f"fragment {p}: {decision.reason} from {sender}" + "".join(f"; {c}" for c in clips)
        )
        return Reply.of(ReplyStatus.ACCEPTED, decision)

    def observe_step_time(self, seconds: float) -> None:
        self.rounds.observe_step_time(seconds)

    def poll(
        self, now: float, live_learners: frozenset[str], cap: float, hold: Collection[int] = ()
    ) -> list[MergeOutcome]:
        """Close every round whose quorum and grace allow it, except fragments in `hold` (the holder is
        catching them up to versions other peers hold: merging now would publish from behind); returns
        the updates."""
        self._follow_replica(now)
        awaited = live_learners - self.guard.cooling(now)
        outcomes = []
        for p, decision in self.rounds.ready(now, awaited, cap):
            if decision.action != "close" or p in hold or self._gathering(p, now, awaited):
                continue
            closed = [dataclasses.replace(c, payload=dense(c.payload)) for c in self.rounds.close(p, now)]
            contributions = self._screen_round(p, closed, now)
            del closed  # from here `contributions` holds the float32 deltas alone; _merge lets them go
            if not contributions:
                self.rounds.abort(p)
                continue
            record, pending, grad = self._merge(
                p, contributions, live=len(live_learners | {c.sender for c in contributions})
            )
            self.rounds_done += 1
            self.decisions.append(
                f"fragment {p} v{record.from_version}->{record.to_version}: {decision.reason}"
            )
            outcomes.append(MergeOutcome(record, decision.reason, pending, grad))
        return outcomes

    def _follow_replica(self, now: float) -> None:
        """Rounds move to the replica's version after a catch-up or reconciliation changed it under them;
        contributions no longer usable there are dropped with their rejection (their learners resend)."""
        for p, version in enumerate(self.replica.versions()):
            if version != self.rounds.version(p) and p not in self.rounds.merging:
                for dropped in self.rounds.set_version(p, version, now):
                    self.decisions.append(f"fragment {p} moved to v{version}: {dropped.reason}")

    def _gathering(self, p: int, now: float, live_learners: frozenset[str]) -> bool:
        """While `p` has no direction reference, hold its round for a first update screened by the round."""
        cfg = self.guard.config
        current = self.rounds.round(p)
        if current is None or not self.guard.warming_up(p):
            return False
        wanted = min(cfg.round_min, len(live_learners))
        return len(current) < wanted and now - current.opened_at < cfg.warmup_wait

    def _screen_round(self, p: int, contributions: list[Contribution], now: float) -> list[Contribution]:
        """Drop contributions of senders now cooling down, and deltas most of their round disagrees with."""
        cooling = self.guard.cooling(now)
        kept = [c for c in contributions if c.sender not in cooling]
        verdicts = self.guard.screen_round([c.payload for c in kept])
        for c, verdict in zip(kept, verdicts):
            if verdict.action != ACCEPT:
                self._reject(c.sender, verdict.tag, f"{verdict.detail} (fragment {p})", now)
        kept = [c for c, verdict in zip(kept, verdicts) if verdict.action == ACCEPT]
        return [c for c in kept if self._passes_loss_check(p, c, now)]

    def _passes_loss_check(self, p: int, c: Contribution, now: float) -> bool:
        probe, tolerance = self.guard.loss_probe, self.guard.config.loss_tolerance
        if probe is None or c.sender == self.peer_id:
            return True
        change = probe(c.payload)
        if change <= tolerance:
            return True
        detail = (
            f"held-out loss {change:+.1%} with this delta alone (fragment {p}), tolerance {tolerance:.1%}"
        )
        self._reject(c.sender, RobustTag.LOSS_CHECK, detail, now)
        return False

    def finish(self, fragment: int, sync_seconds: float) -> None:
        """The update of `fragment` was applied locally and pushed; records the version and sync time."""
        self.rounds.finish(fragment, self.replica.versions()[fragment], sync_seconds)

    def _merge(
        self, p: int, contributions: list[Contribution], *, live: int
    ) -> tuple[UpdateRecord, PendingUpdate, dict[str, torch.Tensor | QuantizedTensor]]:
        """Merge, encode and compute the update of `p`. Sorts `contributions` by sender and drops their
        payloads once merged, in place: the float32 deltas are freed before the outer step."""
        contributions.sort(key=lambda c: c.sender)
        weights = [c.weight * self.guard.standing.ramp(c.sender) for c in contributions]
        merged = merge_deltas(
            [c.payload for c in contributions],
            weights,
            rule=self.manifest.diloco.merge_rule,
            embedding_names=self.embedding_names,
        )
        contributions[:] = [dataclasses.replace(c, payload=None) for c in contributions]
        if self.manifest.diloco.outer_scaling == "contributors" and len(contributions) < live:
            scale = torch.tensor(len(contributions) / live, dtype=torch.float32)
            for t in merged.values():  # merge_deltas returns fresh tensors: scaled in place, no copy
                t.mul_(scale)
        wire = self.manifest.wire
        if self.outer_feedback is not None:
            payload, _ = self.outer_feedback.compress(p, merged)
        else:
            payload = encode_tensors(merged, codec=wire.codec, block_size=wire.block_size)
        del merged  # the update is its encoding from here on
        # Everyone applies the decoded (quantized) gradient, the holder included, so replicas agree.
        decoded = decode_tensors(
            payload, expected_shapes=self.expected[p], max_bytes=wire.max_message_bytes, lazy=True
        )
        cfg = self.manifest.diloco
        pending = self.replica.compute_update(p, decoded, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        for c in contributions:
            self.accepted_tokens[c.sender] += c.tokens
        record = UpdateRecord(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=p,
            from_version=self.replica.versions()[p],
            term=self.term,
            leader=self.peer_id,
            contributors=tuple((c.sender, float(w)) for c, w in zip(contributions, weights)),
            seqs=tuple(c.seq for c in contributions),
            checksum=pending.checksum,
            payload=payload,
        )
        return record, pending, decoded


def dense(tensors: Mapping[str, torch.Tensor | QuantizedTensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every int8 one decoded to float32 (the others as they are)."""
    return {n: t.decode() if isinstance(t, QuantizedTensor) else t for n, t in tensors.items()}


def outer_feedback_for(manifest: RunManifest) -> ErrorFeedback | None:
    """The synchronizer's residual store for outer gradients: one when the codec is sparse, else None."""
    wire = manifest.wire
    if not wire.codec.sparse:
        return None
    return ErrorFeedback(wire.codec, wire.block_size, density=wire.density, decay=wire.feedback_decay)


def parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
