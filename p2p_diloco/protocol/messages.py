"""Protocol message records (pure data). Their byte encoding lives in `p2p_diloco.wire.frames`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class UpdateTag(StrEnum):
    """Why an update record (pushed, replayed or the holder's own) or a snapshot was refused."""

    NOT_SYNCHRONIZER = "not synchronizer"  # a delta sent to a peer that holds no lease
    NOT_THE_LEADER = "not the leader"  # the pusher is not the leader the update names
    BAD_SIGNATURE = "bad signature"  # an update not signed by the leader it names
    NO_LEASE = "no lease"  # its leader never held a valid lease of its term
    LEASE_NOT_LIVE = "lease not live"  # a pushed update whose leader's lease was not live when it arrived
    WRONG_CODEC = "wrong codec"
    NOT_FINITE = "not finite"
    TOO_LARGE = "update too large"
    UNKNOWN_CONTRIBUTOR = "unknown contributor"
    IMPLAUSIBLE_WEIGHT = "implausible weight"
    SKIPPED = "skipped"  # a replayed record that does not extend this replica: not applied, not an offence
    UNVOUCHED_SNAPSHOT = (
        "unvouched snapshot"  # no checked update, and no two peers that may sync, vouch for it
    )
    # a union round whose listed deltas merge here, on this replica's state at its base version, to another
    # result than its checksum claims: a forged merge (or this replica is on another branch); its leader
    # vouches for nothing afterwards (`swarm.vouching.Vouchers.catch`)
    MERGE_MISMATCH = "merge mismatch"


@dataclass(frozen=True)
class DeltaHeader:
    """Header of one learner's outer delta for one fragment.

    `anchor_version` is the global version of the fragment the learner last adopted; `tokens` and
    `steps` count what it trained since that adoption; `seq` increases with every delta the sender sends.
    `sender` is filled in by the receiver from the authenticated connection, never trusted from the wire.
    """

    run_id: str
    manifest_hash: str
    fragment: int
    anchor_version: int
    tokens: int
    steps: int
    seq: int
    sender: str = ""
    # the oldest of the sender's deltas of this fragment whose work this one carries: deltas that went back
    # to the learner (a term change) are folded into its next one; 0 means just `seq`
    since_seq: int = 0
    # sparse codecs: the sender's signature over `wire.delta_signature.delta_signing_bytes` of this delta
    # (empty for dense codecs, whose frames stay as they were)
    signature: bytes = b""

    @property
    def carries_since(self) -> int:
        return self.since_seq or self.seq


@dataclass(frozen=True)
class ListedDelta:
    """One learner-signed delta as the update record of a sparse round lists it (`wire.delta_listing`)."""

    learner: str
    seq: int
    digest: bytes  # BLAKE2b-256 of the delta's `wire.codecs.codec` frame
    weight: int  # what the merge weighs it by: at most the tokens the learner signed (`Standing.earned`)


@dataclass(frozen=True)
class UpdateRecord:
    """One outer update of one fragment, version `from_version` -> `from_version + 1`.

    `payload` is the merged outer gradient as a `wire.codecs.codec` frame (the manifest's codec: int8 by
    default, or sparse top-k); every replica decodes it, applies the Nesterov step itself and compares the
    result with `checksum`.
    """

    run_id: str
    manifest_hash: str
    fragment: int
    from_version: int
    term: int
    leader: str
    contributors: tuple[tuple[str, float], ...]
    checksum: str
    payload: bytes
    signature: bytes = b""  # the leader's, over `wire.frames.update_signing_bytes` (`wire.signing`)
    seqs: tuple[int, ...] = ()  # the `DeltaHeader.seq` each contributor's merged delta had (or none)
    # sparse rounds (union aggregation): the signed deltas merged, and the live learners the outer scaling
    # counted; `payload` is then the bundle of those delta frames (`wire.delta_bundle`), not a merged gradient
    deltas: tuple[ListedDelta, ...] = ()
    live: int = 0
    # sparse rounds: (learner, seq) of the screened deltas the round did not list, past its `[diloco] gather`
    # (`protocol.gather`); each such learner takes back its delta and sends the work again
    left_out: tuple[tuple[str, int], ...] = ()

    def seq_of(self, peer: str) -> int | None:
        """The seq of `peer`'s delta this update merged (None: not a contributor, or seqs not recorded)."""
        if len(self.seqs) != len(self.contributors):
            return None
        return next((seq for (who, _), seq in zip(self.contributors, self.seqs) if who == peer), None)

    def merged_delta(self, peer: str, seq: int) -> bool:
        """Whether this update merged `peer`'s delta `seq` (any delta of `peer`, when seqs are not recorded):
        the one "is this my delta" rule, applied where deltas in flight are recorded (`Outbox.on_applied`)."""
        return any(who == peer for who, _ in self.contributors) and self.seq_of(peer) in (None, seq)

    def left_out_seq(self, peer: str) -> int | None:
        """The seq of `peer`'s delta this sparse round screened but did not list (None: none)."""
        return next((seq for who, seq in self.left_out if who == peer), None)

    @property
    def to_version(self) -> int:
        return self.from_version + 1

    @property
    def contributor_ids(self) -> tuple[str, ...]:
        """The peers whose deltas this update merged."""
        return tuple(who for who, _ in self.contributors)
