"""What goes into a `Peer` (events) and what comes out of it (intents), as plain frozen records.

The peer never performs I/O. Handlers, timers and the training loop post events to its driver; the
peer's handling of each event returns intents, which the driver performs outside the peer's state:
stores DHT records, sends frames, answers requests, passes messages to the training thread, logs.
Work that needs an answer from the network (the swarm's records, an update log, a snapshot's index or
chunks) is a task: a generator that yields a `Request` and is resumed with its result (`TaskResult`), so
catch-up and repair read top to bottom while the peer keeps handling other events.

Inbound requests carry a `Respond` target (any object with `set_result`, e.g. a
`concurrent.futures.Future`); the peer answers through a `Respond` intent, maybe later (an update
whose lease must first be read from the DHT).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch

from p2p_diloco.protocol.decisions import Decision
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.wire.interfaces import StoredValue
from p2p_diloco.wire.replies import Reply

# ---- between the peer and the training thread's learner ------------------------------------------------

Tensors = Mapping[str, torch.Tensor]
Target = tuple[str, int]  # a synchronizer and its term: (holder, term)


@dataclass(frozen=True)
class DeltaWork:
    """The inner work one delta carries: tokens, steps and their compute seconds."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0

    def beyond(self, other: DeltaWork) -> DeltaWork:
        """What this delta carried beyond `other`, whose work it repeated (never negative)."""
        return DeltaWork(
            max(0, self.tokens - other.tokens),
            max(0, self.steps - other.steps),
            max(0.0, self.seconds - other.seconds),
        )


@dataclass(frozen=True)
class MergedMine:
    """This learner's delta that an update merged, as the owner thread's record of it (`swarm.outbox`).

    `theta_at_send`: theta_p when the delta was taken, moved by every global change of p since that merged
    others' deltas. `released`: the delta had gone back to the learner (an old holder merged it after all);
    `repeat` is then the delta in flight that repeated its work, dropped: (its seq, the work it carried
    beyond), or None."""

    seq: int
    work: DeltaWork
    theta_at_send: Tensors
    released: bool = False
    repeat: tuple[int, DeltaWork] | None = None


@dataclass(frozen=True)
class Adopt:
    """The replica applied `record`: Theta_p went from `old_global` to `new_global` (version `version`);
    `mine`: the delta of this learner it merged, if any."""

    record: UpdateRecord
    old_global: Tensors
    new_global: Tensors
    version: int
    mine: MergedMine | None = None


@dataclass(frozen=True)
class Release:
    """The delta of `fragment` with sequence number `seq` will not be merged: its `work` goes back to the
    learner and out again with the next delta of the fragment. `sent_out`: it had left this peer (counted
    as refused); `resend`: send at the next step, not at its turn (a new synchronizer took over, or the
    fragment changed before the delta reached the owner thread)."""

    fragment: int
    seq: int
    work: DeltaWork
    sent_out: bool = True
    resend: bool = False


@dataclass(frozen=True)
class Reload:
    """Fragments were replaced (snapshot, reconciliation): theta_p := Theta_p, drop their in-flight state."""

    fragments: Mapping[int, tuple[int, Tensors]]  # p -> (version, Theta_p)


LearnerMessage = Adopt | Release | Reload


class SendGate:
    """Written by the owner thread, read by the training thread (one attribute, replaced whole)."""

    def __init__(self) -> None:
        self.state: tuple[Target | None, float] = (None, 0.0)  # (synchronizer, held until)

    def open(self, now: float) -> bool:
        target, held_until = self.state
        return target is not None and now >= held_until


class Answer(Protocol):
    """Where the answer to an inbound request goes (a `concurrent.futures.Future` fits)."""

    def set_result(self, result: Any) -> None: ...


class TickKind(StrEnum):
    SWARM = "swarm"  # every heartbeat period: heartbeat, election, repair
    SYNC = "sync"  # at the time the peer's last `SyncDue` named, while it holds a lease: close ready rounds


# ---- events --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    kind: TickKind
    now: float
    heartbeat_fields: Mapping[str, Any] = field(default_factory=dict)  # telemetry the driver announces
    sync_seconds: float = 0.0  # the driver's measured merge + broadcast time


@dataclass(frozen=True)
class DeltaArrived:
    sender: str
    frame: bytes
    answer: Answer
    now: float


