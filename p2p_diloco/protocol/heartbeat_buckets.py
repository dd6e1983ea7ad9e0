"""Which heartbeats a peer reads each heartbeat period: heartbeat buckets, candidates and the rotating sample
(issue #40: per-peer work per period must not grow with the swarm's size M).

Below `BUCKETED_FROM_SHARDS` synchronizer shards (at the documented sizing S = M / 16, up to about 256
peers) every heartbeat lives under one DHT key and every peer reads them all, as it always did: at most a
few hundred records a period, under the DHT reads' cap of 512 per key (`net.admission`). From
`BUCKETED_FROM_SHARDS` shards on, heartbeats are split over B = S buckets (`wire.keys.heartbeat_key(...,
bucket)`):

* bucket 0 holds the heartbeats of the *candidates*, the peers that may claim a shard's lease: the listed
  synchronizers where the manifest lists any (or an allowlist bounds the run), else, in a run open to
  anyone, the peers whose ID hashes to bucket 0 (about M / B = 16 peers at the sizing) and those that
  volunteered because bucket 0 held fewer than `MIN_OPEN_CANDIDATES` others once they had read the swarm
  for a heartbeat period (a small swarm under a large S; every reader counts whoever bucket 0 holds);
* every other peer's heartbeat lives in bucket 1 + a hash of its ID modulo B - 1.

Each period a peer reads bucket 0 (every candidate: the elections, the lease rules and the trusted tips of
peers that may witness need them all, every period) and one other bucket, `sample_buckets`, rotating with
a read counter from an offset seeded by its own ID, so runs replay by seed and every bucket is read once
every B - 1 reads; its first `SWEEP_READS` reads (joining) take every bucket, once. What it reads per period
is thus about 2 x 16 heartbeats whatever M, plus the S lease keys of its seats. A peer that is not a
candidate never claims (its election ranks no record of its own).

Pure functions: no clock, no I/O.
"""

from __future__ import annotations

import hashlib

BUCKETED_FROM_SHARDS = 16  # fewer shards: one heartbeat key, every heartbeat read every period
MIN_OPEN_CANDIDATES = 4  # an open run's bucket 0 with fewer others: a peer volunteers as a candidate
# A peer's first reads take every bucket (about M heartbeats, once): a peer that knew only the buckets it had
# sampled so far, one a period, left most of the swarm out of its relay trees for B - 1 periods, and those
# peers caught up by replaying update logs instead (issue #40: replays were most of the bytes at 256 peers).
SWEEP_READS = 3


def buckets_for(shards: int) -> int:
    """How many heartbeat buckets a run with `shards` synchronizer shards uses (1: one key, read whole)."""
    return shards if shards >= BUCKETED_FROM_SHARDS else 1


def _hash(peer: str) -> int:
    return int.from_bytes(hashlib.blake2b(peer.encode(), digest_size=8, person=b"hb-bucket").digest(), "big")


def open_candidate(peer: str, buckets: int) -> bool:
    """In a run that lists no synchronizers, whether `peer` is a candidate: its ID hashes to bucket 0 (every
    peer when there is one bucket)."""
    return buckets <= 1 or _hash(peer) % buckets == 0


def bucket_of(peer: str, buckets: int, *, candidate: bool) -> int:
    """The bucket `peer`'s heartbeat is written to: 0 for a candidate (or with one bucket), else 1 + its
    hash modulo B - 1."""
    if buckets <= 1 or candidate:
        return 0
    return 1 + (_hash(peer) // buckets) % (buckets - 1)


def sample_buckets(peer: str, reads: int, buckets: int) -> tuple[int, ...]:
    """The non-candidate buckets `peer` reads at its `reads`-th read (none with one bucket): its first
    `SWEEP_READS` reads take every bucket, then consecutive reads walk buckets 1 .. B - 1 in turn, one a
    read, from an offset seeded by `peer`'s ID."""
    if buckets <= 1:
        return ()
    if reads < SWEEP_READS:
        return tuple(range(1, buckets))
    return (1 + (_hash(peer) + reads) % (buckets - 1),)
