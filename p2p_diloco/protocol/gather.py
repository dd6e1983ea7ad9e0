"""The gather set of a sparse (union) round: which of the round's deltas its update lists, at most
`[diloco] gather` per fragment, in one documented order; pure, no I/O.

Every replica downloads and merges each delta a union round lists, so the list is what bounds a round's
down bytes whatever the swarm's size (Covenant-72B gathers about 20 contributions a round). The holder
closes a round as it always did (quorum, grace window), screens it (`Synchronizer._screen_round`: cooling
senders, the round's direction screen, the loss check), and only then, among the deltas that passed, lists
the first `gather` in this order:

0. a key whose loss score is not negative before any whose is (`protocol.loss_score`: a negative score means
   the key's checked deltas on balance made the loss worse), so such a key is gathered only into places no
   other delta of the round wants; every key scores 0 until the holder's loss checks score it, and where the
   loss check is off (private runs) nobody is scored and this step changes nothing;
1. the learner that has waited longest for this fragment: the earlier `Standing.waiting_since` (when an
   update of the fragment that this peer applied last merged its delta; else when it was first heard of).
   Applied, signed records set this clock, and no claim in a delta moves it, so the gather set rotates
   through the learners: one left out now has waited longer than those listed with it and comes first in
   a later round, and a new key queues behind learners waiting longer rather than ahead of them;
2. on an equal wait (learners merged by the same update), the greater merge weight the dense path would
   give the delta: its tokens (as the counter checks weighed them) times the sender's standing ramp
   (`Standing.ramp`: a new key's weight grows over its first merged rounds) times its score's cap
   (`loss_score.score_factor`);
3. then the smaller `tie_rank`, a BLAKE2b digest of (fragment, version, learner), so ties rotate from
   round to round and no key name wins every tie; then (learner, seq), so the order is total.

What is left out is refused with `GatherTag.NOT_GATHERED` (not an offence: no cool-down) and named in the
update record (`UpdateRecord.left_out`), so its learner releases the delta and sends the work again with
its next delta of that fragment. A round of at most `gather` deltas lists them all, as before. (The
holder's outer scaling then counts min(live learners, `gather`): a round listing `gather` deltas is a full
round; `swarm.synchronizer`.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from p2p_diloco.protocol.loss_score import score_factor


class GatherTag(StrEnum):
    """Why a screened delta of a sparse round is not in its update."""

    NOT_GATHERED = "not gathered"  # the round listed `gather` deltas that rank ahead of it


class Gatherable(Protocol):
    """What the order reads of a round's delta (`protocol.sync_round.Contribution` has it)."""

    @property
    def sender(self) -> str: ...

    @property
    def seq(self) -> int: ...

    @property
    def tokens(self) -> int: ...


T = TypeVar("T", bound=Gatherable)


def tie_rank(fragment: int, version: int, learner: str) -> bytes:
    """The tie-break of equal weights in round (`fragment`, `version`): a digest no key name can fix for
    every round."""
    return hashlib.blake2b(f"{fragment}/{version}/{learner}".encode(), digest_size=16).digest()


@dataclass(frozen=True)
class GatherSet(Generic[T]):
    """A round's deltas split into those its update lists (`listed`, in gather order) and the rest."""

    listed: tuple[T, ...]
    left_out: tuple[T, ...]


def _unscored(peer: str) -> float:
    return 0.0


def gather_order(
    deltas: Sequence[T],
    *,
    waiting_since: Callable[[str], float],
    ramp: Callable[[str], float],
    fragment: int,
    version: int,
    score: Callable[[str], float] = _unscored,
) -> list[T]:
    """`deltas` in gather order (see the module docstring); `score`: each key's loss score
    (`LossScores.score`)."""

    def key(d: T) -> tuple[bool, float, float, bytes, str, int]:
        s, who = score(d.sender), d.sender
        weight = ramp(who) * d.tokens * score_factor(s)
        return (s < 0, waiting_since(who), -weight, tie_rank(fragment, version, who), who, d.seq)

    return sorted(deltas, key=key)


def choose(
    deltas: Sequence[T],
    gather: int,
    *,
    waiting_since: Callable[[str], float],
    ramp: Callable[[str], float],
    fragment: int,
    version: int,
    score: Callable[[str], float] = _unscored,
) -> GatherSet[T]:
    """The first `gather` of `deltas` in gather order are listed, the rest left out; ValueError if `gather`
    is below 1."""
    if gather < 1:
        raise ValueError(f"gather must be >= 1, got {gather}")
    ordered = gather_order(
        deltas, waiting_since=waiting_since, ramp=ramp, fragment=fragment, version=version, score=score
    )
    return GatherSet(tuple(ordered[:gather]), tuple(ordered[gather:]))