@dataclass(frozen=True)
class UpdateArrived:
    sender: str
    frame: bytes
    answer: Answer
    now: float


@dataclass(frozen=True)
class RelayArrived:  # a relay frame (`wire.relay_frames`): an offer of an update, or an update asked for
    sender: str
    frame: bytes
    answer: Answer
    now: float


@dataclass(frozen=True)
class UpdatesRequested:
    requester: str
    fragment: int
    after_version: int
    answer: Answer


@dataclass(frozen=True)
class SnapshotRequested:
    requester: str
    fragment: int
    answer: Answer


@dataclass(frozen=True)
class DeltaReady:
    """The training thread took a due fragment's delta at a step boundary (`Learner.take_due`)."""

    fragment: int
    seq: int
    header: Any  # protocol.messages.DeltaHeader
    delta: Mapping[str, Any]  # name -> fp32 tensor, anchor - theta
    now: float
    work: DeltaWork = DeltaWork()  # the work it carries
    theta_at_send: Tensors = field(default_factory=dict)  # theta_p when taken (a copy: the owner's now)
    settled: int = 0  # the learner's count of messages about this fragment handled when it took the delta


@dataclass(frozen=True)
class DeltaReplied:
    holder: str
    term: int
    fragment: int
    seq: int
    reply: Reply
    now: float


@dataclass(frozen=True)
class TaskResult:
    task: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class CatchUpRequested:
    """Bring the replica to the swarm's versions (start of a peer): replay logs, or download snapshots."""

    now: float
    replay: bool
    answer: Answer | None = None  # gets the stats dict when done


@dataclass(frozen=True)
class Stopping:
    """Shutdown: give up the role, release the lease if held (`answer` gets whether a release was sent)."""

    now: float
    answer: Answer | None = None


Event = (
    Tick
    | DeltaArrived
    | UpdateArrived
    | RelayArrived
    | UpdatesRequested
    | SnapshotRequested
    | DeltaReady
    | DeltaReplied
    | TaskResult
    | CatchUpRequested
    | Stopping
)


# ---- requests a task yields (answered by a TaskResult) ----------------------------------------------


@dataclass(frozen=True)
class ReadSwarm:
    """Read the heartbeat key and every shard's lease key (`Membership.read_swarm`), the sampled heartbeat
    buckets' keys (`sampled`) (`protocol.heartbeat_buckets`) and the run-under-way key when
    `underway` names it; the result is `SwarmRecords`."""

    heartbeats: str
    leases: tuple[str, ...]  # shard 0's first
    underway: str | None = None
    sampled: tuple[str, ...] = ()  # the sampled buckets' keys


@dataclass(frozen=True)
class SwarmRecords:
    heartbeats: Mapping[str, StoredValue]
    leases: Mapping[str, StoredValue]
    now: float
    underway: Mapping[str, StoredValue] = field(default_factory=dict)  # proofs of a run under way
    shard_leases: tuple[Mapping[str, StoredValue], ...] = ()  # the lease records of shards 1..S-1
    # the sampled buckets' heartbeats, by the bucket's key
    sampled: Mapping[str, Mapping[str, StoredValue]] = field(default_factory=dict)

    def leases_of(self, shard: int) -> Mapping[str, StoredValue]:
        """The lease records of synchronizer shard `shard` (`leases` is shard 0's)."""
        if shard == 0:
            return self.leases
        return self.shard_leases[shard - 1] if shard <= len(self.shard_leases) else {}


@dataclass(frozen=True)
class Probe:
    """Is `peer`'s process there (at `addresses`, from its heartbeat)? The result is a `Liveness`."""

    peer: str
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class FetchUpdates:
    source: str
    fragment: int
    after_version: int


@dataclass(frozen=True)
class FetchUpdateLogs:
    """Fetch several update logs at once: `wanted` is ((source, fragment, after_version), ...); the
    result is a list with, per item, that log's frames or the exception its fetch raised."""

    wanted: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class FetchSnapshots:
    """Fetch several fragment snapshots at once: `wanted` is ((fragment, source), ...); the result is a
    list with, per item, the snapshot frame or the exception that fetch raised."""

    wanted: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class FetchChunks:
    """Fetch snapshot chunks at once (`wire.snapshot_chunks`): `wanted` is ((source, fragment, chunk,
    checksum, nbytes), ...); the result is a list with, per item, the chunk's bytes (at most `nbytes`)
    or the exception its fetch raised."""

    wanted: tuple[tuple[str, int, int, str, int], ...]


