"""Discrete-event simulation of one training job under chip failures: restart-only DP and elastic DP.

Events happen only at failures, repairs, join deadlines and the ends of pauses; between them a job
computes at full speed on its active chips. Each function returns a `JobRun`: useful chip-seconds
(work that survives), seconds spent computing, failure counts and, when asked, the job's compute
intervals (the Decoupled DiLoCo simulation turns those into fragment deltas).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from p2p_diloco.sim.failure_model import FailureModel


@dataclass(frozen=True)
class ComputeInterval:
    """The job computed on `chips` chips from `start` to `end`; `lost` chip-seconds of it were thrown away."""

    start: float
    end: float
    chips: int
    lost: float = 0.0


@dataclass
class JobRun:
    """What one simulated job did over `horizon` seconds on `chips` chips."""

    chips: int
    horizon: float
    useful_chip_seconds: float = 0.0
    compute_seconds: float = 0.0
    failures: int = 0
    disruptive_failures: int = 0
    reconfigurations: int = 0
    intervals: list[ComputeInterval] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.useful_chip_seconds / (self.chips * self.horizon)

    @property
    def uptime(self) -> float:
        return self.compute_seconds / self.horizon


def simulate_restart_job(chips: int, horizon: float, model: FailureModel, rng: random.Random) -> JobRun:
    """Data-parallel without elasticity: every failure stops the job for a restart from the last checkpoint.

    Failures during a restart are handled by it (no extra delay). Progress since the last checkpoint
    (taken every `checkpoint_seconds` of progress since the restart; 0: nothing is lost) is lost.
    """
    run = JobRun(chips=chips, horizon=horizon)
    rate = chips * model.chip_failure_rate
    ckpt = model.checkpoint_seconds
    compute_start = 0.0
    t = rng.expovariate(rate)
    while t < horizon:
        run.failures += 1
        if t >= compute_start:  # computing: this failure stops the job
            run.disruptive_failures += 1
            progress = t - compute_start
            lost = progress % ckpt if ckpt > 0 else 0.0
            run.compute_seconds += progress
            run.useful_chip_seconds += chips * (progress - lost)
            compute_start = t + model.restart_seconds
        t += rng.expovariate(rate)
    if compute_start < horizon:  # the tail: checkpointed at the end of the run
        run.compute_seconds += horizon - compute_start
        run.useful_chip_seconds += chips * (horizon - compute_start)
    return run


_FAIL, _REPAIRED, _JOIN_DEADLINE = 0, 1, 2


def simulate_elastic_job(
    chips: int, horizon: float, model: FailureModel, rng: random.Random, *, record: bool = False
) -> JobRun:
    """Elastic data-parallel: a failure pauses the job to drop the failed slice, which rejoins after repair.

    Rules (see `FailureModel` for the constants):
    - a failure of a chip in an active slice while computing loses the in-flight step and starts a
      shrink reconfiguration (`shrink_seconds`); a failure during a reconfiguration is absorbed by it;
      a failure of a chip whose slice is already out changes nothing;
    - the slice is repaired `repair_seconds` later and then waits; every waiting slice joins at the
      start of the next reconfiguration, and a slice still waiting `join_wait_seconds` after its repair
      triggers a grow reconfiguration (`grow_seconds`), or joins at the end of a running one.
    With `record`, the returned run lists its compute intervals.
    """
    run = JobRun(chips=chips, horizon=horizon)
    rate = chips * model.chip_failure_rate
    size = model.slice_chips
    out: set[int] = set()  # slices not in the job: failed, in repair, waiting or joining
    waiting: dict[int, float] = {}  # repaired slice -> its join deadline
    joining: list[int] = []  # admitted by the running reconfiguration, active at its end
    out_chips = 0
    compute_start = 0.0  # the job computes from here on; a reconfiguration moves it to its end
    events: list[tuple[float, int, int]] = [(rng.expovariate(rate), _FAIL, -1)]

    def slice_size(s: int) -> int:
        return min(size, chips - s * size)

    def end_compute(t: float, lost_seconds: float) -> None:
        active = chips - out_chips
        span = t - compute_start
        if active <= 0 or span <= 0:
            return
        lost = min(span, lost_seconds)
        run.compute_seconds += span
        run.useful_chip_seconds += active * (span - lost)
        if record:
            run.intervals.append(ComputeInterval(compute_start, t, active, active * lost))

    def admit_joining(t: float) -> None:
        nonlocal out_chips, joining
        if joining and compute_start <= t:
            for s in joining:
                out.discard(s)
                out_chips -= slice_size(s)
            joining = []

    def reconfigure(t: float, pause: float) -> None:
        nonlocal compute_start, joining
        run.reconfigurations += 1
        joining = sorted(waiting)
        waiting.clear()
        compute_start = t + pause

    while events:
        t, kind, s = heapq.heappop(events)
        if t >= horizon:
            break
        admit_joining(t)
        computing = t >= compute_start
        if kind == _FAIL:
            run.failures += 1
            heapq.heappush(events, (t + rng.expovariate(rate), _FAIL, -1))
            failed = int(rng.random() * chips) // size
            if failed in out:
                continue
            run.disruptive_failures += 1
            out.add(failed)
            heapq.heappush(events, (t + model.repair_seconds, _REPAIRED, failed))
            if computing:
                end_compute(t, (t - compute_start) % model.step_seconds)
                reconfigure(t, model.shrink_seconds)
            out_chips += slice_size(failed)
        elif kind == _REPAIRED:
            deadline = t + model.join_wait_seconds
            waiting[s] = deadline
            heapq.heappush(events, (deadline, _JOIN_DEADLINE, s))
        elif kind == _JOIN_DEADLINE and waiting.get(s) == t:
            if computing:
                end_compute(t, 0.0)  # a planned reconfiguration starts at a step boundary
                reconfigure(t, model.grow_seconds)
            else:  # a reconfiguration is running: join at its end
                del waiting[s]
                joining.append(s)
    admit_joining(horizon)
    if horizon > compute_start:
        end_compute(horizon, 0.0)
    return run
