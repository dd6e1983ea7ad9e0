"""Who is in the swarm and who synchronizes: heartbeats, lease records and the election, as one peer
sees them.

`Membership` keeps what the last read of the DHT showed (live peers' heartbeats, every holder seen for
each term), the synchronizer this peer follows and its own lease. It decodes records (a bad one is
counted and skipped, never fatal), runs `protocol.election.decide` and returns the lease records to
store; the `Peer` turns its decisions into role changes and intents.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import election
from p2p_diloco.protocol.election import ElectionDecision, LeaseRecord, PeerHeartbeat
from p2p_diloco.swarm.effects import StoreRecord, SwarmRecords
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.wire.keys import heartbeat_key, lease_key
from p2p_diloco.wire.records import HeartbeatInfo, RecordError, decode_heartbeat, decode_lease, encode_lease


@dataclass(frozen=True)
class SwarmView:
    heartbeats: list[PeerHeartbeat]
    leases: list[LeaseRecord]


class Membership:
    def __init__(self, peer_id: str, manifest: RunManifest, num_fragments: int, journal: Journal):
        self.peer_id = peer_id
        self.manifest = manifest
        self.num_fragments = num_fragments
        self.journal = journal
        self.hb_key = heartbeat_key(manifest.run_id, manifest.manifest_hash)
        self.lease_key = lease_key(manifest.run_id, manifest.manifest_hash)
        self.live_peers: dict[str, HeartbeatInfo] = {}
        # term -> every peer seen holding a lease of it (two claims of one term can race; the tie's loser
        # steps down, but either may have published updates of that term)
        self.lease_holders: dict[int, set[str]] = {}
        self.my_lease: LeaseRecord | None = None
        self.holder: str | None = None  # the synchronizer this peer follows (itself when it holds the lease)
        self.holder_term = 0
        self.term_seen = 0
        self.last_election = ""
        self.failovers_seen = 0
        self.last_read = float("-inf")

    def allowed(self, peer: str) -> bool:
        """False for peers outside the manifest's allowlist (an empty allowlist allows everyone)."""
        return not self.manifest.allowlist or peer in self.manifest.allowlist

    def heartbeat_record(self, info: HeartbeatInfo, now: float) -> StoreRecord:
        expiration = now + self.manifest.timing.heartbeat_ttl
        return StoreRecord(self.hb_key, self.peer_id, info.to_bytes(), expiration, what="heartbeat")

    def lease_record(self, lease: LeaseRecord, what: str) -> StoreRecord:
        expiration = election.dht_expiration(lease, self.manifest.timing)
        return StoreRecord(self.lease_key, self.peer_id, encode_lease(lease), expiration, what=what)

    def ingest(self, records: SwarmRecords) -> SwarmView:
        """Decode what was read from the DHT; remembers live peers and every lease holder seen."""
        heartbeats, leases = [], []
        live: dict[str, HeartbeatInfo] = {}
        for peer, stored in records.heartbeats.items():
            if not self.allowed(peer):
                continue
            try:
                info = decode_heartbeat(stored.value, self.num_fragments)
            except RecordError as exc:
                self.journal.rejections["bad heartbeat"] += 1
                self.journal.note(f"ignored heartbeat of {peer}: {exc}")
                continue
            live[peer] = info
            heartbeats.append(info.as_election_record(peer, stored.expiration))
        for holder, stored in records.leases.items():
            if not self.allowed(holder):
                continue
            try:
                lease = decode_lease(holder, stored.value)
            except RecordError as exc:
                self.journal.rejections["bad lease"] += 1
                self.journal.note(f"ignored lease of {holder}: {exc}")
                continue
            leases.append(lease)
            self.lease_holders.setdefault(lease.term, set()).add(lease.holder)
        self.live_peers = live
        self.last_read = records.now
        return SwarmView(heartbeats, leases)

    def live_learners(self) -> frozenset[str]:
        return frozenset(p for p, info in self.live_peers.items() if info.role in ("learner", "synchronizer"))

    def held_lease(self, leader: str, term: int) -> bool:
        """Whether `leader` was seen holding the lease of `term`."""
        return leader in self.lease_holders.get(term, ())

    def decide(self, view: SwarmView, now: float, rounds_done: int) -> ElectionDecision:
        decision = election.decide(
            self.peer_id,
            self.manifest.run_id,
            view.heartbeats,
            view.leases,
            now,
            self.manifest.timing,
            my_lease=self.my_lease,
            rounds_done=rounds_done,
        )
        seen = election.highest_term_seen(view.leases, view.heartbeats)
        self.term_seen = max(self.term_seen, seen, decision.term)
        quiet = decision.action in (election.HOLD, election.RENEW, election.FOLLOW)
        if not quiet or decision.reason.split(":")[0] != self.last_election.split(":")[0]:
            self.journal.note(f"election: {decision}")
        self.last_election = decision.reason
        return decision

    def follow(self, holder: str | None, term: int) -> None:
        """Follow `holder`'s term (None: no synchronizer known); another holder after one is a failover."""
        if None not in (self.holder, holder) and holder != self.holder:
            self.failovers_seen += 1
        self.holder, self.holder_term = holder, term