@dataclass(frozen=True)
class OfferUpdate:  # `offer` (`wire.relay_frames`) to each of `targets`; the result: their `Reply`s in order
    targets: tuple[str, ...]
    offer: bytes


@dataclass(frozen=True)
class Together:
    # run tasks side by side (`swarm.tasks`, no driver); the result: theirs in order, None if failed
    tasks: tuple[Generator[Any, Any, Any], ...]


Fetch = FetchUpdates | FetchUpdateLogs | FetchSnapshots | FetchChunks
Request = OfferUpdate | ReadSwarm | Probe | Fetch | Together
Task = Generator[Request, Any, Any]  # yields requests, resumed with their results (module docstring)


# ---- intents ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreRecord:
    key: str
    subkey: str
    value: bytes
    expiration: float
    what: str = ""  # for logs: "heartbeat", "lease", "released lease"


@dataclass(frozen=True)
class Perform:
    """Perform `request` for task `task` and post its `TaskResult`."""

    task: int
    request: Request


@dataclass(frozen=True)
class SendDelta:
    to: str
    term: int
    fragment: int
    seq: int
    frame: bytes


@dataclass(frozen=True)
class PushUpdate:
    to: str
    frame: bytes


@dataclass(frozen=True)
class RelayUpdate:  # send an update a peer asked for (`wire.relay_frames.encode_relayed`)
    to: str
    frame: bytes


@dataclass(frozen=True)
class Respond:
    answer: Answer
    value: Any


@dataclass(frozen=True)
class ToLearner:
    """A message for the training thread's learner inbox (`swarm.learner`)."""

    message: LearnerMessage


@dataclass(frozen=True)
class Published:
    record: UpdateRecord


@dataclass(frozen=True)
class Applied:
    """An update reached the replica; `how` is a `swarm.updates.UpdateSource` (pushed, replayed, own)."""

    record: UpdateRecord
    source: str
    how: str


@dataclass(frozen=True)
class Note:
    line: str


@dataclass(frozen=True)
class Claimed:
    term: int
    reason: str
    shard: int = 0  # the synchronizer shard whose term this is (`protocol.shards`)


@dataclass(frozen=True)
class DeltaAccepted:
    """Telemetry: this peer, as synchronizer, accepted another peer's delta into a round of `shard`'s
    `term` (the highest term seen there, if it holds none by the time it answers)."""

    shard: int
    term: int


@dataclass(frozen=True)
class LeaseReleased:
    term: int
    rounds: int


@dataclass(frozen=True)
class SyncDue:
    """When this peer next needs a `Tick(SYNC)`: a round's grace window ends, a hold on a fragment lifts
    (`Seat.wake_at`). The driver keeps one timer and moves it here; `at` None: no tick is due until an
    event says otherwise. Sent whenever it changes, and after every sync tick."""

    at: float | None


Intent = (
    StoreRecord
    | Perform
    | SendDelta
    | PushUpdate
    | RelayUpdate
    | Respond
    | ToLearner
    | Published
    | Applied
    | Note
    | Claimed
    | LeaseReleased
    | DeltaAccepted
    | SyncDue
)


# ---- repairs a refused update needs (the peer starts the `Repair` task) -------------------------------


class RepairKind(StrEnum):
    RECONCILE = "reconcile"  # a newer term's update that does not follow my state: maybe a partition's branch
    CATCH_UP = "catch up"  # a gap: replay the missing updates from the pusher
    REFETCH = "refetch"  # my fragment does not hash as the update's base: fetch it again


@dataclass(frozen=True)
class RepairNeeded:
    """What a refused update asks the peer to start (`Peer` runs the `Repair` task for it)."""

    kind: RepairKind
    fragment: int
    sources: tuple[str, ...]
    target: int = 0  # CATCH_UP: the version to reach
    theirs: BranchTip | None = None  # RECONCILE: the pusher's tip
    proof: Decision | None = None  # RECONCILE: `reconcile.fork_proven`, when the checksum proves it
