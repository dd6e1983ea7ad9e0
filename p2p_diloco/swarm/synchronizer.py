"""The synchronizer side of a peer: admitting deltas, the fragment rounds of the term it holds, merges,
and the updates it publishes.

`SynchronizerRole` is what the peer talks to: it admits a delta once (`RunManifest.may_learn`) and hands
it to the `Synchronizer` of the term this peer holds; its sync ticks close the ready rounds, install each
merged update on the peer's own replica through `UpdateBook.apply` (the outer step computed once, by
`swarm.merging`) and push it to at most `[diloco] fanout` live peers, which relay it on (`swarm.relay`). It
changes only on the owner thread, so a term's end (merge the open rounds, release the lease) is one step no
delta or merge can interleave with.

A term's `Synchronizer` is sans-IO and never mutates the replica. An admitted delta passes the sender's
cool-down, frame, run and manifest, fragment, tensors (`merge.validate_delta`) and the robust checks
(`protocol.robust`) before it joins its round; closing rounds of three or more are screened again
(pairwise cosines), and a fragment without a direction reference waits briefly for three. Rejections are
counted and reported to the `RobustGuard`, which cools repeat offenders down; those are not waited for
but still count in the outer scaling (three instead of four cost 12 % eval loss, bench_byzantine seed 1).
A sparse round then lists at most `[diloco] gather` of its screened deltas (`protocol.gather`, longest wait
first) and names the rest in its record (`left_out`), whose learners send that work again.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from torch import Tensor

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.decisions import AdmissionTag, Decision
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.gather import GatherTag, choose
from p2p_diloco.protocol.loss_score import Scored, delta_digest, score_round, score_seed
from p2p_diloco.protocol.merge import validate_delta
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord, UpdateTag
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.robust import ACCEPT, CLIP, CounterCheck, RobustGuard, Screened
from p2p_diloco.protocol.robust_config import RobustTag
from p2p_diloco.protocol.sync_round import Contribution, RoundTag, SynchronizerRounds
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import PeerContext
from p2p_diloco.swarm.merging import MergeOutcome, Merger, dense
from p2p_diloco.swarm.outbox import Outbox
from p2p_diloco.swarm.relay import Relay
from p2p_diloco.swarm.sparse_rounds import intake_problem
from p2p_diloco.swarm.updates import UpdateBook, UpdateSource
from p2p_diloco.wire.codecs.codec import decode_tensors
from p2p_diloco.wire.frames import InboundDelta, encode_update
from p2p_diloco.wire.relay_frames import UpdateId
from p2p_diloco.wire.replies import Reply, ReplyStatus
from p2p_diloco.wire.signing import SignatureCheck

if TYPE_CHECKING:
    from p2p_diloco.swarm.election.handover import Handover


class SynchronizerRole:
    def __init__(
        self,
        ctx: PeerContext,
        shapes: dict[str, tuple[int, ...]],
        embedding_names: Collection[str],
        robust: RobustGuard,
        book: UpdateBook,
        outbox: Outbox,
        membership: Membership,
        handover: Handover | None = None,
        relay: Relay | None = None,
    ):
        self.peer_id, self.manifest, self.plan, self.replica = (
            ctx.peer_id,
            ctx.manifest,
            ctx.plan,
            ctx.replica,
        )
        self.journal, self._emit = ctx.journal, ctx.emit
        self.shapes = shapes
        self.embedding_names = embedding_names
        self.robust = robust  # shared by every term of this peer
        self.book = book
        self.outbox = outbox
        self.membership = membership
        self.handover = handover  # fragments whose rounds wait (never publish from behind), and until when
        self.relay = relay or Relay.for_run(ctx.peer_id, ctx.manifest)
        self._fence_noted: float | None = None  # the lease expiry a fence was last noted for
        self.sync: Synchronizer | None = None

    def take(self, term: int) -> None:
        self.sync = Synchronizer(
            self.peer_id,
            self.manifest,
            self.plan,
            self.replica,
            term=term,
            embedding_names=self.embedding_names,
            shapes=self.shapes,
            guard=self.robust,
            check=self.book.keys.check,
            merged_already=self.book.merged_already,
        )
        self.membership.saw_term(term)
        self.journal.note(f"became synchronizer for term {term} at versions {self.replica.versions()}")

    def tick(self, now: float, *, sync_seconds: float = 0.0, cap: float | None = None) -> list[UpdateRecord]:
        """Close ready rounds; apply each update here (its outer step computed once), push it to at most
        `fanout` live peers (`Relay.publish`), which offer it onward."""
        if self.sync is None or not self.membership.confirmed or self._fenced(now):
            return []  # an unconfirmed claim merges nothing (`protocol.election`, "confirmation")
        published = []
        held = self.handover.held(now) if self.handover is not None else frozenset()
        for outcome in self.sync.poll(now, self.membership.live_learners(now), cap, hold=held):
            record = self.book.sign(outcome.record)
            reply = self.book.apply(
                record,
                source=self.peer_id,
                how=UpdateSource.OWN,
                now=now,
                computed=(outcome.pending, outcome.outer_grad),
            )
            if reply.status != ReplyStatus.APPLIED:
                self.journal.note(f"own update refused: {reply}")
                self.sync.rounds.abort(record.fragment)
                continue
            frame = encode_update(record)
            live = self.membership.live_peers
            for peer in self.relay.publish(UpdateId.of(record), live, len(frame), record.contributor_ids):
                self._emit(fx.PushUpdate(peer, frame))
            self.sync.finish(record.fragment, sync_seconds)
            published.append(record)
            self._emit(fx.Published(record))
        return published

    def wake_at(self, now: float) -> float | None:
        """When this term next needs a sync tick (`Synchronizer.wake_at`, or when held rounds are let go);
        None while it holds no term, is fenced, or waits only for events."""
        lease, margin = self.membership.my_lease, self.manifest.timing.lease_margin
        if self.sync is None or not self.membership.confirmed:
            return None  # the election's confirmation wakes it
        if lease is not None and now >= lease.expires_at - margin:
            return None  # fenced: only the election changes that
        handover = self.handover
        held = handover.holds(now) if handover is not None else frozenset()
        wakes = [self.sync.wake_at(now, self.membership.live_learners(now), held)]
        if held and handover is not None:
            wakes.append(handover.hold_ends())
        return min((at for at in wakes if at is not None), default=None)

    def _fenced(self, now: float) -> bool:
        """Past my lease's last written expiry (less the margin) I merge nothing, whether or not the
        election could read the DHT since: a peer whose DHT calls fail renews nothing, and its followers
        refuse its updates once that expiry passed (they may already follow a successor)."""
        lease = self.membership.my_lease
        if lease is None or now < lease.expires_at - self.manifest.timing.lease_margin:
            return False
        if self._fence_noted != lease.expires_at:
            self._fence_noted = lease.expires_at
            self.journal.note(
                f"term {lease.term}: lease written to expire at {lease.expires_at:.2f} was not renewed; "
                "merging nothing until the election decides"
            )
        return True

    def finish_open_rounds(self, now: float) -> None:
        """At the end of a term (the lease still valid), merge every open round that has its quorum now,
        cutting the grace windows short; rounds below quorum are dropped, and their learners resend to
        the next holder once they see the released lease."""
        if self.sync is None:
            return
        open_before = self.sync.rounds.open_fragments
        merged = [record.fragment for record in self.tick(now, cap=0.0)]
        if open_before:
            dropped = sorted(set(open_before) - set(merged))
            self.journal.note(
                f"term ended: merged the open rounds of fragments {merged}, dropped {dropped} (no quorum)"
            )

    def handle_delta(self, sender: str, delta: InboundDelta, now: float) -> Reply:
        """A delta addressed to this peer: the one admission check (`RunManifest.may_learn`: the allowlist
        and `[trust] learners`), then the term's `Synchronizer`, or a refusal if this peer holds none."""
        if not self.manifest.may_learn(sender):
            return self.journal.reject(
                sender, AdmissionTag.NOT_ALLOWED, "sender is not in the run's allowlist"
            )
        if self.sync is None:
            if delta.error is not None:
                return self.journal.reject(sender, delta.error.reason, delta.error.detail)
            return self.journal.reject(
                sender, UpdateTag.NOT_SYNCHRONIZER, f"{self.peer_id} does not hold the lease"
            )
        return self.sync.offer_delta(sender, delta, now)


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
        check: SignatureCheck | None = None,
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
        self.left_out: Counter[str] = Counter()  # sparse rounds: deltas screened but past the gather set
        # fragment -> a learner whose delta was anchored at a version this replica lacks (a hint: the
        # catch-up from it checks every record; a lying learner costs one failed fetch)
        self.ahead_hints: dict[int, str] = {}
        self.guard = guard if guard is not None else RobustGuard.from_manifest(manifest)
        # Sparse codecs: deltas must carry their sender's signature, checked with `check` (none: refused)
        self.check = check
        standing = self.guard.standing
        self.merger = Merger(
            peer_id, manifest, replica, self.expected, self.embedding_names, standing, self.guard.scores
        )

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

    def offer_delta(self, sender: str, delta: InboundDelta | bytes, now: float) -> Reply:
        """Check and offer one delta of an admitted sender (`SynchronizerRole.handle_delta`; the raw frame
        is decoded here, for callers that have one); returns the reply for the sender. Never raises on bad
        input. In order: the sender's cool-down, the frame (`_header_problem`), the tensors and claims
        (`_screen`), then the fragment's round."""
        if isinstance(delta, bytes):
            delta = InboundDelta.decode(delta, max_bytes=self.manifest.wire.max_message_bytes)
        admitted = self.guard.admit(sender, now)
        if admitted.action != ACCEPT and sender != self.peer_id:
            return self._reject(
                sender, admitted.tag, admitted.detail, now, self.guard.cool_down_left(sender, now)
            )
        problem = self._header_problem(sender, delta)
        if problem is not None:
            return self._reject(sender, *problem, now)
        header = delta.header
        assert header is not None  # a header problem otherwise
        screened = self._screen(sender, header, delta.payload, now)
        if isinstance(screened, Reply):
            return screened
        return self._join_round(sender, delta, *screened, now)

    def _header_problem(self, sender: str, delta: InboundDelta) -> tuple[str, str] | None:
        """(tag, detail) refusing the frame itself: it does not decode, or names another run, manifest or
        no fragment of this one, lacks its signature where union rounds need one, or resends merged work."""
        if delta.error is not None:
            return delta.error.reason, delta.error.detail
        header = delta.header
        assert header is not None
        if header.run_id != self.manifest.run_id:
            return AdmissionTag.WRONG_RUN, f"{header.run_id!r} != {self.manifest.run_id!r}"
        if header.manifest_hash != self.manifest.manifest_hash:
            return AdmissionTag.WRONG_MANIFEST, "peer runs a different manifest; update it"
        p = header.fragment
        if not 0 <= p < self.plan.num_fragments:
            return AdmissionTag.UNKNOWN_FRAGMENT, f"{p} not in [0, {self.plan.num_fragments})"
        if (
            self.manifest.wire.codec.sparse
        ):  # union rounds list this delta: every replica checks its signature
            unsigned = intake_problem(self.check, sender, header, delta.payload)
            if unsigned is not None:
                return unsigned
        merged = self.merged_already(sender, p, header.carries_since)
        if merged is not None and header.seq <= merged:  # this very delta was merged: resent as is
            return RobustTag.REPLAY, f"delta {header.seq} of fragment {p} was merged already"
        if merged is not None:
            # a delta released at a term change that the old holder merged after all: its work is in the
            # model; the learner adopts that update and resends only what came after
            return AdmissionTag.ALREADY_MERGED, (
                f"fragment {p}: delta {header.seq} carries work since delta {header.carries_since}, and "
                f"delta {merged} was merged already; adopt that update and resend the rest"
            )
        return None

    def _screen(
        self, sender: str, header: DeltaHeader, payload: bytes, now: float
    ) -> Reply | tuple[CounterCheck, Screened, Mapping[str, Tensor]]:
        """Decode the tensors once and screen them (shapes and norm bound, claimed counters, replay, the
        robust screens); the counters as weighed, the screens' verdict and what the round keeps, or the
        refusal."""
        p, wire = header.fragment, self.manifest.wire
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
        # a clipped delta is new values; an accepted one waits for its round in int8 (a quarter of float32:
        # with rounds open on several fragments, the synchronizer's largest holding)
        return counters, screened, kept if screened.decision.action == ACCEPT else screened.tensors

    def _join_round(
        self,
        sender: str,
        delta: InboundDelta,
        counters: CounterCheck,
        screened: Screened,
        payload: Mapping[str, Tensor],
        now: float,
    ) -> Reply:
        """Offer the screened delta to its fragment's round; accepted, it counts for the sender's standing."""
        header = delta.header
        assert header is not None
        p = header.fragment
        contribution = Contribution(
            sender=sender,
            anchor_version=header.anchor_version,
            tokens=counters.tokens,
            steps=counters.steps,
            received_at=now,
            payload=payload,
            seq=header.seq,
            frame=delta.frame if self.manifest.wire.codec.sparse else b"",  # a union round bundles the frame
            digest=delta_digest(delta.payload),
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
            live = len(live_learners | {c.sender for c in contributions})
            contributions, left_out = self._gather(p, contributions, now)
            if self.manifest.wire.codec.sparse:  # a round that lists `gather` deltas is a full round
                live = min(live, self.manifest.diloco.gather)
            record, pending, grad = self.merger.merge(p, contributions, live=live, term=self.term)
            if left_out:
                record = dataclasses.replace(record, left_out=left_out)
            for c in contributions:
                self.accepted_tokens[c.sender] += c.tokens
            self.rounds_done += 1
            self.decisions.append(
                f"fragment {p} v{record.from_version}->{record.to_version}: {decision.reason}"
            )
            outcomes.append(MergeOutcome(record, decision, pending, grad))
        return outcomes

    def _gather(
        self, p: int, contributions: list[Contribution], now: float
    ) -> tuple[list[Contribution], tuple[tuple[str, int], ...]]:
        """A sparse round's gather set (`protocol.gather`): the screened deltas its update lists, at most
        `[diloco] gather`, and the (learner, seq) of the rest, which the record names so that their learners
        send the work again. Dense rounds merge every screened delta, as before."""
        gather = self.manifest.diloco.gather
        if not self.manifest.wire.codec.sparse or len(contributions) <= gather:
            return contributions, ()
        standing = self.guard.standing
        chosen = choose(
            contributions,
            gather,
            waiting_since=lambda learner: standing.waiting_since(learner, p, now),
            ramp=standing.ramp,
            fragment=p,
            version=self.rounds.version(p),
            score=self.guard.scores.score,
        )
        for c in chosen.left_out:
            self.left_out[c.sender] += 1
            self.decisions.append(
                f"fragment {p}: {GatherTag.NOT_GATHERED} {c.sender}/{c.seq} ({c.tokens} tokens): "
                f"{gather} deltas rank ahead of it"
            )
        return list(chosen.listed), tuple(sorted((c.sender, c.seq) for c in chosen.left_out))

    def wake_at(self, now: float, live_learners: frozenset[str], hold: Collection[int]) -> float | None:
        """When `poll` may next close a round with no new event: a round's grace end (or `now`), a round
        gathering its first three deltas at `warmup_wait`; None when only a delta can close one. Held
        fragments (`hold`) are left to the caller."""
        awaited = live_learners - self.guard.cooling(now)
        wakes = []
        for p, at in self.rounds.next_deadline(now, awaited).items():
            current = self.rounds.round(p)
            if self._gathering(p, now, awaited) and current is not None:
                at = max(at, current.opened_at + self.guard.config.warmup_wait)
            if p not in hold:
                wakes.append(at)
        return min(wakes, default=None)

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
        return self._score_round(p, kept, now)

    def _score_round(self, p: int, contributions: list[Contribution], now: float) -> list[Contribution]:
        """The loss check and score (`protocol.loss_score`): each delta but the holder's own measured on the
        round's batch, its value folded into its key's score; those worse beyond the batch's noise dropped."""
        guard, cfg = self.guard, self.guard.config
        scored = [c for c in contributions if c.sender != self.peer_id]
        if guard.loss_probe is None or not scored:
            return contributions
        digests = (c.digest for c in contributions)
        verdicts = score_round(
            guard.loss_probe,
            guard.scores,
            [Scored(c.sender, c.tokens, c.payload, c.digest) for c in scored],
            seed=score_seed(self.manifest.run_id, p, self.rounds.version(p), self.term, digests),
            full_tokens=guard.tokens_per_step * guard.inner_steps,
            z=cfg.score_z,
            tolerance=cfg.loss_tolerance,
            now=now,
        )
        refused = {id(c) for c, v in zip(scored, verdicts) if v.decision.action != ACCEPT}
        for c, v in zip(scored, verdicts):
            if id(c) in refused:
                self._reject(c.sender, v.decision.tag, f"{v.decision.detail} (fragment {p})", now)
        return [c for c in contributions if id(c) not in refused]

    def finish(self, fragment: int, sync_seconds: float) -> None:
        """The update of `fragment` was applied locally and pushed; records the version and sync time."""
        self.rounds.finish(fragment, self.replica.versions()[fragment], sync_seconds)
