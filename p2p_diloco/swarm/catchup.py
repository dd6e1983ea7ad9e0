"""Catch-up and repair of a peer's replica: replaying other peers' update logs, checked fragment
snapshots, and reconciling branches after a partition (protocol/reconcile.py); also serving both.

`PeerCatchUp` is a mixin of `swarm.peer.Peer`, split out by what it owns; it uses the peer's replica,
plan, manifest, transport, learner, update log, live peers and branch-tip terms, and its `note`,
`allowed`, `_reject`, `tip`, `_held_lease`, `_check_record`, `_apply_update` and `read_swarm`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import reconcile
from p2p_diloco.protocol.decisions import Decision
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.protocol.replica import CHECKSUM_MISMATCH, LOAD
from p2p_diloco.wire.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import FragmentSnapshot, decode_snapshot, decode_update, encode_snapshot

MAX_PARALLEL_DOWNLOADS = 4
REJECT_NOT_ALLOWED = "not allowed"


class PeerCatchUp:
    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
        if not self.allowed(requester):
            self._reject(requester, REJECT_NOT_ALLOWED, "update replay refused: not in the allowlist")
            return []
        if not 0 <= fragment < self.plan.num_fragments:
            return []
        frames = []
        for frame in self.update_log[fragment]:
            record = decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
            if record.from_version >= after_version:
                frames.append(frame)
        return frames

    def serve_snapshot(self, requester: str, fragment: int) -> bytes:
        """The fragment's snapshot frame; b"" (which no requester can decode) for a refused request."""
        if not self.allowed(requester):
            self._reject(requester, REJECT_NOT_ALLOWED, "snapshot refused: not in the allowlist")
            return b""
        if not 0 <= fragment < self.plan.num_fragments:
            self._reject(requester, "unknown fragment", f"snapshot of {fragment}")
            return b""
        version, params, momentum = self.replica.snapshot(fragment)
        return encode_snapshot(
            FragmentSnapshot(
                run_id=self.manifest.run_id,
                manifest_hash=self.manifest.manifest_hash,
                fragment=fragment,
                version=version,
                checksum=self.replica.checksum(fragment),
                params=encode_tensors(params, codec="fp32"),
                momentum=encode_tensors(momentum, codec="fp32"),
            )
        )

    def catch_up_fragment(self, fragment: int, sources: list[str], *, target: int) -> bool:
        """Replay missing updates of `fragment` from the sources' logs; fall back to a snapshot."""
        for source in sources:
            if self.replica.versions()[fragment] >= target:
                return True
            try:
                frames = self.transport.fetch_updates(source, fragment, self.replica.versions()[fragment])
            except (ConnectionError, TimeoutError) as exc:
                self.note(f"replay of fragment {fragment} from {source} failed: {exc}")
                continue
            for frame in frames:
                before = self.tip(fragment)
                record, reply = self._replay_one(source, frame)
                if reply.startswith("no lease"):
                    # The lease record of that term has expired from the DHT (a peer back after a while):
                    # the rest of this log cannot be verified either, a snapshot can.
                    break
                if record is not None and reply.startswith(CHECKSUM_MISMATCH):
                    # The source's history does not pass through my state: a fork, not a gap.
                    theirs = BranchTip(record.term, record.to_version, record.checksum)
                    proof = reconcile.fork_proven(
                        before, theirs, update_term=record.term, from_version=record.from_version
                    )
                    return self.reconcile_fragment(fragment, theirs, [source], proof)
        if self.replica.versions()[fragment] >= target:
            return True
        return self.fetch_fragment(fragment, sources)

    def _replay_one(self, source: str, frame: bytes) -> tuple[UpdateRecord | None, str]:
        """Apply one replayed frame if it is the next update of its fragment; (record, apply reply)."""
        try:
            record = decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
        except DecodeError as exc:
            return None, self._reject(source, exc.reason, f"replayed update: {exc}")
        if not self._held_lease(record.leader, record.term):
            reason = f"replayed update of term {record.term} by {record.leader}"
            return None, self._reject(source, "no lease", reason)
        if self._check_record(record.run_id, record.manifest_hash, record.fragment) is None:
            if record.from_version == self.replica.versions()[record.fragment]:
                return record, self._apply_update(record, frame, source=source)
        return record, "skipped"

    def _download_snapshot(self, fragment: int, source: str) -> tuple[FragmentSnapshot, dict, dict]:
        """Fetch and decode one fragment snapshot (network and parsing only; raises on any problem)."""
        max_bytes = self.manifest.wire.max_message_bytes
        snap = decode_snapshot(self.transport.fetch_snapshot(source, fragment), max_bytes=max_bytes)
        bad = self._check_record(snap.run_id, snap.manifest_hash, snap.fragment)
        if bad or snap.fragment != fragment:
            raise DecodeError(
                bad[0] if bad else "wrong fragment", f"snapshot of fragment {fragment} from {source}"
            )
        shapes = self.replica.shapes(fragment)
        params = decode_tensors(snap.params, expected_shapes=shapes, max_bytes=max_bytes)
        momentum = decode_tensors(snap.momentum, expected_shapes=shapes, max_bytes=max_bytes)
        return snap, params, momentum

    def _install_snapshot(
        self, fragment: int, source: str, downloaded, *, force: bool = False, term: int | None = None
    ) -> bool:
        snap, params, momentum = downloaded
        decision = self.replica.load_fragment(
            fragment, snap.version, params, momentum, snap.checksum, force=force
        )
        self.note(f"snapshot of fragment {fragment} from {source}: {decision.reason}")
        if decision.action != LOAD:
            return False
        self.tip_terms[fragment] = term if term is not None else self._snapshot_term(fragment, source, snap)
        self.update_log[fragment].clear()
        if self.learner is not None:
            self.learner.load_global_into_model([fragment])
        return True

    def _snapshot_term(self, fragment: int, source: str, snap: FragmentSnapshot) -> int:
        """The term of the update that produced a loaded snapshot: from the source's published tip if it
        matches, else from the update in the source's log that produced it; 0 (unknown) otherwise. An
        unknown term only makes this replica's tip rank lower, never win wrongly."""
        info = self.live_peers.get(source)
        tip = info.tip(fragment) if info is not None else None
        loaded = BranchTip(0, snap.version, snap.checksum)
        if tip is not None and tip.same_state(loaded):
            return tip.term
        if snap.version == 0:
            return 0
        try:
            frames = self.transport.fetch_updates(source, fragment, snap.version - 1)
        except (ConnectionError, TimeoutError):
            return 0
        for frame in frames:
            try:
                record = decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
            except DecodeError:
                continue
            if (record.fragment, record.to_version, record.checksum) == (
                fragment,
                snap.version,
                snap.checksum,
            ):
                return record.term if self._held_lease(record.leader, record.term) else 0
        return 0

    def reconcile_fragment(
        self,
        fragment: int,
        winner: BranchTip,
        sources: list[str],
        decision: Decision | None = None,
    ) -> bool:
        """Bring `fragment` onto the branch whose tip is `winner` (protocol/reconcile.py): nothing if in
        sync or ahead, replay (verified by checksums, a mismatch proves a fork) if behind, else replace it
        by a snapshot of a source on the winning branch, older than mine if need be, and log `reconciled`."""
        mine = self.tip(fragment)
        decision = decision or reconcile.classify(mine, winner)
        if decision.action == reconcile.IN_SYNC:
            self.tip_terms[fragment] = max(mine.term, winner.term)
            return True
        if decision.action == reconcile.KEEP:
            return True
        if decision.action == reconcile.CATCH_UP:
            return self.catch_up_fragment(fragment, sources, target=winner.version)
        for source in sources:
            try:
                downloaded = self._download_snapshot(fragment, source)
            except (ConnectionError, TimeoutError, DecodeError) as exc:
                self.note(f"snapshot of fragment {fragment} from {source} failed: {exc}")
                continue
            snap = downloaded[0]
            got = BranchTip(winner.term, snap.version, snap.checksum)
            if snap.version < winner.version or (
                snap.version == winner.version and not got.same_state(winner)
            ):
                self.note(
                    f"snapshot of fragment {fragment} from {source} ({got}) is not on the branch {winner}"
                )
                continue
            term = winner.term if got.same_state(winner) else None
            if self._install_snapshot(fragment, source, downloaded, force=True, term=term):
                line = reconcile.reconciled_line(fragment, mine, self.tip(fragment), source, decision.reason)
                self.reconciliations.append(line)
                self.note(line)
                return True
        self.note(
            f"fragment {fragment} not reconciled yet: no source on the winning branch ({decision.reason})"
        )
        return False

    def fetch_fragment(self, fragment: int, sources: list[str]) -> bool:
        """Download a checked snapshot of one fragment; the learner's copy of it is reset to the global one."""
        for source in sources:
            try:
                downloaded = self._download_snapshot(fragment, source)
            except (ConnectionError, TimeoutError, DecodeError) as exc:
                if isinstance(exc, DecodeError):
                    self._reject(source, exc.reason, "snapshot")
                self.note(f"snapshot of fragment {fragment} from {source} failed: {exc}")
                continue
            if self._install_snapshot(fragment, source, downloaded):
                return True
        return False

    def fetch_fragments(self, wanted: dict[int, list[str]]) -> int:
        """Download several fragments in parallel, each from its first source (so a newcomer's load is
        spread over the peers), then install them in fragment order; a failed one falls back to
        `fetch_fragment` over its other sources. Returns how many fragments were installed."""
        if not wanted:
            return 0
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_DOWNLOADS, len(wanted))) as pool:
            futures = {
                p: pool.submit(self._download_snapshot, p, sources[0]) for p, sources in wanted.items()
            }
        installed = 0
        for p in sorted(wanted):
            try:
                ok = self._install_snapshot(p, wanted[p][0], futures[p].result())
            except (ConnectionError, TimeoutError, DecodeError) as exc:
                self.note(f"snapshot of fragment {p} from {wanted[p][0]} failed: {exc}")
                ok = False
            installed += ok or self.fetch_fragment(p, wanted[p][1:])
        return installed

    def repair_tick(self, now: float) -> list[int]:
        """Anti-entropy and partition reconciliation, per fragment: my branch tip against the live peers'
        published tips (protocol/reconcile.py). A fragment that stays off the winning tip for a whole
        heartbeat period (not a push still in flight) is replayed from the peers on that tip, or, if my
        branch lost, replaced by their snapshot (`reconcile_fragment`)."""
        repaired = []
        period = self.manifest.timing.heartbeat_period
        for p in range(self.plan.num_fragments):
            mine = self.tip(p)
            theirs = {
                peer: tip
                for peer, info in self.live_peers.items()
                if peer != self.peer_id and (tip := info.tip(p)) is not None
            }
            winner = reconcile.winning_tip([mine, *theirs.values()])
            decision = reconcile.classify(mine, winner)
            if decision.action in (reconcile.IN_SYNC, reconcile.KEEP):
                self.tip_terms[p] = max(mine.term, winner.term) if mine.same_state(winner) else mine.term
                self.behind_since.pop(p, None)
                continue
            since = self.behind_since.setdefault(p, now)
            if now - since >= period:
                sources = sorted(peer for peer, tip in theirs.items() if tip.same_state(winner))
                self.note(f"fragment {p}: {decision}; repairing from {len(sources)} peers")
                self.reconcile_fragment(p, winner, sources, decision)
                self.behind_since.pop(p, None)
                repaired.append(p)
        return repaired

    def catch_up(self, now: float, *, replay: bool) -> dict[str, int]:
        """Bring the replica to the swarm's versions: replay logs (`replay`) or download snapshots,
        spreading fragments over the up-to-date peers."""
        self.read_swarm(now)
        others = {p: i for p, i in self.live_peers.items() if p != self.peer_id and i.versions}
        stats = {"replayed": 0, "snapshots": 0}
        wanted: dict[int, list[str]] = {}
        if not others:
            return stats
        for p in range(self.plan.num_fragments):
            tips = {peer: tip for peer, info in others.items() if (tip := info.tip(p)) is not None}
            if tips:  # the winning branch's tip (protocol/reconcile.py), not merely the highest version
                winner = reconcile.winning_tip(tips.values())
                target = winner.version
                ranked = sorted(peer for peer, tip in tips.items() if tip.same_state(winner))
            else:
                target = max(info.versions[p] for info in others.values())
                ranked = sorted(peer for peer, i in others.items() if i.versions[p] >= target)
            if self.replica.versions()[p] >= target:
                continue  # up to date, or ahead on a branch that `repair_tick` reconciles
            sources = ranked[p % len(ranked) :] + ranked[: p % len(ranked)]
            if replay:
                before = self.replica.versions()[p]
                self.catch_up_fragment(p, sources, target=target)
                stats["replayed"] += self.replica.versions()[p] - before
            else:
                wanted[p] = sources
        stats["snapshots"] = self.fetch_fragments(wanted)
        return stats
