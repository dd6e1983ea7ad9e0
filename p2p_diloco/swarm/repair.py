"""Catching up and repairing a peer's replica (serving other peers' catch-up is `swarm.serving`).

Catch-up and repair are tasks (see `swarm.effects`): generators that yield a `Request` (read the swarm,
fetch an update log, fetch snapshots) and are resumed with its result, so the peer keeps handling
events while a fetch runs and nothing here does I/O. Between a yield and its resume the replica may
have moved on; every step re-reads the versions it depends on (a replayed update that no longer fits is
skipped, an older snapshot is refused by the replica).

- replay: apply missing updates from a peer's log, each checked like a pushed one (lease, run, order,
  checksum); a mismatch proves a fork (`protocol.reconcile`);
- snapshots: a fragment's (Theta, momentum) streamed in chunks (`swarm.snapshots`,
  `wire.snapshot_chunks`) from several peers at once, each chunk checked against the index's digest and
  the whole against its checksum; a source that dies midway or sends a bad chunk is dropped and the
  others finish;
- reconciliation after a partition: the fragment moves onto the winning branch (`reconcile_fragment`);
- anti-entropy (`repair_round`): a fragment off the live peers' winning tip for a heartbeat period.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Collection, Sequence

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol import reconcile
from p2p_diloco.protocol.decisions import Action, Decision
from p2p_diloco.protocol.messages import UpdateTag
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.protocol.replica import ReplicaTag
from p2p_diloco.swarm.effects import (
    FetchUpdateLogs,
    FetchUpdates,
    Reload,
    RepairKind,
    RepairNeeded,
    Task,
    Together,
    ToLearner,
)
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import PeerContext
from p2p_diloco.swarm.serving import Serving
from p2p_diloco.swarm.snapshot_download import Downloaded, SnapshotDownloader, download_windows
from p2p_diloco.swarm.updates import UpdateBook, UpdateSource
from p2p_diloco.swarm.vouching import MIN_INDEPENDENT_PEERS, sources_on
from p2p_diloco.wire.frames import decode_update
from p2p_diloco.wire.snapshot_chunks import SnapshotIndex


class Repair:
    def __init__(
        self,
        ctx: PeerContext,
        book: UpdateBook,
        membership: Membership,
        serving: Serving,
        *,
        has_learner: bool,
    ):
        self.peer_id = ctx.peer_id
        self.manifest = ctx.manifest
        self.plan = ctx.plan
        self.replica = ctx.replica
        self.journal = ctx.journal
        self._emit = ctx.emit
        self.book = book
        self.membership = membership
        self.has_learner = has_learner
        # a snapshot replaced a fragment: the outbox forgets its deltas in flight and tells the learner
        # (`Outbox.on_reload`)
        self.reloaded: Callable[[Reload], None] = lambda message: self._emit(ToLearner(message))
        # fragment -> (since when it is off the winning tip without moving, its tip then)
        self.behind_since: dict[int, tuple[float, BranchTip]] = {}
        self.reconciliations: list[str] = []  # every `reconciled` line, in order
        self.busy: set[int] = set()  # fragments a repair task is working on
        self.serving = serving
        self.downloader = SnapshotDownloader(ctx.manifest, ctx.replica, book, ctx.journal)
        self.downloaded: Counter[str] = Counter()  # snapshot bytes installed, per source, ever

    # ---- replay ------------------------------------------------------------------------------------

    def catch_up_fragment(
        self,
        fragment: int,
        sources: list[str],
        *,
        target: int,
        now: float,
        first_log: list[bytes] | BaseException | None = None,
    ) -> Task:
        """Replay missing updates of `fragment` from the sources' logs; fall back to a snapshot.
        `first_log`: the first source's log (or its fetch's error), already fetched with the others."""
        for index, source in enumerate(sources):
            if self.replica.version(fragment) >= target:
                return True
            try:
                if index == 0 and first_log is not None:
                    if isinstance(first_log, BaseException):
                        raise first_log
                    frames = first_log
                else:
                    frames = yield FetchUpdates(source, fragment, self.replica.version(fragment))
            except (ConnectionError, TimeoutError) as exc:
                self.journal.note(f"replay of fragment {fragment} from {source} failed: {exc}")
                continue
            fork = yield from self.replay_log(fragment, source, frames, now)
            if fork is not None:  # the source's history does not pass through my state: a fork, not a gap
                mine, record = fork
                theirs = BranchTip(record.term, record.to_version, record.checksum)
                if mine > theirs:  # their branch loses to mine (a lower term): its peers move, not me
                    self.journal.note(
                        f"fragment {fragment}: {source}'s log forks onto {theirs}, "
                        f"which loses to my {mine}; kept"
                    )
                    return False
                proof = reconcile.fork_proven(
                    mine, theirs, update_term=record.term, from_version=record.from_version
                )
                return (yield from self.reconcile_fragment(fragment, theirs, [source], proof))
        if self.replica.version(fragment) >= target:
            return True
        return (yield from self.fetch_fragment(fragment, sources))

    def _holders(self) -> frozenset[str]:
        """The synchronizers this peer follows, one per shard (asked for logs last: they merge every round's
        deltas, and a peer on the tip that merges nothing serves as well)."""
        return frozenset(m.holder for m in self.membership.shards if m.holder is not None)

    def task_for(self, needed: RepairNeeded) -> Task:
        """The task that performs `needed`: a catch-up, a reconciliation or a refetch of one fragment."""
        p = needed.fragment
        sources = spread_sources(
            needed.sources, self.peer_id, p, self.manifest.may_synchronize, self._holders()
        )
        if needed.kind == RepairKind.RECONCILE:
            assert needed.theirs is not None
            return self.reconcile_fragment(p, needed.theirs, sources, needed.proof)
        if needed.kind == RepairKind.CATCH_UP:
            return self.catch_up_fragment(p, sources, target=needed.target, now=self.membership.last_read)
        return self.fetch_fragment(p, sources)

    def replay_log(self, fragment: int, source: str, frames: list[bytes], now: float) -> Task:
        """Apply the frames of `source`'s log of `fragment` that extend this replica, each checked like a
        pushed update; stops at one whose lease cannot be verified (its record has expired from the DHT: the
        rest cannot be verified either). Returns (my tip, their record) when a record proves a fork (its
        checksum does not follow my state), else None."""
        for frame in frames:
            before = self.book.tip(fragment)
            verdict = yield from self.book.accept(frame, source, UpdateSource.REPLAYED, now)
            record, tag = verdict.record, verdict.reply.tag
            if tag == UpdateTag.NO_LEASE:
                return None
            if record is not None and record.fragment == fragment and tag == ReplicaTag.CHECKSUM_MISMATCH:
                return before, record
        return None

    # ---- snapshots ---------------------------------------------------------------------------------

    def _install(self, fragment: int, source: str, downloaded: Downloaded, *, force: bool = False) -> Task:
        """Load a downloaded snapshot if its state is vouched for (`swarm.vouching`) and checks out."""
        snap, params, momentum = downloaded
        term = yield from self._vouched_term(fragment, source, snap)
        if term is None:
            self.journal.reject(
                source,
                UpdateTag.UNVOUCHED_SNAPSHOT,
                f"fragment {fragment} v{snap.version} {snap.checksum[:12]}: no signed, leased update and no "
                "two peers vouch for that state",
            )
            return False
        decision = self.replica.load_fragment(
            fragment, snap.version, params, momentum, snap.checksum, force=force, adopt=True
        )
        self.journal.note(f"snapshot of fragment {fragment} from {source}: {decision.reason}")
        if decision.action != Action.LOAD:
            return False
        self.book.tip_terms[fragment] = term
        self.book.forget(fragment)
        self.serving.offer_snapshots([fragment])
        if self.has_learner:
            view = self.replica.params_view(fragment)
            self.reloaded(Reload({fragment: (self.replica.version(fragment), view)}))
        return True

    def _vouched_term(self, fragment: int, source: str, snap: SnapshotIndex) -> Task:
        """The term of the update that produced the snapshot's state, if that state is vouched for: by an
        update record this peer checked, by the tips of two live peers that may synchronize (terms capped
        at the highest leased term), or by the record that produced it in the source's log (its leader's
        signature, lease and, for a sparse round, its listed deltas checked here); None otherwise. What
        unlisted keys report never counts."""
        term = self.book.vouchers.term_of(fragment, snap.version, snap.checksum)
        if term is not None:
            return term
        state = BranchTip(0, snap.version, snap.checksum)
        alike = [
            tip.term
            for peer, tip in self._reported(fragment).items()
            if self.manifest.may_synchronize(peer) and tip.same_state(state)
        ]
        if len(alike) >= MIN_INDEPENDENT_PEERS:
            return min(alike)
        if snap.version == 0:
            return None
        try:
            frames = yield FetchUpdates(source, fragment, snap.version - 1)
        except (ConnectionError, TimeoutError):
            return None
        for frame in frames:
            try:
                record = decode_update(frame, max_bytes=self.manifest.wire.max_message_bytes)
            except DecodeError:
                continue
            produced = (record.fragment, record.to_version, record.checksum) == (
                fragment,
                snap.version,
                snap.checksum,
            )
            if produced and self.book.signed_by_leader(record) and self.book.content_checks(record):
                last_read = self.membership.last_read
                if (
                    yield from self.membership.for_fragment(fragment).verify_lease(
                        record.leader, record.term, last_read, past_terms=True
                    )
                ):
                    if self.book.vouchers.vouch(record):  # not if its leader was caught forging a merge
                        return record.term
        return None

    def fetch_fragment(self, fragment: int, sources: list[str]) -> Task:
        """Download a checked snapshot of one fragment, its chunks from several sources at once; the learner's
        copy of it is reset to the global one. Sources whose state fails its checksum are not asked again."""
        left = list(dict.fromkeys(sources))
        while left:
            answer = yield from self.downloader.download(fragment, left)
            if answer is None:
                return False
            downloaded, bytes_from = answer
            used = list(bytes_from) or left[:1]
            if (yield from self._install(fragment, used[0], downloaded)):
                self.downloaded.update(bytes_from)
                return True
            left = [s for s in left if s not in used]
        return False

    def fetch_fragments(self, wanted: dict[int, list[str]]) -> Task:
        """Download several fragments (a newcomer), each from several peers at once (`wanted[p]`: the peers on
        its winning tip, first the one to ask first), as many side by side as fit `[limits]
        snapshot_download_bytes` (at least one): the memory peak is the replica plus that window, and a
        newcomer waits for one round trip per step of a download, not one per step per fragment."""
        sizes = {p: self.plan.sizes()[p] for p in wanted}
        windows = download_windows(sizes, self.manifest.limits.snapshot_download_bytes)
        installed = 0
        for window in windows:
            done = yield Together(tuple(self.fetch_fragment(p, wanted[p]) for p in window))
            installed += sum(map(bool, done))
        return installed

    # ---- reconciliation and anti-entropy -----------------------------------------------------------

    def reconcile_fragment(
        self, fragment: int, winner: BranchTip, sources: list[str], decision: Decision | None = None
    ) -> Task:
        """Bring `fragment` onto the branch whose tip is `winner` (protocol/reconcile.py): nothing if in
        sync or ahead, replay (verified by checksums, a mismatch proves a fork) if behind, else replace it
        by a snapshot of a source on the winning branch, older than mine if need be, and log `reconciled`."""
        mine = self.book.tip(fragment)
        decision = decision or reconcile.classify(mine, winner)
        if decision.action == reconcile.IN_SYNC:
            self.book.tip_terms[fragment] = max(mine.term, winner.term)
            return True
        if decision.action == reconcile.KEEP:
            return True
        if decision.action == reconcile.CATCH_UP:
            return (
                yield from self.catch_up_fragment(
                    fragment, sources, target=winner.version, now=self.membership.last_read
                )
            )
        for source in sources:
            answer = yield from self.downloader.download(fragment, [source])
            if answer is None:
                continue
            downloaded = answer[0]
            snap = downloaded[0]
            if self.book.tip(fragment) != mine:  # updates applied meanwhile: the decision is stale
                self.journal.note(
                    f"fragment {fragment} moved from {mine} to {self.book.tip(fragment)} while reconciling "
                    f"toward {winner}: not replaced (anti-entropy decides again on fresh tips)"
                )
                return False
            got = BranchTip(winner.term, snap.version, snap.checksum)
            if snap.version < winner.version or (
                snap.version == winner.version and not got.same_state(winner)
            ):
                self.journal.note(
                    f"snapshot of fragment {fragment} from {source} ({got}) is not on the branch {winner}"
                )
                continue
            if (yield from self._install(fragment, source, downloaded, force=True)):
                line = reconcile.reconciled_line(
                    fragment, mine, self.book.tip(fragment), source, decision.reason
                )
                self.reconciliations.append(line)
                self.journal.note(line)
                return True
        self.journal.note(
            f"fragment {fragment} not reconciled yet: no source on the winning branch ({decision.reason})"
        )
        return False

    def _reported(self, fragment: int) -> dict[str, BranchTip]:
        """Other live peers' tips of `fragment` as the last read showed them (`_reported_all`)."""
        return self._reported_all()[fragment]

    def _reported_all(self) -> list[dict[str, BranchTip]]:
        """Per fragment, other live peers' tips as the last read showed them (bounded whatever M: issue #40),
        terms capped at the highest leased term of its shard (`swarm.vouching`); computed once per read."""
        membership = self.membership
        ceilings = [membership.for_fragment(p).term_seen for p in range(self.plan.num_fragments)]
        return self.book.reported(membership.read_peers, self.peer_id, ceilings)

    def due_repairs(self, now: float) -> list[tuple[int, BranchTip, list[str], Decision]]:
        """Fragments off the winning trusted tip for a whole heartbeat period without moving (not pushes
        still in flight: in a large swarm a fragment is often a version behind at two reads in a row while
        every update reaches it in time, and replaying logs for those was a twentieth of a peer's time at
        256 peers, issue #40): (fragment, winning tip, peers on it, classification), to
        `reconcile_fragment`. Only tips vouched for or reported by peers that may synchronize name a
        target (`swarm.vouching`)."""
        due = []
        period = self.manifest.timing.heartbeat_period
        witness = self.manifest.may_synchronize
        reported_all = self._reported_all()
        for p in range(self.plan.num_fragments):
            mine = self.book.tip(p)
            reported = reported_all[p]
            if reconcile.outranked_by_none(mine, reported.values()):  # what the rules below conclude then
                self.behind_since.pop(p, None)
                continue
            theirs = self.book.vouchers.trusted_tips(p, reported, witness)
            winner = reconcile.winning_tip([mine, *theirs.values()])
            action = reconcile.action_of(mine, winner)
            credible = self.book.vouchers.credible_tips(p, reported, witness)
            if action in (reconcile.IN_SYNC, reconcile.KEEP) and credible.keys() - theirs.keys():
                # A credible tip nobody else vouches for (one listed synchronizer's) may still show I am
                # behind on my own branch: replaying its log is safe (every record's signature and lease is
                # checked; a snapshot fallback must be vouched for), a rollback toward it is not.
                ahead = reconcile.winning_tip([mine, *credible.values()])
                if reconcile.action_of(mine, ahead) == reconcile.CATCH_UP:
                    winner, action = ahead, reconcile.CATCH_UP
            if action in (reconcile.IN_SYNC, reconcile.KEEP):
                self.book.tip_terms[p] = max(mine.term, winner.term) if mine.same_state(winner) else mine.term
                self.behind_since.pop(p, None)
                continue
            since, then = self.behind_since.get(p, (now, mine))
            if action == reconcile.CATCH_UP and then.version < mine.version:
                since = now  # it moved up since: pushes are coming in, the next may be on its way already
            self.behind_since[p] = (since, mine)
            if now - since >= period and p not in self.busy:
                decision = reconcile.classify(mine, winner)
                sources = sources_on(winner, reported, witness)
                self.journal.note(f"fragment {p}: {decision}; repairing from {len(sources)} peers")
                self.behind_since.pop(p, None)
                due.append((p, winner, sources, decision))
        return due

    def catch_up(self, now: float, *, replay: bool) -> Task:
        """Bring the replica to the swarm's versions: replay logs (`replay`) or download snapshots,
        spreading fragments over the up-to-date peers."""
        held = set(range(self.plan.num_fragments)) - self.busy  # anti-entropy waits for the catch-up
        self.busy |= held
        try:
            return (yield from self._catch_up(now, replay=replay))
        finally:
            self.busy -= held

    def _catch_up(self, now: float, *, replay: bool) -> Task:
        views, read_at = (
            self.membership.ingest_all((yield self.membership.read_swarm())),
            self.membership.last_read,
        )
        holders = [
            max((x for x in v.leases if x.live(read_at)), key=lambda x: x.term, default=None) for v in views
        ]
        others = {p: i for p, i in self.membership.live_peers.items() if p != self.peer_id and i.versions}
        stats = {"replayed": 0, "snapshots": 0}
        wanted: dict[int, list[str]] = {}
        targets: dict[int, int] = {}
        behind: list[tuple[int, list[str], int]] = []  # (fragment, sources, target) to replay
        if not others:
            return stats
        reported_all = self._reported_all()
        for p in range(self.plan.num_fragments):
            reported = reported_all[p]
            tips = self.book.vouchers.credible_tips(p, reported, self.manifest.may_synchronize)
            if not tips:
                continue  # only unlisted keys report it: wait for a credible tip, never follow theirs
            # the winning branch's tip (protocol/reconcile.py), not merely the highest version
            winner = reconcile.winning_tip(tips.values())
            target = winner.version
            if self.replica.version(p) >= target:
                continue  # up to date, or ahead on a branch that anti-entropy reconciles
            on = sources_on(winner, reported, self.manifest.may_synchronize)
            sources = spread_sources(on, self.peer_id, p, self.manifest.may_synchronize, self._holders())
            if replay:
                behind.append((p, sources, target))
            else:
                wanted[p], targets[p] = sources, target
        if behind:  # every fragment's first log at once (one round trip, not one per fragment)
            logs = yield FetchUpdateLogs(tuple((s[0], p, self.replica.version(p)) for p, s, _ in behind))
            for (p, sources, target), log in zip(behind, logs, strict=True):
                before = self.replica.version(p)
                yield from self.catch_up_fragment(p, sources, target=target, now=now, first_log=log)
                stats["replayed"] += self.replica.version(p) - before
        before, start = Counter(self.downloaded), {p: self.replica.version(p) for p in wanted}
        stats["snapshots"] = yield from self.fetch_fragments(wanted)
        stats["from_sources"] = dict(self.downloaded - before)  # snapshot bytes per source
        # a loaded snapshot, or the tip its source reported, may be updates behind: replay the rest from the
        # holders' logs (the freshest), then from the sources' up to the tips read
        loaded = [p for p in sorted(wanted) if self.replica.version(p) != start[p]]
        versions = sum(self.replica.version(p) for p in loaded)
        lease_of = {p: holders[self.membership.for_fragment(p).shard] for p in loaded}
        ask = {p: lease.holder for p, lease in lease_of.items() if lease and lease.holder != self.peer_id}
        asks = tuple((h, p, self.replica.version(p)) for p, h in ask.items())
        logs = (yield FetchUpdateLogs(asks)) if asks else []
        for (p, holder), log in zip(ask.items(), logs, strict=True):
            if not isinstance(log, BaseException):
                yield from self.replay_log(p, holder, log, now)
        short = [p for p in loaded if self.replica.version(p) < targets[p]]
        yield Together(tuple(self.catch_up_fragment(p, wanted[p], target=targets[p], now=now) for p in short))
        stats["replayed"] += sum(self.replica.version(p) for p in loaded) - versions
        return stats


def spread_sources(
    sources: Sequence[str],
    asker: str,
    fragment: int,
    may_witness: Callable[[str], bool],
    holders: Collection[str] = (),
) -> list[str]:
    """`sources` in the order `asker` tries them for `fragment`: those that may witness first, within them
    the `holders` (synchronizers, busy merging) last, each group ranked by a hash of (asker, fragment,
    source), so peers that lag spread their fetches over the peers on the tip instead of all asking the
    same one (issue #40: sorted by ID, two peers served 136 of 146 replays at 128 peers)."""

    def rank(source: str) -> tuple[bool, bool, bytes]:
        key = f"{asker}:{fragment}:{source}".encode()
        return (not may_witness(source), source in holders, hashlib.blake2b(key, digest_size=8).digest())

    return sorted(dict.fromkeys(sources), key=rank)
