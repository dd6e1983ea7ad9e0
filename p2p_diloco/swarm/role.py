"""The synchronizer role of one peer: the `Synchronizer` of the term it holds, and what it publishes.

While the peer holds the lease, deltas addressed to it go to that term's `Synchronizer`; its sync ticks
close the rounds that are ready, install each merged update on the peer's own replica through
`UpdateBook.apply` (the outer step computed once, by the synchronizer) and push it to every live peer.
The role changes only on the peer's owner thread, so a term's end (merge the open rounds, then release
the lease) is one step that no delta or merge can interleave with.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.messages import UpdateRecord, UpdateTag
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.deltas import DeltaRouting
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.membership import Membership
from p2p_diloco.swarm.synchronizer import Synchronizer, outer_feedback_for
from p2p_diloco.swarm.updates import UpdateBook, UpdateSource
from p2p_diloco.wire.frames import decode_delta, encode_update
from p2p_diloco.wire.replies import Reply, ReplyStatus


class SynchronizerRole:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        plan: FragmentPlan,
        replica: GlobalReplica,
        shapes: dict[str, tuple[int, ...]],
        embedding_names: Collection[str],
        robust: RobustGuard,
        book: UpdateBook,
        deltas: DeltaRouting,
        membership: Membership,
        journal: Journal,
        emit: Callable[[fx.Intent], None],
        handover_holding: Callable[[float], bool] = lambda now: False,
    ):
        self.peer_id = peer_id
        self.manifest = manifest
        self.plan = plan
        self.replica = replica
        self.shapes = shapes
        self.embedding_names = embedding_names
        self.robust = robust  # shared by every term of this peer
        self.book = book
        self.deltas = deltas
        self.membership = membership
        self.journal = journal
        self._emit = emit
        self._handover_holding = handover_holding  # `Handover.holding`: a new term's check is not done
        # fragment -> (a version trusted tips of live peers hold, when first seen): while the replica lacks
        # it, the fragment's rounds wait for the catch-up (an update from behind would fork the fragment
        # and win over the newer versions), but at most `timing.lease_ttl`: a run never halts on it
        self.behind: dict[int, tuple[int, float]] = {}
        self._fence_noted: float | None = None  # the lease expiry a fence was last noted for
        self._gave_up: dict[int, int] = {}  # fragment -> the highest version a wait ran out for
        self.sync: Synchronizer | None = None
        # Sparse codecs: what an update left out is carried into the fragment's next update. One store
        # for every term this peer holds, so a rotation back to it loses nothing; a failover to another
        # peer loses at most that residual (measured harmless: docs/results/sparse, docs/wire_codecs.md).
        self.outer_feedback = outer_feedback_for(manifest)

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
            outer_feedback=self.outer_feedback,
            merged_already=self.book.merged_already,
        )
        self.membership.term_seen = max(self.membership.term_seen, term)
        self.behind.clear()
        self._gave_up.clear()
        self.journal.note(f"became synchronizer for term {term} at versions {self.replica.versions()}")

    def wait_for(self, fragment: int, version: int, now: float) -> bool:
        """Hold `fragment`'s rounds until the replica reaches `version` (see `behind`); False if already
        held for that version or beyond."""
        held = self.behind.get(fragment)
        if (held is not None and held[0] >= version) or version <= self._gave_up.get(fragment, -1):
            return False
        self.behind[fragment] = (version, held[1] if held is not None else now)
        return True

    def held(self, now: float) -> frozenset[int]:
        """The fragments whose rounds wait for a catch-up now: all of them while the term's handover check
        (`swarm.handover`) runs."""
        if self._handover_holding(now):
            return frozenset(range(self.plan.num_fragments))
        limit = self.manifest.timing.lease_ttl
        for p, (version, since) in sorted(self.behind.items()):
            if self.replica.version(p) >= version:
                del self.behind[p]
            elif now - since >= limit:
                del self.behind[p]
                self._gave_up[p] = version  # not again for this version: one wait per tip, not one per read
                self.journal.note(
                    f"fragment {p}: not caught up to v{version} within {limit:.1f}s; merging from "
                    f"v{self.replica.version(p)}"
                )
        return frozenset(self.behind)

    def tick(self, now: float, *, sync_seconds: float = 0.0, cap: float | None = None) -> list[UpdateRecord]:
        """Close ready rounds; apply each update here (its outer step computed once), push it to every
        live peer."""
        if self.sync is None or self._fenced(now):
            return []
        published = []
        for outcome in self.sync.poll(now, self.membership.live_learners(now), cap, hold=self.held(now)):
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
            self.deltas.on_merged(record)
            frame = encode_update(record)
            for peer in sorted(self.membership.live_peers):
                if peer != self.peer_id:
                    self._emit(fx.PushUpdate(peer, frame))
            self.sync.finish(record.fragment, sync_seconds)
            published.append(record)
            self._emit(fx.Published(record))
        return published

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

    def handle_delta(self, sender: str, frame: bytes, now: float) -> Reply:
        if not self.membership.allowed(sender):
            return self.journal.reject(
                sender, AdmissionTag.NOT_ALLOWED, "sender is not in the run's allowlist"
            )
        if self.sync is None:
            try:
                decode_delta(frame, max_bytes=self.manifest.wire.max_message_bytes)
            except DecodeError as exc:
                return self.journal.reject(sender, exc.reason, exc.detail)
            return self.journal.reject(
                sender, UpdateTag.NOT_SYNCHRONIZER, f"{self.peer_id} does not hold the lease"
            )
        return self.sync.handle_delta(sender, frame, now)
