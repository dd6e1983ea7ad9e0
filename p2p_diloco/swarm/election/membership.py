"""Who is in the swarm and who synchronizes: heartbeats, lease records and the election, as one peer
sees them.

`Membership` keeps what the last read of the DHT showed (live peers' heartbeats, every valid holder seen
for each term), the synchronizer this peer follows and its own lease. It decodes records (a bad one is
counted and skipped, never fatal), screens leases with `protocol.lease_rules` (a refused one is counted
by reason and never reaches the election), runs `protocol.election.decide` (a peer that is no candidate
and holds no lease only follows: `follow_only`) and returns the lease records to store; the `Peer` turns
its decisions into role changes and intents. Heartbeats are self-reports: they never raise a term, their
`may_sync` counts only for the run's synchronizers, the election reads only the heartbeats of peers that
may synchronize, and peers the manifest does not let take part are not read at all (a real peer's DHT
reads keep at most 512 records per key, listed peers first: `net.admission`).

With synchronizer shards (`protocol.shards`) a peer keeps one `Membership` per shard: each reads its own
shard's lease key, with its own terms, holders and fencing; shard 0's, the one other parts hold, knows
them all (`shards`, `for_fragment`) and shares with them the peers seen down. A claim waits while the read
lacks a record still stored, or while this peer lags (`protocol.claim_guard`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cached_property, partial

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol import claim_guard, election, heartbeat_buckets, lease_rules, shards
from p2p_diloco.protocol.election import ElectionDecision, LeaseRecord, PeerHeartbeat
from p2p_diloco.protocol.lease_rules import SeenLease
from p2p_diloco.protocol.standing import Standing
from p2p_diloco.swarm.effects import ReadSwarm, StoreRecord, SwarmRecords, Task
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.wire.interfaces import StoredValue
from p2p_diloco.wire.keys import heartbeat_key, lease_key
from p2p_diloco.wire.records import HeartbeatInfo, RecordError, decode_heartbeat, decode_lease, encode_lease

Decoded = dict[str, tuple[HeartbeatInfo, float]]  # peer -> its decoded heartbeat and DHT expiration

LEASE_HISTORY = 64
MAX_BUCKETS_CACHED = 65536  # peers whose heartbeat bucket is remembered (a hash each, past this)
MAX_LEASES_DECODED = 256  # holders whose last lease record is kept decoded (`_decode_lease`)
RECORDS_PER_TERM = 8


@dataclass(frozen=True)
class SwarmView:
    heartbeats: list[PeerHeartbeat]
    leases: list[LeaseRecord]
    gaps: claim_guard.ReadGaps = claim_guard.NO_GAPS  # what the read lacks (`claim_guard.covered`)


class Membership:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        num_fragments: int,
        journal: Journal,
        standing: Standing,
        shard: int = 0,
        first: Membership | None = None,
    ):
        self.shard = shard
        self.shards: list[Membership] = [] if first is None else first.shards  # by shard, shared
        self.shards.append(self)
        self.standing = standing
        self.peer_id = peer_id
        self.manifest = manifest
        self.num_fragments = num_fragments
        self.journal = journal
        self.lease_key = lease_key(manifest.run_id, manifest.manifest_hash, shard)
        self._init_heartbeats(first)
        # term -> every peer seen holding a lease of it (two claims of one term can race; the tie's loser
        # steps down, but either may have published updates of that term)
        self.lease_holders: dict[int, set[str]] = {}
        # every lease record read, by its exact content, with the time this peer first read it
        self.first_seen: dict[LeaseRecord, float] = {}
        self.valid_leases: dict[tuple[str, int], SeenLease] = {}  # (holder, term) -> latest valid record
        # term -> valid records of earlier reads (renewals replace records in the DHT; rule 4 needs when a
        # term lapsed as first seen): the newest LEASE_HISTORY terms, RECORDS_PER_TERM records each
        self.lease_history: dict[int, list[SeenLease]] = {}
        self.my_lease: LeaseRecord | None = None
        # whether a read confirmed `my_lease`'s claim (`election.ElectionTag.CONFIRMED`): until then its
        # term merges nothing (`SynchronizerRole`)
        self.confirmed = False
        # (term, why) of this peer's own lease record that the last read refused (`lease_rules`): what
        # every honest reader refuses, this peer must not go on holding
        self.own_refused: tuple[int, str] | None = None
        self.refused_terms = 0  # step-downs from its own refused lease (each one's fence went back)
        self.holder: str | None = None  # the synchronizer this peer follows (itself when it holds the lease)
        self.holder_term = 0
        self.term_seen = 0
        self.last_election_tag = ""  # the tag of the last election decision (a change is noted)
        self.failovers_seen = 0
        self.last_read = float("-inf")
        self._own_sums: tuple[tuple[float, int], ...] = ()  # (time, this replica's versions sum)
        self._cover = claim_guard.ReadCover()  # records read, until when they stay stored
        # peer -> when its address last refused a connection (one dict for every shard)
        self.down: dict[str, float] = {} if first is None else first.down
        self.followed: LeaseRecord | None = None  # the lease of the synchronizer this peer follows
        self._reading_since: float | None = None  # when this peer's elections first read the swarm
        # peer that may synchronize -> (its heartbeat, when a read last held it)
        self._candidates_seen: dict[str, tuple[PeerHeartbeat, float]] = {}

    def _init_heartbeats(self, first: Membership | None) -> None:
        """What a peer reads of the heartbeats (`protocol.heartbeat_buckets`): bucket 0 (the candidates')
        every period and one other bucket in turn; it writes its own heartbeat to `own_hb_key`."""
        manifest, peer_id = self.manifest, self.peer_id
        self.buckets = heartbeat_buckets.buckets_for(manifest.diloco.synchronizer_shards)
        self.hb_key = heartbeat_key(manifest.run_id, manifest.manifest_hash)
        self._buckets_of: dict[str, int] = {} if first is None else first._buckets_of  # peer -> its bucket
        self._leases_decoded: dict[str, tuple[bytes, LeaseRecord]] = {}  # holder -> its last lease record
        self.own_bucket = (
            [self._bucket(peer_id)] if first is None else first.own_bucket
        )  # one for every shard
        self._bucket0: set[str] = (
            set() if first is None else first._bucket0
        )  # peers the last read of bucket 0 held
        self._first_read: list[float] = [] if first is None else first._first_read  # when reading began
        self.reads = 0  # reads of the swarm issued: seeds which bucket the next one samples
        # the live peers this peer knows: with one heartbeat bucket, exactly those of the last read; with
        # buckets, every heartbeat read until its bucket is read again without it (`_known_peers`)
        self.live_peers: dict[str, HeartbeatInfo] = {} if first is None else first.live_peers
        # bumped by every read that may change `live_peers` (one cell for every shard: they share the dict)
        self._live_version: list[int] = [0] if first is None else first._live_version
        self._live_learners: _KeptLearners | None = None  # `live_learners`' last answer
        # what the last read decoded (bounded whatever M): the per-period rules read these
        self.read_peers: dict[str, HeartbeatInfo] = {}
        # bucket -> its peers as last read (one dict for every shard)
        self._known_by_bucket: dict[int, dict[str, HeartbeatInfo]] = (
            {} if first is None else first._known_by_bucket
        )
        # the non-candidate buckets the read being ingested holds: bucket -> the peers read from it
        self._sampled: dict[int, set[str]] = {}
        self._key_bucket: dict[str, int] = {} if first is None else first._key_bucket  # bucket key -> bucket

    def allowed(self, peer: str) -> bool:
        """False for peers the manifest does not let take part (allowlist, `[trust] learners`)."""
        return self.manifest.may_learn(peer)

    @property
    def own_hb_key(self) -> str:
        """The key this peer writes its heartbeat to (its bucket's)."""
        return heartbeat_key(self.manifest.run_id, self.manifest.manifest_hash, self.own_bucket[0])

    def _lists_synchronizers(self) -> bool:
        return bool(self.manifest.trust.synchronizers or self.manifest.allowlist)

    def candidate(self, peer: str) -> bool:
        """Whether `peer` may claim a shard's lease and is read every period: it may synchronize and, in a
        run with heartbeat buckets that lists no synchronizers, writes its heartbeat to bucket 0 (its ID
        hashes there, or it volunteered: `_volunteer`)."""
        if not self.manifest.may_synchronize(peer):
            return False
        if self.buckets <= 1 or self._lists_synchronizers():
            return True
        return self.own_bucket[0] == 0 if peer == self.peer_id else peer in self._bucket0

    def elects(self) -> bool:
        """Whether this peer runs the shard's election (`decide`): it is a candidate, or holds a lease. A
        peer that is neither only follows the lease it reads (`follow_only`): its views carry no
        heartbeats, and whose claim window is open does not concern it."""
        return self.my_lease is not None or self.candidate(self.peer_id)

    def _volunteer(self, now: float) -> None:
        """In an open run with heartbeat buckets, a peer whose ID does not hash to bucket 0 becomes a
        candidate (for good: it writes its heartbeat there from now on) when, once it has read the swarm
        for a heartbeat period (every live peer wrote its heartbeat meanwhile), bucket 0 holds fewer than
        `MIN_OPEN_CANDIDATES` others: a small swarm under a large S must not be left without candidates,
        while a large one (about M / S candidates) never volunteers. A claim waits `heartbeat_ttl` of
        reading (`_warm_up_left`), so volunteers are in bucket 0 before anyone's first claim."""
        if self.buckets <= 1 or self._lists_synchronizers() or self.own_bucket[0] == 0:
            return
        if not self.manifest.may_synchronize(self.peer_id):
            return
        if not self._first_read:
            self._first_read.append(now)
        others = len(self._bucket0 - {self.peer_id})
        if now - self._first_read[0] < self.manifest.timing.heartbeat_period:
            return
        if others < heartbeat_buckets.MIN_OPEN_CANDIDATES:
            self.own_bucket[0] = 0
            self.journal.note(f"heartbeat bucket 0 holds {others} candidates: I stand as one too")

    def heartbeat_record(self, info: HeartbeatInfo, now: float) -> StoreRecord:
        expiration = now + self.manifest.timing.heartbeat_ttl
        return StoreRecord(self.own_hb_key, self.peer_id, info.to_bytes(), expiration, what="heartbeat")

    def lease_record(self, lease: LeaseRecord, what: str) -> StoreRecord:
        expiration = election.dht_expiration(lease, self.manifest.timing)
        return StoreRecord(self.lease_key, self.peer_id, encode_lease(lease), expiration, what=what)

    def read_swarm(self, underway: str | None = None) -> ReadSwarm:
        """The read of a swarm tick: the candidates' heartbeats, every shard's lease records (and
        `underway`) and, with heartbeat buckets, the next sampled buckets (`sampled`; every bucket on
        joining)."""
        leases = tuple(m.lease_key for m in self.shards)
        buckets = heartbeat_buckets.sample_buckets(self.peer_id, self.reads, self.buckets)
        self.reads += 1
        sampled = tuple(self._bucket_key(bucket) for bucket in buckets)
        return ReadSwarm(self.hb_key, leases, underway, sampled)

    def _bucket_key(self, bucket: int) -> str:
        key = heartbeat_key(self.manifest.run_id, self.manifest.manifest_hash, bucket)
        self._key_bucket[key] = bucket
        return key

    def for_fragment(self, fragment: int) -> Membership:
        """The membership of `fragment`'s shard (whose leases its updates are checked against)."""
        return self.shards[shards.shard_of(fragment, len(self.shards))]

    def ingest_all(self, records: SwarmRecords) -> list[SwarmView]:
        """`ingest` in every shard's membership, shard 0 first; their views. The heartbeats are decoded once
        for all shards (a peer decoded each one once per shard: M x S decodes a period, issue #40)."""
        decoded = self._decode_heartbeats(records)
        shared = self._shared(decoded)  # the same for every shard (candidacy is the peer's, not the shard's)
        views = [
            membership.ingest(records, decoded, learn=membership is self, shared=shared)
            for membership in self.shards
        ]
        for membership in self.shards[1:]:  # equal: one object, so what is derived from it is derived once
            membership.live_peers, membership.read_peers = self.live_peers, self.read_peers
        return views

    def ingest(
        self,
        records: SwarmRecords,
        decoded: Decoded | None = None,
        *,
        learn: bool = True,
        shared: tuple[dict[str, HeartbeatInfo], tuple[str, ...]] | None = None,
    ) -> SwarmView:
        """Decode what was read from the DHT (the heartbeats unless `decoded` holds them already); remembers
        live peers (with heartbeat buckets, only if `learn`: `ingest_all` learns once for every shard) and
        every lease holder seen. `shared`: the read's live peers and the peers the election reads (the
        candidates and this peer), worked out once for every shard by `ingest_all`."""
        if decoded is None:
            decoded = self._decode_heartbeats(records)
        if shared is None:
            shared = self._shared(decoded)
        live = shared[0]
        heartbeats = self._heartbeats(decoded, shared[1]) if self.elects() else []
        seen = self._leases(records)
        leases = self._screen(seen, live, records.now)
        leases += self._remembered(records.now, {item.lease.holder for item in seen})
        self._forget_old(records.now, {item.lease for item in seen})
        self.read_peers = live
        self._live_version[0] += 1
        if self.buckets <= 1:
            self.live_peers = live
        elif learn:
            self.live_peers = self._known_peers(live)
            self._volunteer(records.now)
        # A heartbeat starts the newcomer grace of a listed peer only: an unlisted key is awaited from its
        # first accepted delta on (`Synchronizer.handle_delta`), so idle fresh keys change no round.
        if learn:
            self.standing.heard((p for p in live if self.manifest.listed(p)), records.now)
        self.last_read = records.now
        return SwarmView(heartbeats, leases, self._gaps(records, seen, heartbeats))

    def _gaps(
        self, records: SwarmRecords, seen: list[SeenLease], heartbeats: list[PeerHeartbeat]
    ) -> claim_guard.ReadGaps:
        """What the read lacks (`claim_guard.covered`); they only ever hold a claim back, so a peer that is
        no candidate (it never claims) skips the bookkeeping."""
        if not self.candidate(self.peer_id):
            return claim_guard.NO_GAPS
        sync = [x.lease.holder for x in seen if self.manifest.may_synchronize(x.lease.holder)]
        read = claim_guard.read_of(heartbeats, {h: records.leases_of(self.shard)[h].expiration for h in sync})
        timing = self.manifest.timing
        self._cover, gaps = claim_guard.covered(self._cover, read, self.peer_id, records.now, timing)
        return gaps

    def _known_peers(self, read: dict[str, HeartbeatInfo]) -> dict[str, HeartbeatInfo]:
        """With heartbeat buckets: `live_peers` updated in place from one read. Each bucket it read (bucket
        0 and the sampled ones) replaces what this peer knew of that bucket, so a peer gone drops out when its
        bucket is next read (within B - 1 periods); the others stay as last read. Work: the buckets read."""
        by_bucket: dict[int, dict[str, HeartbeatInfo]] = {bucket: {} for bucket in (0, *self._sampled)}
        for bucket, peers in self._sampled.items():
            by_bucket[bucket].update((peer, read[peer]) for peer in peers if peer in read)
        by_bucket[0].update((peer, info) for peer, info in read.items() if peer in self._bucket0)
        known = self.live_peers
        for bucket, peers in by_bucket.items():
            for peer in self._known_by_bucket.get(bucket, {}).keys() - peers.keys():
                known.pop(peer, None)
            known.update(peers)
            self._known_by_bucket[bucket] = peers
        return known

    def _bucket(self, peer: str) -> int:
        """The heartbeat bucket `peer` writes to (cached: one hash per peer)."""
        bucket = self._buckets_of.get(peer)
        if bucket is None:
            candidate = self.manifest.may_synchronize(peer) and (
                self.manifest.trust.synchronizers
                or self.manifest.allowlist
                or heartbeat_buckets.open_candidate(peer, self.buckets)
            )
            bucket = heartbeat_buckets.bucket_of(peer, self.buckets, candidate=bool(candidate))
            if len(self._buckets_of) < MAX_BUCKETS_CACHED:
                self._buckets_of[peer] = bucket
        return bucket

    def _decode_heartbeats(self, records: SwarmRecords) -> Decoded:
        """The heartbeats of peers that may take part that decode (a bad one is counted and noted by
        shard 0's membership, which every shard's read goes through first), with their DHT expiration.
        With heartbeat buckets: bucket 0's candidates and the sampled buckets' peers."""
        stored_by_peer = records.heartbeats
        self._sampled = {}
        if self.buckets > 1:
            candidates = {p: v for p, v in records.heartbeats.items() if self.manifest.may_synchronize(p)}
            self._bucket0.clear()
            self._bucket0.update(candidates)
            sampled: dict[str, StoredValue] = {}
            for key, heartbeats in records.sampled.items():
                peers = {p for p in heartbeats if p not in candidates}
                self._sampled[self._key_bucket[key]] = peers
                sampled.update((p, heartbeats[p]) for p in peers)
            stored_by_peer = {**sampled, **candidates}
        decoded: Decoded = {}
        for peer, stored in stored_by_peer.items():
            if not self.allowed(peer):
                continue
            try:
                info = decode_heartbeat(stored.value, self.num_fragments)
            except RecordError as exc:
                if self.shard == 0:  # every shard reads the heartbeats: one counts them
                    self.journal.rejections["bad heartbeat"] += 1
                    self.journal.note(f"ignored heartbeat of {peer}: {exc}")
                continue
            decoded[peer] = (info, stored.expiration)
        return decoded

    def _shared(self, decoded: Decoded) -> tuple[dict[str, HeartbeatInfo], tuple[str, ...]]:
        """A read's live peers, and the peers its elections read (the candidates and this peer), in the
        read's order."""
        live = {peer: info for peer, (info, _) in decoded.items()}
        return live, tuple(p for p in decoded if p == self.peer_id or self.candidate(p))

    def _heartbeats(self, decoded: Decoded, electing: tuple[str, ...]) -> list[PeerHeartbeat]:
        """The election's records of `electing` (the candidates and this peer, in the read's order: the
        election reads only them), with this shard's term; a candidate's `may_sync` as its heartbeat says."""
        heartbeats: list[PeerHeartbeat] = []
        for peer in electing:
            info, expiration = decoded[peer]
            candidate = peer != self.peer_id or self.candidate(peer)
            term = info.term_of(self.shard)
            heartbeats.append(
                PeerHeartbeat(
                    peer, info.may_sync and candidate, info.reachable, info.versions, expiration, term
                )
            )
        return heartbeats

    def _leases(self, records: SwarmRecords) -> list[SeenLease]:
        """This shard's lease records that decode (a bad one is counted), each with when it was first read."""
        seen = []
        for holder, stored in records.leases_of(self.shard).items():
            if not self.allowed(holder):
                continue
            try:
                lease = self._decode_lease(holder, stored.value)
            except RecordError as exc:
                self.journal.rejections["bad lease"] += 1
                self.journal.note(f"ignored lease of {holder}: {exc}")
                continue
            seen.append(SeenLease(lease, self.first_seen.setdefault(lease, records.now)))
        return seen

    def _decode_lease(self, holder: str, raw: bytes) -> LeaseRecord:
        """`decode_lease`, each holder's last record kept: a lease is renewed every few reads and read at
        every one, in every shard (issue #40)."""
        known = self._leases_decoded.get(holder)
        if known is not None and known[0] == raw:
            return known[1]
        lease = decode_lease(holder, raw)
        if len(self._leases_decoded) >= MAX_LEASES_DECODED:
            self._leases_decoded.clear()
        self._leases_decoded[holder] = (raw, lease)
        return lease

    def _screen(self, seen: list[SeenLease], live: dict[str, HeartbeatInfo], now: float) -> list[LeaseRecord]:
        """The leases `protocol.lease_rules` accepts (refused ones counted once, and this peer's own noted);
        valid ones join the lease history and the holders of their terms."""
        screened = lease_rules.screen_leases(
            seen,
            term_floor=self.term_seen,
            timing=self.manifest.timing,
            may_synchronize=self.manifest.may_synchronize,
            terms_reported=_ReportedTerms(live, self.shard, self.manifest.may_synchronize),
            history=self.lease_history,
        )
        self.own_refused = None
        for lease, tag, detail in screened.refused:
            if self.first_seen.get(lease) == now:  # count each refused record once
                self.journal.reject(lease.holder, tag, detail)
            if lease.holder == self.peer_id:
                self.own_refused = (lease.term, f"{tag}: {detail}")
        for item in screened.valid:
            self._remember(item)
        return [item.lease for item in screened.valid]

    def _remember(self, item: SeenLease) -> None:
        kept = self.lease_history.setdefault(item.lease.term, [])
        if item not in kept:
            kept[:] = [*kept, item][-RECORDS_PER_TERM:]
        if lease_rules.counts_as_held(item):
            self.lease_holders.setdefault(item.lease.term, set()).add(item.lease.holder)
            key = (item.lease.holder, item.lease.term)
            if (
                key not in self.valid_leases
                or item.lease.expires_at >= self.valid_leases[key].lease.expires_at
            ):
                self.valid_leases[key] = item

    def _remembered(self, now: float, read: set[str]) -> list[LeaseRecord]:
        """Valid leases this peer saw, still live, whose holder's record this read did not return: a
        DHT read can come back partial (a slow or frozen node), and a live lease missing from one read
        has not lapsed. Without this a follower claims the next term while the holder is renewing."""
        return [
            item.lease
            for (holder, _), item in self.valid_leases.items()
            if holder not in read and item.lease.live(now)
        ]

    def _forget_old(self, now: float, current: set[LeaseRecord]) -> None:
        """Bounded memory: records long past their DHT expiration cannot be read again, and a record gone
        from the DHT for a while is forgotten whatever expiry it claimed (a forger writing records with
        far-future expiries must not grow this peer's memory)."""
        horizon = now - 4 * self.manifest.timing.lease_ttl
        for lease in [
            x
            for x, seen in self.first_seen.items()
            if x.expires_at < horizon or (x not in current and seen < horizon)
        ]:
            del self.first_seen[lease]
        for key in [k for k, v in self.valid_leases.items() if v.lease.expires_at < horizon]:
            del self.valid_leases[key]
        for term in sorted(self.lease_holders)[:-LEASE_HISTORY]:
            del self.lease_holders[term]
        for term in sorted(self.lease_history)[:-LEASE_HISTORY]:
            del self.lease_history[term]

    def verify_lease(self, leader: str, term: int, now: float, *, past_terms: bool = False) -> Task:
        """Whether `leader` held the lease of `term`; re-reads the swarm if unknown (at most once per
        heartbeat period: every frame of a replayed log used to cost a DHT read).

        `past_terms` (replays and snapshot vouching, never pushes): a term below the highest this peer
        trusts, whose lease it never saw (it lagged through it), counts for a leader that may
        synchronize; in a public run only listed synchronizers, which the organizer trusts, qualify."""
        if self.held_lease(leader, term):
            return True
        if past_terms and term < self.term_seen and self.manifest.may_synchronize(leader):
            return True
        if now - self.last_read >= self.manifest.timing.heartbeat_period:
            self.ingest((yield self.read_swarm()))
        return self.held_lease(leader, term)

    def saw_term(self, term: int) -> None:
        """A term this peer verified (a checked update of it, its own claim, or its saved state at a
        restart): the floor of its elections."""
        self.term_seen = max(self.term_seen, term)

    def lease_live_at(self, leader: str, term: int, now: float) -> bool:
        """Whether `leader`'s valid lease of `term` is live at `now` (an update pushed now was published
        under it); released leases count up to their release, both within `lease_margin` of clock skew."""
        item = self.valid_leases.get((leader, term))
        if item is None:
            return False
        lease, margin = item.lease, self.manifest.timing.lease_margin
        end = lease_rules.write_time(lease, self.manifest.timing) if lease.released else lease.expires_at
        return now <= end + margin

    def live_learners(self, now: float) -> frozenset[str]:
        """Live learners that count (`protocol.standing`): merged recently, or new. Known without reading
        every heartbeat each period: with heartbeat buckets `live_peers` holds each bucket as last read (at
        most B - 1 periods old), and with `[robust]` on a learner counts only while its deltas merge (or
        it is new), which every peer learns from the updates it applies (docs/architecture.md, "What a
        peer reads per tick"). A holder asks after every event it handles: the answer is kept until a read
        or the standing changes, or a counted learner's window closes (`Standing.active_until`)."""
        versions = (self._live_version[0], self.standing.version)
        kept = self._live_learners
        if kept is not None and kept.versions == versions and kept.since <= now < kept.before:
            return kept.answer
        live = [p for p, info in self.live_peers.items() if info.role in ("learner", "synchronizer")]
        if self.manifest.robust.enabled:
            answer, before = self.standing.active_until(live, now)
        else:
            answer, before = frozenset(live), float("inf")
        self._live_learners = _KeptLearners(versions, now, before, answer)
        return answer

    def held_lease(self, leader: str, term: int) -> bool:
        """Whether `leader` was seen holding the lease of `term`."""
        return leader in self.lease_holders.get(term, ())

    def decide(
        self,
        view: SwarmView,
        now: float,
        rounds_done: int,
        verified_newest: int | None = None,
        own_versions: tuple[int, ...] | None = None,
        busy: frozenset[str] = frozenset(),
        checks: claim_guard.ClaimChecks = claim_guard.NO_CHECKS,
    ) -> ElectionDecision:
        """The election on `view`; `own_versions` (this peer's replica now) stand in for the versions of
        its own heartbeat, which are up to a heartbeat period old. `busy`: candidates that hold their share
        of the other shards (`protocol.shards.at_cap`); they step aside while another candidate is up.
        A claim then passes `claim_guard.gate` with the seat's `checks`, this peer's warm-up and the read's
        gaps; a confirmation of this peer's claim waits for a read without gaps
        (`claim_guard.hold_confirmation`)."""
        heartbeats = self._ranked_heartbeats(view, now, own_versions, busy)
        sample = (now, sum(own_versions) if own_versions is not None else 0)
        self._own_sums, (lag, window_lag) = claim_guard.lags(
            self._own_sums, sample, self.manifest.timing, self.num_fragments
        )
        elect = partial(
            election.decide,
            self.peer_id,
            shards.shard_salt(self.manifest.run_id, self.shard),
            heartbeats,
            view.leases,
            now,
            self.manifest.timing,
            my_lease=self.my_lease,
            rounds_done=rounds_done,
            term_floor=self.term_seen,
            verified_newest=verified_newest,
            down=self.seen_down(now),
            successor_lag=lag,
            confirmed=self.confirmed,
        )
        decision = elect(max_lag=0)
        if decision.tag in claim_guard.WINDOW_TAGS:  # claim windows: ranked with slack, used only in sync
            decision = claim_guard.hold_lagging_claim(
                elect(max_lag=window_lag), self.peer_id, heartbeats, now, verified_newest
            )
        checks = replace(checks, warm_up=self._warm_up_left(decision, view, now), gaps=view.gaps)
        decision = claim_guard.hold_confirmation(claim_guard.gate(decision, checks), view.gaps)
        if decision.tag == election.ElectionTag.NOT_ELIGIBLE and self.peer_id in busy:
            detail = f"I hold my share of the other shards; {decision.holder} may claim term {decision.term}"
            decision = replace(decision, detail=detail)
        return self._account(decision, view)

    def follow_only(self, view: SwarmView, now: float) -> ElectionDecision:
        """The election of a peer that does not elect (`elects`): follow the live holder the view's leases
        show (`election.follow_only`). It keeps no claim state: a peer that turns candidate later
        (`_volunteer`) starts reading as a fresh one does (its warm-up, the candidates it remembers)."""
        decision = election.follow_only(
            self.peer_id, view.leases, now, self.manifest.timing, term_floor=self.term_seen
        )
        return self._account(decision, view)

    def _ranked_heartbeats(
        self, view: SwarmView, now: float, own_versions: tuple[int, ...] | None, busy: frozenset[str]
    ) -> list[PeerHeartbeat]:
        """The heartbeats the election ranks: recent candidates a read missed added, `busy` candidates
        stepped aside while another is up, and this peer's own versions as they are now."""
        heartbeats = self._with_recent_candidates(view, now)
        if any(hb.may_sync and hb.live(now) and hb.peer_id not in busy for hb in heartbeats):
            heartbeats = [_stepped_aside(hb) if hb.peer_id in busy else hb for hb in heartbeats]
        if own_versions is None:
            return heartbeats
        return [replace(hb, versions=own_versions) if hb.peer_id == self.peer_id else hb for hb in heartbeats]

    def _account(self, decision: ElectionDecision, view: SwarmView) -> ElectionDecision:
        """Keep what a decision teaches: the lease followed, the highest term seen (the fence), a holder's
        step-down from its own refused lease; note the decision when it changed."""
        self.followed = None
        if decision.action == election.FOLLOW:
            self.followed = next(
                (x for x in view.leases if (x.holder, x.term) == (decision.holder, decision.term)), None
            )
        seen = election.highest_term_seen(view.leases, self.term_seen)
        # A wait names the term it waits to claim: only a term someone holds (or I claim) is seen.
        held = decision.action in (election.CLAIM, election.RENEW, election.HOLD, election.FOLLOW)
        decision = self._refused_holder(decision)
        if decision.tag == election.ElectionTag.REFUSED_LEASE:
            # the refused term was never valid anywhere: fence by the highest term the readers accept
            self.term_seen = election.highest_term_seen(view.leases, 0)
            self.refused_terms += 1
        else:
            self.term_seen = max(self.term_seen, seen, decision.term if held else 0)
        quiet = decision.action in (election.HOLD, election.RENEW, election.FOLLOW)
        if not quiet or decision.tag != self.last_election_tag:
            self.journal.note(f"election: {decision}")
        self.last_election_tag = decision.tag
        return decision

    def _refused_holder(self, decision: ElectionDecision) -> ElectionDecision:
        """A holder whose own lease record the lease rules refused steps down: a term claimed where the
        rest of the run could not see it (an island, a partitioned DHT) is refused by every reader once
        they meet, and holding it on would merge a branch nobody follows, for good."""
        mine, refused = self.my_lease, self.own_refused
        if decision.action not in (election.HOLD, election.RENEW) or mine is None or refused is None:
            return decision
        term, why = refused
        if term != mine.term:
            return decision
        return ElectionDecision(
            election.STEP_DOWN,
            election.ElectionTag.REFUSED_LEASE,
            f"readers refuse my term {term} lease ({why})",
            term=term,
        )

    def _with_recent_candidates(self, view: SwarmView, now: float) -> list[PeerHeartbeat]:
        """The view's heartbeats, plus those of peers that may synchronize seen in a read within the last
        `heartbeat_ttl + lease_ttl` that this read lacks (unless seen down):
        a read that misses a candidate (a flood, a loaded machine) must not let two peers each rank
        themselves "1 of 1" and claim one term. A remembered candidate only takes its claim window in the
        ranking; if it is gone, the next-ranked claims one `claim_grace` later."""
        timing = self.manifest.timing
        for hb in view.heartbeats:
            if hb.may_sync and hb.live(now):
                self._candidates_seen[hb.peer_id] = (hb, now)
        horizon = now - timing.heartbeat_ttl - timing.lease_ttl
        for peer in [p for p, (_, at) in self._candidates_seen.items() if at < horizon]:
            del self._candidates_seen[peer]
        present = {hb.peer_id for hb in view.heartbeats}
        down = self.seen_down(now)
        missing = [
            replace(hb, expires_at=now + timing.heartbeat_period)
            for peer, (hb, _) in self._candidates_seen.items()
            if peer not in present and peer not in down
        ]
        return [*view.heartbeats, *missing]

    def _warm_up_left(self, decision: ElectionDecision, view: SwarmView, now: float) -> str | None:
        """Why a claim still waits to have read the swarm for `heartbeat_ttl` (every live peer's heartbeat
        was written meanwhile): at a run's start two peers that each read only themselves both claimed
        term 1. A succession claim (the holder is down and named me) is exact and never waits."""
        if self._reading_since is None:
            self._reading_since = now
        waited, ttl = now - self._reading_since, self.manifest.timing.heartbeat_ttl
        down = self.seen_down(now)
        succession = any(x.successor == self.peer_id and x.holder in down for x in view.leases if x.live(now))
        if decision.action != election.CLAIM or succession or waited >= ttl:
            return None
        return f"reading the swarm for {waited:.1f}s of {ttl:.1f}s first"

    def mark_down(self, peer: str, now: float) -> None:
        """`peer`'s address refused a connection at `now` (its process is gone)."""
        self.down[peer] = now

    def mark_alive(self, peer: str) -> None:
        self.down.pop(peer, None)

    def seen_down(self, now: float) -> frozenset[str]:
        """Peers seen down within a heartbeat TTL (a restarted peer's heartbeat soon says otherwise)."""
        ttl = self.manifest.timing.heartbeat_ttl
        for peer in [p for p, at in self.down.items() if now - at > ttl]:
            del self.down[peer]
        return frozenset(self.down)

    def successor_of_followed(self) -> str | None:
        """The holder this peer follows, if its lease names this peer to succeed it (so this peer
        watches it: a refused probe lets it take over at once)."""
        lease = self.followed
        if lease is None or lease.successor != self.peer_id or lease.holder == self.peer_id:
            return None
        return lease.holder

    def follow(self, holder: str | None, term: int) -> None:
        """Follow `holder`'s term (None: no synchronizer known); another holder after one is a failover,
        unless the old one released its term (a planned rotation)."""
        if None not in (self.holder, holder) and holder != self.holder:
            if not self.released(self.holder, self.holder_term):
                self.failovers_seen += 1
        self.holder, self.holder_term = holder, term

    def released(self, holder: str | None, term: int) -> bool:
        """Whether a valid record this peer read says `holder` released `term`."""
        return any(x.lease.holder == holder and x.lease.released for x in self.lease_history.get(term, ()))


@dataclass(frozen=True)
class _KeptLearners:
    """An answer of `Membership.live_learners`, good from `since` until before `before` while the read's
    and the standing's versions are still `versions`."""

    versions: tuple[int, int]
    since: float
    before: float
    answer: frozenset[str]


def _stepped_aside(hb: PeerHeartbeat) -> PeerHeartbeat:
    """`hb` as a candidate that steps aside (`may_sync` off); built directly, not by `dataclasses.replace`:
    every shard's election of every read does this for most candidates at 256 peers (issue #40)."""
    return PeerHeartbeat(hb.peer_id, False, hb.reachable, hb.versions, hb.expires_at, hb.term_seen)


class _ReportedTerms(Mapping[str, int]):
    """The terms of `shard` that a read's peers that may synchronize report (`lease_rules.screen_leases`),
    built when first read: only a term jump or an early claim asks, and every shard's screen of every
    read built them all (issue #40)."""

    def __init__(self, live: dict[str, HeartbeatInfo], shard: int, may_synchronize: Callable[[str], bool]):
        self._live, self._shard, self._may_synchronize = live, shard, may_synchronize

    @cached_property
    def _terms(self) -> dict[str, int]:
        return {
            peer: info.term_of(self._shard)
            for peer, info in self._live.items()
            if self._may_synchronize(peer)
        }

    def __getitem__(self, peer: str) -> int:
        return self._terms[peer]

    def __iter__(self) -> Iterator[str]:
        return iter(self._terms)

    def __len__(self) -> int:
        return len(self._terms)
