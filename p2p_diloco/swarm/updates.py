"""Outer updates on a peer: the checks every update passes before it reaches the replica, applying it,
and the bounded log of applied updates (`swarm.update_log.UpdateLog`) that other peers replay from.

`UpdateBook.accept` takes an update frame pushed by the synchronizer or replayed from a peer's log and
checks it (allowlist, frame, run and manifest, fencing, leader, signature, lease, and its content:
`UpdateChecks`); a pushed one that does not follow this replica comes back with the repair it needs
(`RepairNeeded`), which the peer starts. `UpdateBook.apply` is the one path by which an update reaches
the replica, the synchronizer's own included: it tells the outbox (`merged`: the learner's delta in
flight it merged and the learner's `Adopt`), the driver (`Applied`) and remembers the update's term as
the fragment's branch tip term (`protocol.reconcile`).

A sparse round's update is merged here from the learner-signed deltas it lists (`swarm.sparse_rounds`):
one listed delta that does not check refuses the whole record. A leaseholder is trusted to merge, not to
write anything it likes: `UpdateChecks` refuses a payload not
in the manifest's codec, a non-finite value, a tensor whose RMS is above what AdamW can move in the most
steps a delta may count, contributors that may not learn and weights no learner can earn. The checks
depend on the update and the manifest only, so every replica reaches the same verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from operator import itemgetter

from torch import Tensor

from p2p_diloco.config import LimitsConfig, RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import kernels, lease_rules, reconcile
from p2p_diloco.protocol.decisions import Action, AdmissionTag, Decision
from p2p_diloco.protocol.kernels import QuantizedTensor
from p2p_diloco.protocol.messages import UpdateRecord, UpdateTag
from p2p_diloco.protocol.outer_step import PendingUpdate
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.protocol.replica import ReplicaTag
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.swarm.effects import Applied, RepairKind, RepairNeeded, Task, Tensors
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import PeerContext
from p2p_diloco.swarm.sparse_rounds import open_record, outer_grad_of
from p2p_diloco.swarm.update_log import UpdateLog
from p2p_diloco.swarm.vouching import Ahead, Vouchers, reported_tips, trusted_ahead
from p2p_diloco.wire.codecs.codec import frame_codec
from p2p_diloco.wire.frames import decode_update, encode_update, update_signing_bytes
from p2p_diloco.wire.records import HeartbeatInfo
from p2p_diloco.wire.replies import Reply, ReplyStatus
from p2p_diloco.wire.signing import PeerKeys

# The default count bound of the log per fragment (`[limits] update_log_length`); a fetch of updates
# answers at most this many frames.
UPDATE_LOG_LENGTH = LimitsConfig().update_log_length
MAX_VERIFIED_SOURCES = 32


# Refusals of a pushed update that say where this replica stands, not what the update holds: the leader
# still vouches for the version it names. An update whose content was refused (a listed delta that does not
# check, a non-finite value) vouches for nothing, or its leader's snapshot would be fetched in its place.
_STATE_TAGS = (ReplicaTag.DUPLICATE_UPDATE, ReplicaTag.OUT_OF_ORDER, ReplicaTag.CHECKSUM_MISMATCH)


class UpdateSource(StrEnum):
    PUSHED = "pushed"  # pushed by the synchronizer
    RELAYED = "relayed"  # relayed by a peer that applied it (`swarm.relay`): checked as if pushed
    REPLAYED = "replayed"  # fetched from a peer's log
    OWN = "own"  # merged by this peer as synchronizer


@dataclass(frozen=True)
class Verdict:
    """`UpdateBook.accept`'s answer: the reply for the sender, the record if it decoded, and the repair a
    refused pushed update needs (None: nothing to start)."""

    reply: Reply
    record: UpdateRecord | None = None
    repair: RepairNeeded | None = None


def repair_for(record: UpdateRecord, sender: str, before: BranchTip, tag: str) -> RepairNeeded | None:
    """The repair a pushed update refused with `tag` needs, given my tip `before` it arrived."""
    p, sources = record.fragment, (sender,)
    if record.term > before.term and tag in _STATE_TAGS:
        theirs = BranchTip(record.term, record.to_version, record.checksum)
        proof = None
        if tag == ReplicaTag.CHECKSUM_MISMATCH:
            proof = reconcile.fork_proven(
                before, theirs, update_term=record.term, from_version=record.from_version
            )
        return RepairNeeded(RepairKind.RECONCILE, p, sources, theirs=theirs, proof=proof)
    if tag == ReplicaTag.OUT_OF_ORDER:
        return RepairNeeded(RepairKind.CATCH_UP, p, sources, target=record.to_version)
    if tag == ReplicaTag.CHECKSUM_MISMATCH:
        return RepairNeeded(RepairKind.REFETCH, p, sources)
    return None


class UpdateChecks:
    def __init__(self, manifest: RunManifest, num_fragments: int, robust: RobustGuard):
        self.manifest = manifest
        self.robust = robust
        tps = robust.tokens_per_step * (1 + robust.config.token_tolerance)
        self.max_weight = robust.max_steps * tps * tps * (1 + 1e-6)
        self.max_rms = robust.config.prior_factor * manifest.diloco.inner_lr * robust.max_steps

    def check_payload(self, record: UpdateRecord) -> tuple[str, str] | None:
        """Before decoding: the payload's codec must be the manifest's."""
        codec = frame_codec(record.payload)
        if codec != self.manifest.wire.codec:
            return UpdateTag.WRONG_CODEC, f"payload is {codec}, the manifest says {self.manifest.wire.codec}"
        return self.check_contributors(record)

    def check_contributors(self, record: UpdateRecord) -> tuple[str, str] | None:
        """The first contributor that may not learn, or whose weight no honest delta reaches; None if none.
        A run that lets anyone learn asks only for the heaviest weight (every peer checks every update's
        contributors: issue #40)."""
        pairs = record.contributors
        if self.manifest.anyone_may_learn:
            if (
                not self.robust.config.enabled
                or max(map(itemgetter(1), pairs), default=0.0) <= self.max_weight
            ):
                return None
        for peer, weight in pairs:
            if not self.manifest.may_learn(peer):
                return UpdateTag.UNKNOWN_CONTRIBUTOR, f"{peer} may not learn in this run"
            if self.robust.config.enabled and weight > self.max_weight:
                return (
                    UpdateTag.IMPLAUSIBLE_WEIGHT,
                    f"{peer}'s weight {weight:.3g} > {self.max_weight:.3g} allowed",
                )
        return None

    def check_values(
        self, fragment: int, grad: Mapping[str, Tensor | kernels.QuantizedTensor]
    ) -> tuple[str, str] | None:
        """After decoding: finite values, and no tensor whose RMS exceeds what AdamW can move in the most
        steps a delta may count (`[robust] prior_factor` x inner_lr x max_steps): a merge of screened
        deltas never does, a destructive update (random weights, a huge step) does by orders of magnitude.
        A tensor still in int8 form is finite by construction (its decoding checked the block scales)."""
        return self.value_check(fragment, grad).problem

    def value_check(self, fragment: int, grad: Mapping[str, Tensor | kernels.QuantizedTensor]) -> ValueCheck:
        """`check_values`, with the fragment's L2 norm it computed on the way (None where the robust
        checks are off), which the direction reference reuses instead of a second pass."""
        squares = 0.0
        for name, tensor in grad.items():
            if not isinstance(tensor, kernels.QuantizedTensor) and not kernels.all_finite(tensor):
                return ValueCheck((UpdateTag.NOT_FINITE, f"{name} holds NaN or inf"))
            if not self.robust.config.enabled or tensor.numel() == 0:
                continue
            tensor_squares = kernels.sum_squares64(tensor)
            squares += tensor_squares
            rms = math.sqrt(tensor_squares) / math.sqrt(tensor.numel())
            if rms > self.max_rms:
                detail = f"{name} RMS {rms:.3g} > {self.max_rms:.3g} (prior_factor x inner_lr x max steps)"
                return ValueCheck((UpdateTag.TOO_LARGE, detail))
        return ValueCheck(None, math.sqrt(squares) if self.robust.config.enabled else None)


@dataclass(frozen=True)
class ValueCheck:
    problem: tuple[str, str] | None  # (tag, detail) of the first problem found, None when the values pass
    norm: float | None = None  # the fragment's L2 norm (float64 sums), when computed


class UpdateBook:
    def __init__(
        self,
        ctx: PeerContext,
        robust: RobustGuard,
        keys: PeerKeys,
        membership: Membership,
        *,
        has_learner: bool,
    ):
        manifest, plan, replica = ctx.manifest, ctx.plan, ctx.replica
        self.manifest, self.plan, self.replica = manifest, plan, replica
        self.journal, self._emit = ctx.journal, ctx.emit
        self.membership = membership
        # told of every applied update, however it came (pushed, relayed, replayed, own), with the fragment's
        # values before and after: the outbox settles its delta in flight and tells the learner
        # (`Outbox.on_applied`)
        self.merged: Callable[[UpdateRecord, Tensors, Tensors], None] = lambda record, old, new: None
        self._ahead: tuple[Mapping[str, HeartbeatInfo], tuple, dict[int, Ahead]] | None = None  # last answer
        self._reported: tuple[Mapping[str, HeartbeatInfo], tuple, list[dict[str, BranchTip]]] | None = None
        self.keys = keys
        self.vouchers = Vouchers(plan.num_fragments)
        self.checks = UpdateChecks(manifest, plan.num_fragments, robust)
        self.robust = robust
        self.has_learner = has_learner
        # by fragment, learner -> the highest delta seq of it an applied update merged: a delta carrying
        # work of an older one (resent after a term change) must not count it twice (`merged_already`)
        self.merged_seqs: list[dict[str, int]] = [{} for _ in range(plan.num_fragments)]
        sizes = [sum(math.prod(s) for s in replica.shapes(p).values()) for p in range(plan.num_fragments)]
        limits = manifest.limits
        self.log = UpdateLog(
            sizes, budget_bytes=limits.update_log_budget(sum(sizes)), max_length=limits.update_log_length
        )
        # Per fragment, the term of the update that produced the replica's version (0: initial or unknown,
        # e.g. restored from disk); see protocol/reconcile.py.
        self.tip_terms: list[int] = [0] * plan.num_fragments
        self.applied = 0
        # Peers that pushed or served an update this peer checked and applied, newest last (the handover
        # check may ask them besides the listed synchronizers); at most MAX_VERIFIED_SOURCES
        self.verified_sources: dict[str, None] = {}

    def tip(self, fragment: int) -> BranchTip:
        return BranchTip(
            self.tip_terms[fragment], self.replica.version(fragment), self.replica.checksum(fragment)
        )

    def tips(self) -> list[BranchTip]:
        return [self.tip(p) for p in range(self.plan.num_fragments)]

    def signed_by_leader(self, record: UpdateRecord) -> bool:
        """Whether the record carries its leader's signature (anyone may relay a record, none may forge
        one)."""
        return self.keys.check.verify(record.leader, update_signing_bytes(record), record.signature)

    def content_checks(self, record: UpdateRecord) -> bool:
        """Whether what `record` holds checks without this replica's state: a sparse round's listed deltas
        (`swarm.sparse_rounds.open_record`); a dense update's payload is checked when applied."""
        if not self.manifest.wire.codec.sparse:
            return True
        if self.check_record(record.run_id, record.manifest_hash, record.fragment) is not None:
            return False
        opened = open_record(record, self.keys.check, self.manifest, self.replica.shapes(record.fragment))
        return not isinstance(opened, tuple)

    def sign(self, record: UpdateRecord) -> UpdateRecord:
        return replace(record, signature=self.keys.signer.sign(update_signing_bytes(record)))

    def verified_newest(self, trusted: Mapping[int, int] | None = None) -> int:
        """The sum over fragments of the newest version this peer holds, has seen vouched for, or sees in
        trusted tips of live peers (`trusted[p]`, from `vouching.trusted_ahead`)."""
        trusted = trusted or {}
        return sum(
            max(self.replica.version(p), self.vouchers.newest(p), trusted.get(p, 0))
            for p in range(self.plan.num_fragments)
        )

    def trusted_ahead(
        self, live_peers: Mapping[str, HeartbeatInfo], peer_id: str, term_ceiling: int | Sequence[int]
    ) -> dict[int, Ahead]:
        """Fragments on which trusted tips of live peers (others than `peer_id`) are ahead of my replica
        (`swarm.vouching`: vouched for, or reported alike by two peers that may synchronize; tip terms
        capped at `term_ceiling`, or at `term_ceiling[p]`: the terms of each fragment's shard). Two strangers
        reporting the same made-up tip would otherwise make every honest peer think it lags, and no one would
        claim the lease."""
        fragments = range(self.plan.num_fragments)
        ceilings = [term_ceiling] * len(fragments) if isinstance(term_ceiling, int) else term_ceiling
        tips = self.tips()
        key = (peer_id, tuple(ceilings), self.vouchers.generation, tuple(tips))
        cached = self._ahead
        if cached is not None and cached[0] is live_peers and cached[1] == key:
            return cached[2]  # every shard's election of one read asks the same (issue #40)
        reported = self.reported(live_peers, peer_id, ceilings)
        ahead = trusted_ahead(self.vouchers, tips, reported, self.manifest.may_synchronize)
        self._ahead = (live_peers, key, ahead)
        return ahead

    def reported(
        self, live_peers: Mapping[str, HeartbeatInfo], peer_id: str, ceilings: Sequence[int]
    ) -> list[dict[str, BranchTip]]:
        """Per fragment, the other live peers' tips, terms capped at `ceilings[p]` (`vouching.reported_tips`),
        computed once per read: every seat's election and the anti-entropy round of one read ask the same
        (issue #40). Callers must not change what it returns."""
        key = (peer_id, tuple(ceilings))
        cached = self._reported
        if cached is not None and cached[0] is live_peers and cached[1] == key:
            return cached[2]
        reported = reported_tips(live_peers, peer_id, ceilings)
        self._reported = (live_peers, key, reported)
        return reported

    def check_record(self, run_id: str, manifest_hash: str, fragment: int) -> tuple[str, str] | None:
        """(tag, detail) if a record is not for this run, manifest or fragment layout."""
        if run_id != self.manifest.run_id:
            return (AdmissionTag.WRONG_RUN, f"{run_id!r} is not this run ({self.manifest.run_id!r})")
        if manifest_hash != self.manifest.manifest_hash:
            return (AdmissionTag.WRONG_MANIFEST, "the sender runs a different manifest")
        if not 0 <= fragment < self.plan.num_fragments:
            return (AdmissionTag.UNKNOWN_FRAGMENT, f"{fragment} not in [0, {self.plan.num_fragments})")
        return None

    def accept(
        self, frame: bytes, source: str, how: UpdateSource, now: float, record: UpdateRecord | None = None
    ) -> Task:
        """Check an update frame pushed by `source` or replayed from its log, then `apply` it; a task that
        returns a `Verdict`. Pushed: the allowlist, the frame, run and manifest, term fencing, that the
        sender is the leader it names, the leader's signature, a valid lease of that term
        (`Membership.verify_lease`) live when it arrived; a refused one that does not follow this replica
        names the repair it needs. Replayed: the frame, the signature, a lease of that term (past terms
        of synchronizers count), and it must extend the replica (else `SKIPPED`, no offence). Relayed:
        as pushed, but from any peer of the run (`swarm.relay`: relaying extends no trust). `record`: the
        frame already decoded (a relayed one is, to learn which update it is), so it is not decoded twice."""
        pushed = how in (UpdateSource.PUSHED, UpdateSource.RELAYED)
        if pushed and not self.membership.allowed(source):
            return Verdict(
                self.journal.reject(source, AdmissionTag.NOT_ALLOWED, "sender is not in the run's allowlist")
            )
        record = record if record is not None else self._decoded(frame, source, pushed)
        if isinstance(record, Reply):
            return Verdict(record)
        if not pushed:
            return Verdict((yield from self._replayed(record, source, now)), record)
        bad = self.check_record(record.run_id, record.manifest_hash, record.fragment)
        if bad:
            return Verdict(self.journal.reject(source, *bad), record)
        leases = self.membership.for_fragment(record.fragment)  # its shard's leases and terms
        fencing = lease_rules.should_accept_update(record.term, leases.term_seen)
        if fencing.action != lease_rules.ACCEPT:
            return Verdict(self.journal.reject(source, fencing.tag, fencing.detail), record)
        term = record.term
        if record.leader != source and how == UpdateSource.PUSHED:
            detail = f"update of term {term} names {record.leader}"
            return Verdict(self.journal.reject(source, UpdateTag.NOT_THE_LEADER, detail), record)
        if not self.signed_by_leader(record):
            return Verdict(
                self.journal.reject(source, UpdateTag.BAD_SIGNATURE, f"update of term {term}"), record
            )
        if not (yield from leases.verify_lease(record.leader, term, now)):
            return Verdict(
                self.journal.reject(
                    source, UpdateTag.NO_LEASE, f"{source} never held a valid lease of term {term}"
                ),
                record,
            )
        if not leases.lease_live_at(record.leader, term, now):
            detail = f"{source}'s lease of term {term} is not live at {now:.2f}"
            return Verdict(self.journal.reject(source, UpdateTag.LEASE_NOT_LIVE, detail), record)
        leases.saw_term(term)
        before = self.tip(record.fragment)
        reply = self.apply(record, source=source, how=how, now=now)
        if reply.status == ReplyStatus.APPLIED:
            return Verdict(reply, record)
        if reply.tag in _STATE_TAGS:  # not checkable against this replica: vouched for, to catch up to
            self.vouchers.vouch(record)
        if reply.tag not in (ReplicaTag.DUPLICATE_UPDATE, ReplicaTag.OUT_OF_ORDER) and not (
            term > before.term and reply.tag == ReplicaTag.CHECKSUM_MISMATCH
        ):
            self.journal.note(f"update from {source} refused: {reply}")
        return Verdict(reply, record, repair_for(record, source, before, reply.tag))

    def _decoded(self, frame: bytes, source: str, pushed: bool) -> UpdateRecord | Reply:
        """`frame`'s record, or the refusal of a frame that does not decode."""
        try:
            return decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
        except DecodeError as exc:
            detail = exc.detail if pushed else f"replayed update: {exc.detail}"
            return self.journal.reject(source, exc.reason, detail)

    def _replayed(self, record: UpdateRecord, source: str, now: float) -> Task:
        if not self.signed_by_leader(record):
            detail = f"replayed update of term {record.term} naming {record.leader}"
            return self.journal.reject(source, UpdateTag.BAD_SIGNATURE, detail)
        leases = self.membership.for_fragment(record.fragment)
        if not (yield from leases.verify_lease(record.leader, record.term, now, past_terms=True)):
            detail = f"replayed update of term {record.term} by {record.leader}"
            return self.journal.reject(source, UpdateTag.NO_LEASE, detail)
        if self.check_record(record.run_id, record.manifest_hash, record.fragment) is None:
            if record.from_version == self.replica.version(record.fragment):
                return self.apply(record, source=source, how=UpdateSource.REPLAYED, now=now)
        return Reply.refused(UpdateTag.SKIPPED)

    def apply(
        self,
        record: UpdateRecord,
        *,
        source: str,
        how: UpdateSource,
        now: float,
        computed: tuple[PendingUpdate, Mapping[str, Tensor | QuantizedTensor]] | None = None,
    ) -> Reply:
        """Apply `record` if it is the next update of its fragment and its result matches its checksum.

        `computed`: the synchronizer's own update, its outer step already computed (with the outer
        gradient it came from), installed as is: the holder runs the outer step once."""
        p = record.fragment
        old = self.replica.params_view(p)
        if computed is not None:
            outcome = self._install_computed(record, *computed)
        else:
            outcome = self._step_received(record, source)
        if isinstance(outcome, Reply):
            return outcome
        decision, grad, values = outcome
        if decision.action != Action.APPLY:
            return Reply.of(ReplyStatus.REFUSED, decision)
        self._note_applied(record, grad, values, source=source, how=how, now=now)
        self.merged(record, old, self.replica.params_view(p))
        self._emit(Applied(record, source, how))
        return Reply.of(ReplyStatus.APPLIED, decision)

    def _install_computed(
        self, record: UpdateRecord, pending: PendingUpdate, grad: Mapping[str, Tensor | QuantizedTensor]
    ) -> tuple[Decision, Mapping[str, Tensor | QuantizedTensor], ValueCheck] | Reply:
        """The synchronizer's own update, checked as any other, its computed result committed as is."""
        values = self.checks.value_check(record.fragment, grad)
        bad = self.checks.check_contributors(record) or values.problem
        if bad:
            return Reply.refused(*bad)
        return self.replica.commit(pending, expected_checksum=record.checksum), grad, values

    def _step_received(
        self, record: UpdateRecord, source: str
    ) -> tuple[Decision, Mapping[str, Tensor | QuantizedTensor], ValueCheck] | Reply:
        """A received update: its outer gradient (a sparse round's merged here from the signed deltas it
        lists), checked, then the outer step taken on the replica."""
        p = record.fragment
        sparse = self.manifest.wire.codec.sparse  # union rounds: merged here from the listed signed deltas
        bad = self.checks.check_contributors(record) if sparse else self.checks.check_payload(record)
        grad = bad or outer_grad_of(record, self.keys.check, self.manifest, self.replica.shapes(p))
        if isinstance(grad, tuple):  # e.g. a listed delta that does not check: refused, nothing changes
            return self.journal.reject(source, grad[0], f"update of fragment {p}: {grad[1]}")
        values = self.checks.value_check(p, grad)
        if values.problem:
            tag, detail = values.problem
            return self.journal.reject(source, tag, f"update of fragment {p}: {detail}")
        cfg = self.manifest.diloco
        decision = self.replica.apply(
            p,
            record.from_version,
            grad,
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            expected_checksum=record.checksum,
        )
        if sparse and decision.tag == ReplicaTag.CHECKSUM_MISMATCH:
            return self._merge_mismatch(record, source, decision.reason)
        return decision, grad, values

    def _merge_mismatch(self, record: UpdateRecord, source: str, reason: str) -> Reply:
        """A union round merged here, on this replica's own state at the record's base version, to another
        result than the record claims: refused as content (counted against `source`, vouching for nothing,
        no refetch of the claimed state), and its leader is caught (`Vouchers.catch`): a forged merge."""
        self.vouchers.catch(record.leader)
        computed = reason.split("; replica unchanged", 1)[0]  # no refetch: the claimed state is the forgery
        detail = (
            f"update of fragment {record.fragment} by {record.leader} (term {record.term}): its listed "
            f"deltas merge here to another result ({computed}); replica unchanged, {record.leader} vouches "
            "for nothing now"
        )
        return self.journal.reject(source, UpdateTag.MERGE_MISMATCH, detail)

    def _note_applied(
        self,
        record: UpdateRecord,
        grad: Mapping[str, Tensor | QuantizedTensor],
        values: ValueCheck,
        *,
        source: str,
        how: UpdateSource,
        now: float,
    ) -> None:
        """What an applied update changes besides the replica: the robust reference, standings, vouchers,
        the branch tip term, merged seqs, the log and, for a received one, the sources verified lately."""
        p = record.fragment
        self.robust.observe_update(p, grad, norm=values.norm)
        self.robust.standing.note_merged((peer for peer, _ in record.contributors), now, record.fragment)
        self.vouchers.vouch(record)
        self.tip_terms[p] = record.term
        merged = self.merged_seqs[p]
        for (peer, _), seq in zip(record.contributors, record.seqs):
            if seq > merged.get(peer, 0):
                merged[peer] = seq
        self.log.append(record)
        self.applied += 1
        if how != UpdateSource.OWN:
            self.verified_sources.pop(source, None)
            self.verified_sources[source] = None
            if len(self.verified_sources) > MAX_VERIFIED_SOURCES:
                del self.verified_sources[next(iter(self.verified_sources))]

    def merged_already(self, sender: str, fragment: int, carries_since: int) -> int | None:
        """The seq of `sender`'s delta of `fragment` already merged that a delta carrying work since
        `carries_since` repeats (None if it repeats none)."""
        if not 0 <= fragment < len(self.merged_seqs):
            return None
        merged = self.merged_seqs[fragment].get(sender, 0)
        return merged if merged >= carries_since else None

    def frames_after(self, fragment: int, after_version: int) -> list[bytes]:
        """The logged updates of `fragment` from `after_version` on, as frames (what a replaying peer
        gets)."""
        oldest = self.log.oldest_version(fragment)
        if oldest is not None and oldest > after_version:
            return []  # dropped out of the bounded log: the requester downloads a snapshot instead
        return [encode_update(r) for r in self.log.after(fragment, after_version)]

    def forget(self, fragment: int) -> None:
        """The fragment was replaced by a snapshot: its logged updates no longer lead to its state."""
        self.log.clear(fragment)
