"""Who may synchronize next: live peers' heartbeats, the up-to-date eligible candidates among them, their
rendezvous ranking for a term, and the successor a holder names in its lease (`protocol.election`).

Pure functions of the heartbeats a peer read and the versions it has verified; the election
(`protocol.election.decide`) and the lease rules (`protocol.lease_rules`) build on them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerHeartbeat:
    """One peer's heartbeat as read from the heartbeat key (subkey = peer ID). `versions` are its replica's
    fragment versions; `term_seen` is the highest lease term it has seen (keeps terms monotonic after lease
    records vanish)."""

    peer_id: str
    may_sync: bool
    reachable: bool
    versions: tuple[int, ...]
    expires_at: float
    term_seen: int = 0

    def live(self, now: float) -> bool:
        return now < self.expires_at


def _score(run_id: str, term: int, peer_id: str) -> int:
    digest = hashlib.blake2b(f"{run_id}/{term}/{peer_id}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big")


def rendezvous_rank(run_id: str, term: int, peer_ids: Iterable[str]) -> list[str]:
    """Distinct `peer_ids` ordered by blake2b(run_id/term/peer_id), highest score first (ID breaks ties)."""
    return sorted(set(peer_ids), key=lambda p: (_score(run_id, term, p), p), reverse=True)


def newest_versions(
    heartbeats: Iterable[PeerHeartbeat], now: float, verified_newest: int | None = None
) -> int:
    """The highest sum of fragment versions among live heartbeats, capped at `verified_newest` (the sum
    the caller has seen backed by validly leased updates): a forged heartbeat claiming versions nobody
    published must not make honest peers look out of date."""
    newest = max((sum(hb.versions) for hb in heartbeats if hb.live(now)), default=0)
    return newest if verified_newest is None else min(newest, verified_newest)


def eligible_candidates(
    heartbeats: Iterable[PeerHeartbeat], now: float, max_lag: int = 0, verified_newest: int | None = None
) -> list[PeerHeartbeat]:
    """Live heartbeats that may synchronize, are reachable and are up to date, sorted by peer ID.

    Up to date: the sum of its fragment versions is within `max_lag` of `newest_versions` (a synchronizer
    must start from the newest global state, and any peer holding it counts).
    """
    live = [hb for hb in heartbeats if hb.live(now)]
    newest = newest_versions(live, now, verified_newest)
    ok = [hb for hb in live if hb.may_sync and hb.reachable and sum(hb.versions) >= newest - max_lag]
    return sorted(ok, key=lambda hb: hb.peer_id)


def named_successor(
    self_id: str,
    run_id: str,
    heartbeats: Iterable[PeerHeartbeat],
    now: float,
    next_term: int,
    max_lag: int = 0,
    verified_newest: int | None = None,
) -> str:
    """Who a holder names in its lease to claim `next_term` at once if it dies: the eligible peer (not
    itself) ranked first for that term, or "" if there is none. Named in advance, so a holder's crash
    needs no election, and a restarting holder never stands in its successor's way."""
    others = [hb.peer_id for hb in eligible_candidates(heartbeats, now, max_lag, verified_newest)]
    ranking = rendezvous_rank(run_id, next_term, [p for p in others if p != self_id])
    return ranking[0] if ranking else ""


def why_not_eligible(
    self_id: str, heartbeats: Sequence[PeerHeartbeat], now: float, max_lag: int, verified_newest: int | None
) -> str:
    mine = [hb for hb in heartbeats if hb.peer_id == self_id and hb.live(now)]
    if not mine:
        return "no live heartbeat of mine"
    hb = max(mine, key=lambda x: x.expires_at)
    if not hb.may_sync:
        return "may_sync is off"
    if not hb.reachable:
        return "not reachable"
    newest = newest_versions(heartbeats, now, verified_newest)
    return f"versions sum {sum(hb.versions)} lags the newest {newest} by more than {max_lag}"
