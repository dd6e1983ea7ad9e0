"""The demo's seeded failure schedule: which learner dies when, for how long, and which one is slow.

Pure: `chaos_schedule` turns (learners, duration, seed) into a `Schedule`; the orchestrator executes it.
A ``kill_sync`` entry means "SIGKILL whoever holds the synchronizer role at that moment"; `fallback` is
the learner a system without a synchronizer (the lock-step baseline) loses instead, so both systems
lose a learner at the same times.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

KILL_SYNC = "kill_sync"
KILL_LEARNER = "kill_learner"


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the swarm is up
    action: str  # KILL_SYNC or KILL_LEARNER
    learner: int  # the victim for KILL_LEARNER; the fallback victim for KILL_SYNC
    down: float  # seconds until the victim is restarted (same identity and state dir)


@dataclass(frozen=True)
class Schedule:
    seed: int
    duration: float
    faults: tuple[Fault, ...] = ()
    slow_learner: int | None = None
    slow_step_time: float = 0.0  # --min-step-time of the slow learner
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def chaos_schedule(
    learners: int,
    duration: float,
    seed: int,
    *,
    slow_step_time: float = 0.5,
    down: tuple[float, float] = (3, 8),
) -> Schedule:
    """The synchronizer dies at ~20 % and ~60 % of the run, a random learner at ~40 %; each victim
    comes back after `down` seconds (uniform); the last learner is throttled to `slow_step_time`."""
    if learners < 2:
        raise ValueError("chaos needs at least 2 learners")
    rng = random.Random(seed)

    def when(fraction: float) -> float:
        return round(duration * (fraction + rng.uniform(-0.04, 0.04)), 1)

    def downtime() -> float:
        return round(rng.uniform(*down), 1)

    faults = (
        Fault(when(0.2), KILL_SYNC, rng.randrange(learners), downtime()),
        Fault(when(0.4), KILL_LEARNER, rng.randrange(learners), downtime()),
        Fault(when(0.6), KILL_SYNC, rng.randrange(learners), downtime()),
    )
    return Schedule(
        seed=seed,
        duration=duration,
        faults=faults,
        slow_learner=learners - 1,
        slow_step_time=slow_step_time,
    )


def calm_schedule(duration: float, seed: int) -> Schedule:
    return Schedule(seed=seed, duration=duration)
