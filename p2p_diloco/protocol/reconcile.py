"""Reconciling replicas after a partition: which branch of a fragment wins, and what a replica must do.

During a partition both sides may elect a synchronizer and publish updates (availability first), so one
fragment can grow two histories. Every replica tracks, per fragment, its **branch tip**
`BranchTip(term, version, checksum)`: the term of the outer update that produced its current version of
the fragment (0 for the initial state), that version, and the first `TIP_CHECKSUM_CHARS` hex characters
of the fragment checksum (which covers Θ, m and the version, see `protocol.replica`). Heartbeats publish
every tip. Per fragment, independently:

1. **Winner**: among the live tips (the replica's own included), the one that carries the most history
   (`winning_tip`, `outranks`): the higher version wins, ties go to the higher term, then to the larger
   checksum string. Every update adds exactly one version to its fragment, so two branches that share an
   ancestor at version a carry v1 - a and v2 - a updates since it: the higher version is the branch with
   more updates since the common ancestor, whatever that ancestor is. The term only breaks ties: a side
   that merely elected more often (a partition's minority, an island whose holders kept failing) does not
   win by that. Which tips take part is the caller's business (`swarm.vouching`): only states vouched for
   by checked update records or by two peers that may synchronize, so an island's unchecked versions
   never count.
2. **What a replica does** (`classify(mine, winner)`):
   - `in_sync` ("same state"): same version and checksum (only the recorded term differs, e.g. after a
     snapshot whose term was a lower bound; the caller raises its term to the winner's);
   - `keep` ("winning branch"): my tip ranks at or above the winner (I am on the winning branch's tip);
   - `catch_up` ("behind"): my version is lower and my term is not higher, so my state may lie on the
     winner's history: replay the winner's updates from my version, each checked against the checksum it
     carries. A replayed update whose result does not match proves a fork (`fork_proven`), which turns
     into `reconcile`;
   - `reconcile` ("diverged"): anything else: the same version with another checksum and a lower rank,
     or a lower version with a higher term. Terms never decrease along one history (replicas ignore
     updates of a term below the highest they have seen), so such a state cannot be on the winner's
     history. The replica fetches the fragment's snapshot from a peer on the winning branch, loads it
     even if it is older than its own (`GlobalReplica.load_fragment(force=True)`), logs a `reconciled`
     line with both tips and why the winner won (`Outranked`), and its learner reloads the fragment. The
     losing branch's updates are dropped, and with them the learners' local progress that went only into
     them.

Pure: no clock, no I/O. Actions are module constants, tags a `ReconcileTag`, why a tip beats another an
`Outranked`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import total_ordering
from operator import attrgetter

from p2p_diloco.protocol.decisions import Action, Decision

TIP_CHECKSUM_CHARS = 16  # hex characters of the fragment checksum carried in a tip (64 bits)

# classify(): actions
IN_SYNC, KEEP, CATCH_UP, RECONCILE = Action.IN_SYNC, Action.KEEP, Action.CATCH_UP, Action.RECONCILE


class ReconcileTag(StrEnum):
    """Why `classify` / `fork_proven` decided what they did."""

    SAME_STATE = "same state"  # in_sync
    WINNING = "winning branch"  # keep
    BEHIND = "behind"  # catch_up: maybe an ancestor of the winner; replay verifies it
    DIVERGED = "diverged"  # reconcile: cannot be on the winner's history
    FORK_PROVEN = "fork proven"  # reconcile: a replayed update of the winner did not match my state


class Outranked(StrEnum):
    """Why one tip beats another (`outranks`): the first of version, term, checksum that differs."""

    MORE_UPDATES = "more updates since the common ancestor"  # the higher version
    HIGHER_TERM = "as many updates, a higher term"  # same version, other state: the later election
    LARGER_CHECKSUM = "as many updates in the same term, the larger checksum"  # two holders of one term
    SAME_STATE = "the same state"  # not outranked: equal version and checksum


# The event-log line a peer writes when it replaced a fragment by the winning branch's snapshot.
LOG_RECONCILED = "reconciled"


@total_ordering
@dataclass(frozen=True)
class BranchTip:
    """One replica's state of one fragment: the term of the update that produced it, version, checksum.

    Ordering is the winner order (`rank`): version, then term, then checksum."""

    term: int
    version: int
    checksum: str

    def __post_init__(self) -> None:
        if self.term < 0 or self.version < 0:
            raise ValueError(f"tip term and version must be >= 0, got term {self.term} v{self.version}")
        object.__setattr__(self, "checksum", self.checksum[:TIP_CHECKSUM_CHARS])

    @property
    def rank(self) -> tuple[int, int, str]:
        """The winner order: the most updates first, the term and checksum only break ties."""
        return (self.version, self.term, self.checksum)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, BranchTip):
            return NotImplemented
        return self.rank < other.rank

    @property
    def state(self) -> tuple[int, str]:
        """What two replicas on the same state share: version and checksum (the term may differ)."""
        return self.version, self.checksum

    def same_state(self, other: BranchTip) -> bool:
        return self.state == other.state

    def __str__(self) -> str:
        return f"t{self.term} v{self.version} {self.checksum}"


def winning_tip(tips: Iterable[BranchTip]) -> BranchTip:
    """The tip carrying the most history: the highest by (version, term, checksum). Raises ValueError on
    no tips."""
    tips = list(tips)
    if not tips:
        raise ValueError("winning_tip needs at least one tip")
    return max(tips, key=_RANK)  # `BranchTip.rank`, read in C: every read ranks each fragment's tips


_RANK = attrgetter("version", "term", "checksum")


def outranked_by_none(mine: BranchTip, tips: Iterable[BranchTip]) -> bool:
    """Whether no tip of `tips` ranks above `mine`: then `mine` wins among them, and `classify` says in
    sync or keep against any subset (the common case of a read, ranked in C: issue #40)."""
    best = max(tips, key=_RANK, default=None)
    return best is None or _RANK(best) <= _RANK(mine)


def outranks(winner: BranchTip, loser: BranchTip) -> Outranked:
    """Why `winner` ranks above `loser` (or `SAME_STATE`). Raises ValueError if `loser` ranks higher."""
    if winner.same_state(loser):
        return Outranked.SAME_STATE
    if winner < loser:
        raise ValueError(f"{winner} does not outrank {loser}")
    if winner.version != loser.version:
        return Outranked.MORE_UPDATES
    return Outranked.HIGHER_TERM if winner.term != loser.term else Outranked.LARGER_CHECKSUM


def action_of(mine: BranchTip, winner: BranchTip) -> Action:
    """`classify`'s action without its reason (every read asks it of each fragment; the reason, two tips
    written out, only matters for the ones it acts on)."""
    if mine.same_state(winner):
        return IN_SYNC
    if mine >= winner:
        return KEEP
    return CATCH_UP if mine.version < winner.version and mine.term <= winner.term else RECONCILE


def classify(mine: BranchTip, winner: BranchTip) -> Decision:
    """What a replica with tip `mine` does about a fragment whose winning tip is `winner` (rules above)."""
    if mine.same_state(winner):
        return Decision(IN_SYNC, ReconcileTag.SAME_STATE, f"{mine} matches the winner {winner}")
    if mine >= winner:
        return Decision(KEEP, ReconcileTag.WINNING, f"{mine} ranks at or above {winner}")
    if mine.version < winner.version and mine.term <= winner.term:
        return Decision(
            CATCH_UP,
            ReconcileTag.BEHIND,
            f"{mine} is {winner.version - mine.version} versions behind {winner}; "
            "replay and verify each checksum",
        )
    if mine.version == winner.version:
        why = "same version, different state"
    else:
        why = f"my term {mine.term} > {winner.term}: my state is not on the winner's history"
    return Decision(
        RECONCILE, ReconcileTag.DIVERGED, f"{mine} lost to {winner} ({outranks(winner, mine)}; {why})"
    )


def fork_proven(mine: BranchTip, winner: BranchTip, *, update_term: int, from_version: int) -> Decision:
    """A replayed update of the winner's history (term `update_term`, from `from_version` = my version)
    did not reproduce its checksum on my state: my state is not on that history, so reconcile (the caller
    made sure `winner` outranks `mine`)."""
    return Decision(
        RECONCILE,
        ReconcileTag.FORK_PROVEN,
        f"{mine} lost to {winner} (the term {update_term} update from v{from_version} "
        "does not match my state)",
    )


def reconciled_line(fragment: int, old: BranchTip, new: BranchTip, source: str, why: str) -> str:
    """The event-log line for a fragment replaced by the winning branch (starts with `LOG_RECONCILED`)."""
    return (
        f"{LOG_RECONCILED}: fragment {fragment} {old} -> {new} from {source} ({why}); "
        "the losing branch's updates and local progress on this fragment are dropped"
    )
