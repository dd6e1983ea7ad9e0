"""Pushed updates: the checks every one passes before it reaches the replica, and what a refused one starts.

A pushed update is checked in order: the allowlist, the frame, run and manifest, term fencing, that the
sender is the leader it names, the leader's signature, that the leader held a valid lease of that term
(`Repair.verify_lease`) live when the update arrived; only then does the record vouch for its state and
go through `UpdateBook.apply`. One that does not follow this replica starts a catch-up (a gap) or a
reconciliation (a newer term's branch), as a repair task of the peer.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import election, reconcile
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.protocol.messages import UpdateRecord, UpdateTag
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.protocol.replica import ReplicaTag
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.deltas import DeltaRouting
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.membership import Membership
from p2p_diloco.swarm.repair import Repair
from p2p_diloco.swarm.updates import UpdateBook, UpdateSource
from p2p_diloco.wire.frames import decode_update
from p2p_diloco.wire.replies import Reply, ReplyStatus

Task = Generator[fx.Request, Any, Any]


class UpdateIntake:
    def __init__(
        self,
        manifest: RunManifest,
        membership: Membership,
        book: UpdateBook,
        repair: Repair,
        deltas: DeltaRouting,
        journal: Journal,
        start_repair: Callable[[int, Task], None],
    ):
        self.manifest = manifest
        self.membership = membership
        self.book = book
        self.repair = repair
        self.deltas = deltas
        self.journal = journal
        self.start_repair = start_repair  # `Peer._start_repair`: one repair task per fragment at a time

    def receive(self, sender: str, frame: bytes, now: float) -> Task:
        """A pushed update: checks (allowlist, frame, run, fencing, leader, lease), then `UpdateBook.apply`;
        one that does not follow this replica starts a catch-up or a reconciliation."""
        if not self.membership.allowed(sender):
            return self.journal.reject(
                sender, AdmissionTag.NOT_ALLOWED, "sender is not in the run's allowlist"
            )
        try:
            record = decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
        except DecodeError as exc:
            return self.journal.reject(sender, exc.reason, exc.detail)
        bad = self.book.check_record(record.run_id, record.manifest_hash, record.fragment)
        if bad:
            return self.journal.reject(sender, bad[0], bad[1])
        fencing = election.should_accept_update(record.term, self.membership.term_seen)
        if fencing.action != election.ACCEPT:
            return self.journal.reject(sender, fencing.tag, fencing.detail)
        if record.leader != sender:
            return self.journal.reject(
                sender, UpdateTag.NOT_THE_LEADER, f"update of term {record.term} names {record.leader}"
            )
        if not self.book.signed_by_leader(record):
            return self.journal.reject(sender, UpdateTag.BAD_SIGNATURE, f"update of term {record.term}")
        if not (yield from self.repair.verify_lease(record.leader, record.term, now)):
            return self.journal.reject(
                sender, UpdateTag.NO_LEASE, f"{sender} never held a valid lease of term {record.term}"
            )
        if not self.membership.lease_live_at(record.leader, record.term, now):
            return self.journal.reject(
                sender,
                UpdateTag.LEASE_NOT_LIVE,
                f"{sender}'s lease of term {record.term} is not live at {now:.2f}",
            )
        self.book.vouchers.vouch(record)
        self.membership.term_seen = max(self.membership.term_seen, record.term)
        before = self.book.tip(record.fragment)
        reply = self.book.apply(record, source=sender, how=UpdateSource.PUSHED, now=now)
        if reply.status == ReplyStatus.APPLIED:
            self.deltas.on_merged(record)
            return reply
        self._after_refused(record, sender, before, reply)
        return reply

    def _after_refused(self, record: UpdateRecord, sender: str, before: BranchTip, reply: Reply) -> None:
        p, tag = record.fragment, reply.tag
        if record.term > before.term and tag in (
            ReplicaTag.DUPLICATE_UPDATE,
            ReplicaTag.OUT_OF_ORDER,
            ReplicaTag.CHECKSUM_MISMATCH,
        ):
            # An update of a newer term that does not follow my state: maybe a branch from a partition.
            theirs = BranchTip(record.term, record.to_version, record.checksum)
            proof = None
            if tag == ReplicaTag.CHECKSUM_MISMATCH:
                proof = reconcile.fork_proven(
                    before, theirs, update_term=record.term, from_version=record.from_version
                )
            self.start_repair(p, self.repair.reconcile_fragment(p, theirs, [sender], proof))
        elif tag == ReplicaTag.OUT_OF_ORDER:
            self.start_repair(
                p,
                self.repair.catch_up_fragment(
                    p, [sender], target=record.to_version, now=self.membership.last_read
                ),
            )
        elif tag != ReplicaTag.DUPLICATE_UPDATE:
            self.journal.note(f"update from {sender} refused: {reply}")
            if tag == ReplicaTag.CHECKSUM_MISMATCH:
                self.start_repair(p, self.repair.fetch_fragment(p, [sender]))
