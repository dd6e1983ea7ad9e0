"""The handover check: a new holder asks the previous holder and the live peers for updates it lacks
before it publishes anything of its term; and the fragments a holder holds back while it catches up.

A peer that claims a term knows the swarm's versions only from heartbeats, which are up to a heartbeat
period old, and from the pushes it received. The previous holder's last updates can be missing from both:
pushed to some peers just before it was killed, or published while this peer did not yet know that term's
lease (slow DHT writes). An update published from behind starts a branch of the higher term, which wins
reconciliation and drops those versions, with the deltas they merged (two such losses in the 30-minute
chaos run at 977d15f). So when this peer takes a term it asks, directly, every fragment's updates after
its own versions from the previous holders and the most advanced live peers that may synchronize or whose
updates it checked before (`handover_sources`; a flood of fresh keys claiming high versions is never
asked), replays
what extends its replica (each record checked: leader's signature and lease, `Repair.replay_log`) and
holds every round of the term until all have answered or `timing.heartbeat_period` has passed: a frozen
or unreachable peer delays the term by at most that, and a late answer is still replayed if it fits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import PeerContext
from p2p_diloco.swarm.repair import Repair
from p2p_diloco.wire.records import HeartbeatInfo

MAX_SOURCES = 8  # peers asked per handover: the previous holders first, then the most advanced live peers


def handover_sources(
    me: str,
    previous_holders: list[str],
    live: Mapping[str, HeartbeatInfo],
    down: frozenset[str],
    limit: int = MAX_SOURCES,
) -> list[str]:
    """Whom a new holder asks: the previous terms' holders (newest term first), then live peers by the sum of
    the versions their heartbeats report (highest first, ties by peer ID); never itself or a peer whose
    address refused a connection lately (its process is gone)."""
    by_progress = sorted(live, key=lambda peer: (-sum(live[peer].versions), peer))
    chosen = []
    for peer in [*previous_holders, *by_progress]:
        if peer != me and peer not in down and peer not in chosen:
            chosen.append(peer)
    return chosen[:limit]


class Handover:
    """Owned by a `Peer` (its owner thread): `begin` at every term this peer takes, `held` asked by the
    synchronizer role before it closes any round; `wait_for` holds a fragment that trusted tips show
    behind."""

    def __init__(
        self,
        ctx: PeerContext,
        membership: Membership,
        repair: Repair,
        spawn: Callable[[fx.Task, Callable[[Any], None]], None],
    ):
        self.peer_id, self.manifest, self.journal = ctx.peer_id, ctx.manifest, ctx.journal
        self.membership = membership
        self.repair = repair
        self._spawn = spawn
        self.term = 0
        self.waiting: set[str] = set()  # sources of the current term's check that have not answered
        self.deadline = float("-inf")
        # fragment -> (a version trusted tips of live peers hold, when first seen): while the replica lacks
        # it, the fragment's rounds wait for the catch-up (an update from behind would fork the fragment
        # and win over the newer versions), but at most `timing.lease_ttl`: a run never halts on it
        self.behind: dict[int, tuple[int, float]] = {}
        self._gave_up: dict[int, int] = {}  # fragment -> the highest version a wait ran out for

    def begin(self, term: int, now: float) -> None:
        """Ask the sources for what this replica lacks; rounds wait (`holding`) until they answered."""
        membership = self.membership
        previous = [
            holder
            for t in sorted((t for t in membership.lease_holders if t < term), reverse=True)[:2]
            for holder in sorted(membership.lease_holders[t])
        ]
        # Only peers backed by a signed record are asked (docs/security.md): those that may synchronize, and
        # peers whose updates this peer checked; never whoever writes a heartbeat claiming high versions.
        verified = self.repair.book.verified_sources
        askable = {
            peer: info
            for peer, info in membership.live_peers.items()
            if self.manifest.may_synchronize(peer) or peer in verified
        }
        sources = handover_sources(self.peer_id, previous, askable, membership.seen_down(now))
        self.term = term
        self.behind.clear()
        self._gave_up.clear()
        self.waiting = set(sources)
        self.deadline = now + self.manifest.timing.heartbeat_period
        if not sources:
            return
        self.journal.note(f"term {term}: handover check, asking {', '.join(sources)} for newer updates")
        for source in sources:
            self._spawn(self._ask(term, source, now), lambda _, s=source, t=term: self._answered(t, s))

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
        runs."""
        if self.holding(now):
            return frozenset(range(self.repair.plan.num_fragments))
        limit = self.manifest.timing.lease_ttl
        for p, (version, since) in sorted(self.behind.items()):
            if self.repair.replica.version(p) >= version:
                del self.behind[p]
            elif now - since >= limit:
                del self.behind[p]
                self._gave_up[p] = version  # not again for this version: one wait per tip, not one per read
                self.journal.note(
                    f"fragment {p}: not caught up to v{version} within {limit:.1f}s; merging from "
                    f"v{self.repair.replica.version(p)}"
                )
        return frozenset(self.behind)

    def holds(self, now: float) -> frozenset[int]:
        """What `held(now)` answers, without its bookkeeping (no note, nothing forgotten)."""
        if self.waiting and now < self.deadline:
            return frozenset(range(self.repair.plan.num_fragments))
        limit = self.manifest.timing.lease_ttl
        return frozenset(
            p
            for p, (version, since) in self.behind.items()
            if self.repair.replica.version(p) < version and now - since < limit
        )

    def hold_ends(self) -> float | None:
        """When the holds of `held` lift at the latest (an answer or a catch-up can lift them earlier:
        those arrive as events); None when nothing is held."""
        ends = [since + self.manifest.timing.lease_ttl for _, since in self.behind.values()]
        if self.waiting:
            ends.append(self.deadline)
        return min(ends, default=None)

    def holding(self, now: float) -> bool:
        """Whether the term's rounds still wait for the check (at most `timing.heartbeat_period`)."""
        if not self.waiting:
            return False
        if now < self.deadline:
            return True
        self.journal.note(
            f"term {self.term}: handover check, no answer from {', '.join(sorted(self.waiting))} within "
            f"{self.manifest.timing.heartbeat_period:.1f}s; merging (a late answer is still replayed)"
        )
        self.waiting.clear()
        return False

    def _answered(self, term: int, source: str) -> None:
        if term == self.term:
            self.waiting.discard(source)

    def _ask(self, term: int, source: str, now: float) -> fx.Task:
        replica = self.repair.replica
        fragments = range(self.repair.plan.num_fragments)
        logs = yield fx.FetchUpdateLogs(tuple((source, p, replica.version(p)) for p in fragments))
        for p, log in zip(fragments, logs, strict=True):
            if isinstance(log, BaseException):
                self.journal.note(f"term {term}: handover check, {source} did not answer: {log}")
                return
            before = replica.version(p)
            fork = yield from self.repair.replay_log(p, source, log, now)
            gained = replica.version(p) - before
            if gained:
                self.journal.note(
                    f"term {term}: handover check, replayed v{before + 1}-v{before + gained} of fragment {p} "
                    f"from {source}"
                )
            if fork is not None:  # left to anti-entropy, which moves the fragment onto the winning branch
                self.journal.note(
                    f"term {term}: handover check, {source}'s log of fragment {p} forks from mine at "
                    f"v{fork[1].from_version}"
                )
