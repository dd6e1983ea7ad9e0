"""The scenario of an in-process swarm run and its outcome: what `InProcessSwarm` is asked to do
(`SwarmSpec`: learners, speeds, budget, and the faults `Crash`, `Partition`, link rules and hostile
learners, validated on construction) and what it reports (`SwarmReport`, with one `LearnerStats` per
learner). Plain data; the run itself is `swarm.inprocess`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p_diloco.config import ConfigError, RunManifest
from p2p_diloco.swarm.hostile import KINDS
from p2p_diloco.swarm.memory import LinkRule


@dataclass(frozen=True)
class Crash:
    """Learner `learner` dies at fake time `at` and restarts `down` seconds later (never if down < 0).

    `learner = -1` means whoever holds the synchronizer lease at that moment."""

    learner: int
    at: float
    down: float

    @classmethod
    def parse(cls, text: str) -> Crash:
        try:
            who, rest = text.split("@")
            at, down = rest.split(":")
            return cls(-1 if who == "sync" else int(who), float(at), float(down))
        except ValueError as exc:
            raise ConfigError(
                f"--crash {text!r}: expected LEARNER@T:DOWN, e.g. 1@20:15 (or sync@20:15)"
            ) from exc


@dataclass(frozen=True)
class Partition:
    """From fake time `start` to `end` the learners in different `groups` (learner indices) cannot reach
    each other: frames between them are dropped, fetches fail, and each group reads and writes only its
    own side of the key-value store, which merges again at `end` (hivemind's rule, see
    `PartitionedKeyValueStore`). Learners in no group form one more group together."""

    groups: tuple[tuple[int, ...], ...]
    start: float
    end: float


@dataclass(frozen=True)
class Starvation:
    """From fake time `start` to `end` the key-value reads of `learners` return only their own records (a
    starved process whose DHT requests to other nodes time out); their writes still reach everyone."""

    learners: tuple[int, ...]
    start: float
    end: float


@dataclass
class SwarmSpec:
    manifest: RunManifest
    learners: int = 4
    step_times: tuple[float, ...] = ()  # fake seconds per inner step, per learner (default 1.0 each)
    total_tokens: int | None = None
    duration: float | None = None
    crashes: tuple[Crash, ...] = ()
    link_rules: tuple[LinkRule, ...] = ()
    base_delay: float = 0.05
    eval_every: float = 30.0
    eval_batches: int = 8
    seed: int = 0
    partitions: tuple[Partition, ...] = ()
    hostile: dict[int, str] = field(default_factory=dict)  # learner -> swarm.hostile attack; never syncs
    peer_ids: tuple[str, ...] = ()  # the learners' peer IDs (default learner-0, learner-1, ...)
    starved: tuple[Starvation, ...] = ()

    def __post_init__(self) -> None:
        if self.learners < 1:
            raise ConfigError(f"learners must be >= 1, got {self.learners}")
        if self.step_times and len(self.step_times) != self.learners:
            raise ConfigError(f"step_times lists {len(self.step_times)} values for {self.learners} learners")
        if self.peer_ids and len(set(self.peer_ids)) != self.learners:
            raise ConfigError(
                f"peer_ids lists {len(self.peer_ids)} distinct IDs for {self.learners} learners"
            )
        if any(t <= 0 for t in self.step_times):
            raise ConfigError("step_times must be > 0")
        if self.total_tokens is None and self.duration is None:
            raise ConfigError("give total_tokens or duration")
        for part in self.partitions:
            members = [i for g in part.groups for i in g]
            if len(set(members)) != len(members) or not all(0 <= i < self.learners for i in members):
                raise ConfigError(
                    f"partition groups {part.groups}: distinct learners in 0..{self.learners - 1}"
                )
            if not 0 <= part.start < part.end:
                raise ConfigError(f"partition from {part.start} to {part.end}: need 0 <= start < end")
        for s in self.starved:
            if not all(0 <= i < self.learners for i in s.learners) or not 0 <= s.start < s.end:
                raise ConfigError(f"starved reads {s}: learners in 0..{self.learners - 1}, 0 <= start < end")
        for c in self.crashes:
            if not -1 <= c.learner < self.learners:
                raise ConfigError(f"crash of learner {c.learner}: there are {self.learners} learners")
        for i, kind in self.hostile.items():
            if not 0 <= i < self.learners or kind not in KINDS:
                raise ConfigError(
                    f"hostile learner {i}: {kind!r} (attacks: {KINDS}, {self.learners} learners)"
                )

    def step_time(self, i: int) -> float:
        return self.step_times[i] if self.step_times else 1.0

    def peer_id(self, i: int) -> str:
        return self.peer_ids[i] if self.peer_ids else f"learner-{i}"


@dataclass
class LearnerStats:
    peer_id: str
    step_time: float
    steps: int = 0
    tokens: int = 0
    steps_merged: float = 0.0
    deltas_sent: int = 0
    deltas_rejected: int = 0
    crashes: int = 0
    down_seconds: float = 0.0


@dataclass
class SwarmReport:
    fake_seconds: float
    tokens: int
    final_eval_loss: float
    eval_curve: list[tuple[float, int, float]]
    versions: tuple[int, ...]
    version_curve: list[tuple[float, int]]
    digests_equal: bool
    bytes_sent: int
    goodput: float
    terms: list[tuple[float, str, int]]
    crashes: list[tuple[float, int]]
    rejections: dict[str, int]
    learners: list[LearnerStats] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["learners"] = [s.__dict__ for s in self.learners]
        return d
