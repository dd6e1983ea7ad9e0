"""What a peer serves other peers' catch-up: the frames of its update log after a version (a replay)
and the indexes of its fragments' current states, whose chunks `swarm.snapshots` then serves off the owner
thread. Refused requests (a sender the manifest does not let take part, an unknown fragment) are counted
in the journal and answered with nothing a requester could use.
"""

from __future__ import annotations

from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import PeerContext
from p2p_diloco.swarm.snapshots import SnapshotServer
from p2p_diloco.swarm.updates import UpdateBook


class Serving:
    def __init__(self, ctx: PeerContext, book: UpdateBook, membership: Membership):
        self.plan, self.replica, self.journal = ctx.plan, ctx.replica, ctx.journal
        self.book = book
        self.membership = membership
        manifest, limits = ctx.manifest, ctx.manifest.limits
        self.snapshots = SnapshotServer(
            manifest.run_id,
            manifest.manifest_hash,
            chunk_bytes=limits.snapshot_chunk_bytes,
            max_pins=limits.snapshot_pins,
            pin_seconds=limits.snapshot_pin_seconds,
        )
        self.offer_snapshots()

    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
        if not self.membership.allowed(requester):
            self.journal.reject(
                requester, AdmissionTag.NOT_ALLOWED, "update replay refused: not in the allowlist"
            )
            return []
        if not 0 <= fragment < self.plan.num_fragments:
            return []
        return self.book.frames_after(fragment, after_version)

    def serve_snapshot(self, requester: str, fragment: int) -> bytes:
        """The index of the fragment's current state, pinned for chunk requests (`swarm.snapshots`); b""
        (which no requester can decode) for a refused request."""
        if not self.membership.allowed(requester):
            self.journal.reject(requester, AdmissionTag.NOT_ALLOWED, "snapshot refused: not in the allowlist")
            return b""
        if not 0 <= fragment < self.plan.num_fragments:
            self.journal.reject(requester, AdmissionTag.UNKNOWN_FRAGMENT, f"snapshot of {fragment}")
            return b""
        version, params, momentum = self.replica.fragment_state(fragment)
        return self.snapshots.index(fragment, version, self.replica.checksum(fragment), params, momentum)

    def offer_snapshots(self, fragments: range | list[int] | None = None) -> None:
        """Tell the snapshot server the current state of `fragments` (all by default); see
        `swarm.snapshots`."""
        for p in range(self.plan.num_fragments) if fragments is None else fragments:
            version, params, momentum = self.replica.fragment_state(p)
            self.snapshots.offer(p, version, self.replica.checksum(p), params, momentum)

    def refresh(self, now: float) -> None:
        """Every heartbeat period: drop served states nobody asked for lately, offer the current ones."""
        self.snapshots.expire(now)
        self.offer_snapshots()
