"""Synchronizer shards: which shard merges which fragment, and how shards spread over the candidates.

With ``[diloco] synchronizer_shards = S`` the fragments are split over S shards by `shard_of` (fragment
modulo S: every shard gets P/S fragments, give or take one). Each shard is its own election: its own lease
key (`wire.keys.lease_key(..., shard)`), terms, fencing, successor, handover and rotation; a crash of one
holder stalls only its shards' fragments. Shard 0 of any run, and the only shard when S = 1, ranks
candidates exactly as the unsharded election always did (salt = run ID); shard k > 0 ranks them by a hash
salted with k (`shard_salt`), so the shards' first-ranked candidates differ. A candidate that already
holds `holder_cap` shards (ceil(S / candidates)) steps aside for the others (`at_cap`), so no peer holds
more than its share while enough candidates are up.

Pure functions: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

from p2p_diloco.protocol.candidates import rendezvous_rank


def shard_of(fragment: int, shards: int) -> int:
    """The shard that merges `fragment` (0 when S = 1)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if fragment < 0:
        raise ValueError(f"fragment must be >= 0, got {fragment}")
    return fragment % shards


def fragments_of(shard: int, shards: int, num_fragments: int) -> tuple[int, ...]:
    """The fragments `shard` merges, ascending."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} not in [0, {shards})")
    return tuple(range(shard, num_fragments, shards))


def shard_salt(run_id: str, shard: int) -> str:
    """The rendezvous salt of `shard`'s elections: the run ID itself for shard 0 (today's ranking), the run
    ID with the shard number for the others (a hash of (shard, candidate) per term)."""
    return run_id if shard == 0 else f"{run_id}/shard{shard}"


def holder_cap(shards: int, candidates: int) -> int:
    """The most shards one peer should hold while `candidates` eligible peers are up: ceil(S / candidates)."""
    return math.ceil(shards / max(1, candidates))


def at_cap(holdings: Mapping[str, int], cap: int) -> frozenset[str]:
    """Peers that hold `cap` shards or more (`holdings`: peer -> shards it holds live leases of, the shard
    being elected left out): they step aside in that shard's claim ranking while others can claim."""
    return frozenset(peer for peer, held in holdings.items() if held >= cap)


def holdings(holders: Iterable[str | None]) -> dict[str, int]:
    """peer -> how many of the given shards' live holders it is (None: a shard with no live holder)."""
    counts: dict[str, int] = {}
    for holder in holders:
        if holder is not None:
            counts[holder] = counts.get(holder, 0) + 1
    return counts


def spread(run_id: str, term: int, shards: int, candidates: Collection[str]) -> dict[int, str]:
    """Who would claim each shard's `term` if every shard were elected at once, shard 0 first: each takes
    its first-ranked candidate not yet at the cap (`at_cap`). Elections run shard by shard in this order
    on every peer; this is the assignment they converge to when every candidate reads the same swarm."""
    cap = holder_cap(shards, len(candidates))
    chosen: dict[int, str] = {}
    for shard in range(shards):
        busy = at_cap(holdings(chosen.values()), cap)
        free = [c for c in candidates if c not in busy] or list(candidates)
        ranking = rendezvous_rank(shard_salt(run_id, shard), term, free)
        if ranking:
            chosen[shard] = ranking[0]
    return chosen
