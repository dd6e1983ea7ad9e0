"""Outer updates on a peer: checking an update before it touches the replica, applying it, and the
bounded log of applied updates (decoded records) that other peers replay from.

The log is a `swarm.update_log.UpdateLog`, bounded in bytes by `[limits]`.

`UpdateBook.apply` is the one path by which an update reaches the replica, for pushed, replayed and the
synchronizer's own updates alike. It tells the learner (an `Adopt` message), the driver (an `Applied`
intent, which the ledger and event log follow) and remembers the update's term as the fragment's
branch tip term (`protocol.reconcile`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from enum import StrEnum

from torch import Tensor

from p2p_diloco.config import LimitsConfig, RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.decisions import Action
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.kernels import QuantizedTensor
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.protocol.replica import GlobalReplica, PendingUpdate
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.swarm.effects import Applied, Intent, ToLearner
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.learner import Adopt
from p2p_diloco.swarm.update_checks import UpdateChecks
from p2p_diloco.swarm.update_log import UpdateLog
from p2p_diloco.swarm.vouching import Ahead, Vouchers, reported_tips, trusted_ahead
from p2p_diloco.wire.codec import decode_tensors
from p2p_diloco.wire.frames import encode_update, update_signing_bytes
from p2p_diloco.wire.records import HeartbeatInfo
from p2p_diloco.wire.replies import Reply, ReplyStatus
from p2p_diloco.wire.signing import PeerKeys

# The default count bound of the log per fragment (`[limits] update_log_length`); a fetch of updates
# answers at most this many frames.
UPDATE_LOG_LENGTH = LimitsConfig().update_log_length
MAX_VERIFIED_SOURCES = 32


class UpdateSource(StrEnum):
    PUSHED = "pushed"  # pushed by the synchronizer
    REPLAYED = "replayed"  # fetched from a peer's log
    OWN = "own"  # merged by this peer as synchronizer


class UpdateBook:
    def __init__(
        self,
        manifest: RunManifest,
        plan: FragmentPlan,
        replica: GlobalReplica,
        journal: Journal,
        robust: RobustGuard,
        emit: Callable[[Intent], None],
        keys: PeerKeys,
        *,
        has_learner: bool,
    ):
        self.manifest = manifest
        self.keys = keys
        self.vouchers = Vouchers(plan.num_fragments)
        self.checks = UpdateChecks(manifest, plan.num_fragments, robust)
        self.plan = plan
        self.replica = replica
        self.journal = journal
        self.robust = robust
        self._emit = emit
        self.has_learner = has_learner
        # (learner, fragment) -> the highest delta seq of it an applied update merged: a delta carrying
        # work of an older one (resent after a term change) must not count it twice (`merged_already`)
        self.merged_seqs: dict[tuple[str, int], int] = {}
        sizes = [sum(_numel(s) for s in replica.shapes(p).values()) for p in range(plan.num_fragments)]
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
        """Whether the record carries its leader's signature (anyone may relay a record, none may forge one)."""
        return self.keys.check.verify(record.leader, update_signing_bytes(record), record.signature)

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
        self, live_peers: Mapping[str, HeartbeatInfo], peer_id: str, term_ceiling: int
    ) -> dict[int, Ahead]:
        """Fragments on which trusted tips of live peers (others than `peer_id`) are ahead of my replica
        (`swarm.vouching`: vouched for, or reported alike by two peers that may synchronize; tip terms
        capped at `term_ceiling`). Two strangers reporting the same made-up tip would otherwise make every
        honest peer think it lags, and no one would claim the lease."""
        reported = [
            reported_tips(live_peers, p, peer_id, term_ceiling) for p in range(self.plan.num_fragments)
        ]
        return trusted_ahead(self.vouchers, self.tips(), reported, self.manifest.may_synchronize)

    def check_record(self, run_id: str, manifest_hash: str, fragment: int) -> tuple[str, str] | None:
        """(tag, detail) if a record is not for this run, manifest or fragment layout."""
        if run_id != self.manifest.run_id:
            return ("wrong run", f"{run_id!r} is not this run ({self.manifest.run_id!r})")
        if manifest_hash != self.manifest.manifest_hash:
            return ("wrong manifest", "the sender runs a different manifest")
        if not 0 <= fragment < self.plan.num_fragments:
            return ("unknown fragment", f"{fragment} not in [0, {self.plan.num_fragments})")
        return None

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
            pending, grad = computed
            values = self.checks.value_check(p, grad)
            bad = self.checks.check_contributors(record) or values.problem
            if bad:
                return Reply.refused(*bad)
            decision = self.replica.commit(pending, expected_checksum=record.checksum)
        else:
            bad = self.checks.check_payload(record)
            if bad:
                return self.journal.reject(source, bad[0], f"update of fragment {p}: {bad[1]}")
            try:
                grad = decode_tensors(  # int8 stays int8 until the outer step decodes it on the fly
                    record.payload,
                    expected_shapes=self.replica.shapes(p),
                    max_bytes=self.manifest.wire.max_message_bytes,
                    lazy=True,
                )
            except DecodeError as exc:
                return self.journal.reject(source, exc.reason, f"update payload: {exc.detail}")
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
        if decision.action != Action.APPLY:
            return Reply.of(ReplyStatus.REFUSED, decision)
        self.robust.observe_update(p, grad, norm=values.norm)
        self.robust.standing.note_merged((peer for peer, _ in record.contributors), now)
        self.vouchers.vouch(record)
        self.tip_terms[p] = record.term
        for (peer, _), seq in zip(record.contributors, record.seqs):
            key = (peer, p)
            self.merged_seqs[key] = max(seq, self.merged_seqs.get(key, 0))
        self.log.append(record)
        self.applied += 1
        if how != UpdateSource.OWN:
            self.verified_sources.pop(source, None)
            self.verified_sources[source] = None
            if len(self.verified_sources) > MAX_VERIFIED_SOURCES:
                del self.verified_sources[next(iter(self.verified_sources))]
        if self.has_learner:
            self._emit(ToLearner(Adopt(record, old, self.replica.params_view(p), record.to_version)))
        self._emit(Applied(record, source, how))
        return Reply.of(ReplyStatus.APPLIED, decision)

    def merged_already(self, sender: str, fragment: int, carries_since: int) -> int | None:
        """The seq of `sender`'s delta of `fragment` already merged that a delta carrying work since
        `carries_since` repeats (None if it repeats none)."""
        merged = self.merged_seqs.get((sender, fragment), 0)
        return merged if merged >= carries_since else None

    def frames_after(self, fragment: int, after_version: int) -> list[bytes]:
        """The logged updates of `fragment` from `after_version` on, as frames (what a replaying peer gets)."""
        oldest = self.log.oldest_version(fragment)
        if oldest is not None and oldest > after_version:
            return []  # dropped out of the bounded log: the requester downloads a snapshot instead
        return [encode_update(r) for r in self.log.after(fragment, after_version)]

    def forget(self, fragment: int) -> None:
        """The fragment was replaced by a snapshot: its logged updates no longer lead to its state."""
        self.log.clear(fragment)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
