"""The demo's seeded failure schedules: which learner dies when, for how long, and which one is slow.

Pure: `chaos_schedule` (``--chaos``: three faults) and `long_chaos_schedule` (``--chaos-every S``: a
fault every S seconds for the whole run) turn (learners, duration, seed) into a `Schedule`; the
orchestrator executes it. A ``kill_sync`` entry means "SIGKILL whoever holds the synchronizer role at
that moment"; its `learner` is the fallback a system without a synchronizer (the lock-step baseline)
loses instead, so both systems lose a learner at the same times. ``stop_learner`` SIGSTOPs a learner
(its whole process group) for `down` seconds, then SIGCONTs it; ``kill_bootstrap`` SIGKILLs the
bootstrap node and restarts it after `down` seconds on the same address and identity.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

KILL_SYNC = "kill_sync"
KILL_LEARNER = "kill_learner"
STOP_LEARNER = "stop_learner"
KILL_BOOTSTRAP = "kill_bootstrap"
LONG_KINDS = (KILL_SYNC, KILL_LEARNER, STOP_LEARNER, KILL_BOOTSTRAP)
DOWN_SECONDS = {  # (low, high) of the uniform down time per kind, for --chaos-every
    KILL_SYNC: (3.0, 8.0),
    KILL_LEARNER: (3.0, 8.0),
    STOP_LEARNER: (10.0, 20.0),
    KILL_BOOTSTRAP: (2.0, 5.0),
}


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the swarm is up
    action: str  # one of LONG_KINDS (--chaos uses KILL_SYNC and KILL_LEARNER only)
    learner: int  # the victim for KILL_LEARNER/STOP_LEARNER; the fallback victim for KILL_SYNC
    down: float  # seconds until the victim is restarted (same identity and state dir) or continued


@dataclass(frozen=True)
class Schedule:
    seed: int
    duration: float
    faults: tuple[Fault, ...] = ()
    slow_learner: int | None = None
    slow_step_time: float = 0.0  # --min-step-time of the slow learner
    extra: dict = field(default_factory=dict)
    every: float = 0.0  # --chaos-every: seconds between faults (0: a one-shot schedule)

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


def long_chaos_schedule(
    learners: int,
    duration: float,
    seed: int,
    every: float,
    *,
    slow_step_time: float = 0.5,
    margin: float = 2.0,
) -> Schedule:
    """A fault about every `every` seconds (jittered by up to 15 %) until `margin` seconds before the
    end. Kinds come in blocks of four, each block a seeded shuffle of `LONG_KINDS`, so any four
    consecutive faults cover every kind; victims and down times (`DOWN_SECONDS`) are seeded draws. The
    last learner is throttled to `slow_step_time`, as with `chaos_schedule`."""
    if learners < 2:
        raise ValueError("chaos needs at least 2 learners")
    if every <= 0:
        raise ValueError(f"--chaos-every must be > 0 seconds, got {every}")
    rng = random.Random(seed)
    faults: list[Fault] = []
    block: list[str] = []
    k = 1
    while (at := round(every * k + rng.uniform(-0.15, 0.15) * every, 1)) <= duration - margin:
        if not block:
            block = list(LONG_KINDS)
            rng.shuffle(block)
        kind = block.pop(0)
        low, high = DOWN_SECONDS[kind]
        faults.append(Fault(max(at, 0.1), kind, rng.randrange(learners), round(rng.uniform(low, high), 1)))
        k += 1
    return Schedule(
        seed=seed,
        duration=duration,
        faults=tuple(faults),
        slow_learner=learners - 1,
        slow_step_time=slow_step_time,
        every=every,
    )


def calm_schedule(duration: float, seed: int) -> Schedule:
    return Schedule(seed=seed, duration=duration)
