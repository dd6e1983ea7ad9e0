"""No silent fresh start: a peer at version 0 never claims a term of a run a signed record shows under way.

A newcomer that reaches nobody (a restarted bootstrap node that has not found the swarm again, a
partition) would otherwise rank itself first, claim term 1 and train the run again from its initial
weights: an island that a later heal may even prefer (issue #31). `UnderwayGate` reads the run's
``underway`` DHT key (`wire.underway`: headers of update records signed by a peer that may synchronize,
carried by peers and by bootstrap nodes, which keep one across restarts) and, while this peer's replica is
still at version 0 of every fragment, leaves this peer out of its own election's candidates (so it waits,
or follows a live holder) and says why (``run under way: ...``) in its decisions, its heartbeat and so
``status``, and its progress line and panel. It never blocks
following a live holder nor catching up; once the replica holds any applied update it has nothing to say.

The proof is checked here, by the reader: a stranger may carry one (and so say where to look), never make
one. A run nobody has published an update of yet has no proof, so an organizer starts a run from nothing
as before; a run that must start again from nothing takes a new manifest (a new run).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import election
from p2p_diloco.protocol.decisions import reason_text
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.effects import StoreRecord
from p2p_diloco.swarm.election.membership import SwarmView
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.update_log import UpdateLog
from p2p_diloco.wire.interfaces import StoredValue
from p2p_diloco.wire.keys import UNDERWAY, record_key
from p2p_diloco.wire.signing import SignatureCheck
from p2p_diloco.wire.underway import Underway, check_proof, encode_proof

NOTE_WITHIN = 3  # the wait is noted again once it is not among the last 3 decision lines
PUBLISH_EVERY_TTLS = 4  # a peer's proof lives this many heartbeat TTLs; it is written again at half of that


class UnderwayGate:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        check: SignatureCheck,
        journal: Journal,
        distrusted: Collection[str] = frozenset(),
    ):
        """`distrusted`: leaders whose proofs prove nothing (live: `Vouchers.caught`, the leaders this
        replica caught forging a union merge, who could otherwise keep every fresh replica from claiming)."""
        self.peer_id = peer_id
        self.distrusted = distrusted
        self.manifest = manifest
        self.check = check
        self.journal = journal
        self.key = record_key(manifest.run_id, manifest.manifest_hash, UNDERWAY)
        self.best: Underway | None = None
        self.fresh = True  # the replica is at version 0 of every fragment (only then is the key read)
        self._published: float | None = None  # when this peer last wrote its proof
        self.waiting: str | None = None  # why this peer claims no term now (shown in its panel and status)
        self._noted_at: int | None = None  # `journal.notes` just after this wait was last noted

    @property
    def reading(self) -> bool:
        return self.fresh

    def ingest(self, stored: Mapping[str, StoredValue]) -> None:
        """Keep the best proof among those read (each checked; a bad one is counted, never believed)."""
        for _carrier, value in stored.items():
            self._consider(value.value, count_bad=True)

    def witness(self, record: UpdateRecord) -> None:
        """An update record that reached this peer (pushed or relayed, applied or not) proves as much as
        the key's proofs when its leader may synchronize and signed it: a fresh peer whose DHT reads find
        nobody (starved, an island) still learns from the updates it is sent that the run is under way."""
        if self.fresh and record.signature:
            self._consider(encode_proof(record), count_bad=False)

    def _consider(self, value: bytes, *, count_bad: bool) -> None:
        found = check_proof(
            value,
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            check=self.check,
            may_synchronize=self.manifest.may_synchronize,
        )
        if isinstance(found, str):
            if count_bad:
                self.journal.rejections["bad underway proof"] += 1
        elif found.leader in self.distrusted:
            return
        elif self.best is None or found > self.best:
            if self.best is None:
                self.journal.note(f"proof the run is under way: {found.describe()}")
            self.best = found

    def detail(self) -> str:
        assert self.best is not None
        return (
            f"{self.best.describe()}; my replica is at version 0, so I claim no term and wait for a peer "
            "that holds the run's state (no fresh start)"
        )

    def election_view(self, view: SwarmView, versions: Sequence[int]) -> SwarmView:
        """`view` without this peer's own heartbeat while it may not claim: it is then no candidate, so
        the election waits (or follows a live holder) instead of ranking it first."""
        self.fresh = not any(versions)
        if self.best is not None and self.best.leader in self.distrusted:
            self.best = None  # caught forging since: the next reads may bring another peer's proof
        holding = self.fresh and self.best is not None
        wait = reason_text(election.ElectionTag.UNDER_WAY, self.detail()) if holding else None
        if wait is not None and (
            self._noted_at is None or self.journal.notes - self._noted_at >= NOTE_WITHIN
        ):
            self.journal.note(f"election: {wait}")  # kept among the lines `status` shows
            self._noted_at = self.journal.notes
        self.waiting = wait
        if not holding:
            return view
        return replace(view, heartbeats=[hb for hb in view.heartbeats if hb.peer_id != self.peer_id])

    def claim_wait(self) -> str | None:
        """Why a claim waits (`protocol.claim_guard.gate`, `UNDER_WAY`): the election still ranks this peer
        first from version 0 of a run under way when it remembers itself from an earlier read; None when
        this gate has nothing to say."""
        return None if self.waiting is None else self.detail()

    def publish(self, log: UpdateLog, num_fragments: int, now: float) -> StoreRecord | None:
        """This peer's proof (the newest signed record in its log) when it is due to be written again."""
        newest = [r for p in range(num_fragments) for r in log.records(p)[-1:] if r.signature]
        if not newest:
            return None
        value = encode_proof(max(newest, key=lambda r: (r.term, r.to_version)))
        ttl = PUBLISH_EVERY_TTLS * self.manifest.timing.heartbeat_ttl
        if self._published is not None and now - self._published < ttl / 2:
            return None
        self._published = now
        return StoreRecord(self.key, self.peer_id, value, now + ttl, what="underway proof")
