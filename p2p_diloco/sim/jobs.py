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
    job = _ElasticJob(JobRun(chips=chips, horizon=horizon), model, rng, record)
    events: list[tuple[float, int, int]] = [(rng.expovariate(job.rate), _FAIL, -1)]
    while events:
        t, kind, s = heapq.heappop(events)
        if t >= horizon:
            break
        job.admit_joining(t)
        if kind == _FAIL:
            job.fail(t, events)
        elif kind == _REPAIRED:
            job.repaired(s, t, events)
        elif kind == _JOIN_DEADLINE and job.waiting.get(s) == t:
            job.join_deadline(s, t)
    job.admit_joining(horizon)
    if horizon > job.compute_start:
        job.end_compute(horizon, 0.0)
    return job.run


class _ElasticJob:
    """The state of one elastic job between events, and what each event does to it."""

    def __init__(self, run: JobRun, model: FailureModel, rng: random.Random, record: bool) -> None:
        self.run = run
        self.model = model
        self.rng = rng
        self.record = record
        self.rate = run.chips * model.chip_failure_rate
        self.out: set[int] = set()  # slices not in the job: failed, in repair, waiting or joining
        self.waiting: dict[int, float] = {}  # repaired slice -> its join deadline
        self.joining: list[int] = []  # admitted by the running reconfiguration, active at its end
        self.out_chips = 0
        self.compute_start = 0.0  # the job computes from here on; a reconfiguration moves it to its end

    def slice_size(self, s: int) -> int:
        size = self.model.slice_chips
        return min(size, self.run.chips - s * size)

    def end_compute(self, t: float, lost_seconds: float) -> None:
        """Book the compute since `compute_start` up to `t`, of which the last `lost_seconds` are lost."""
        run = self.run
        active = run.chips - self.out_chips
        span = t - self.compute_start
        if active <= 0 or span <= 0:
            return
        lost = min(span, lost_seconds)
        run.compute_seconds += span
        run.useful_chip_seconds += active * (span - lost)
        if self.record:
            run.intervals.append(ComputeInterval(self.compute_start, t, active, active * lost))

    def admit_joining(self, t: float) -> None:
        """Slices admitted by a reconfiguration that has ended by `t` are active again."""
        if self.joining and self.compute_start <= t:
            for s in self.joining:
                self.out.discard(s)
                self.out_chips -= self.slice_size(s)
            self.joining = []

    def reconfigure(self, t: float, pause: float) -> None:
        """Pause for `pause` seconds; every repaired slice waiting joins at the end."""
        self.run.reconfigurations += 1
        self.joining = sorted(self.waiting)
        self.waiting.clear()
        self.compute_start = t + pause

    def fail(self, t: float, events: list[tuple[float, int, int]]) -> None:
        """A chip fails: draw the next failure, then drop its slice unless that slice is already out."""
        run, model, rng = self.run, self.model, self.rng
        run.failures += 1
        heapq.heappush(events, (t + rng.expovariate(self.rate), _FAIL, -1))
        failed = int(rng.random() * run.chips) // model.slice_chips
        if failed in self.out:
            return
        run.disruptive_failures += 1
        self.out.add(failed)
        heapq.heappush(events, (t + model.repair_seconds, _REPAIRED, failed))
        if t >= self.compute_start:
            self.end_compute(t, (t - self.compute_start) % model.step_seconds)
            self.reconfigure(t, model.shrink_seconds)
        self.out_chips += self.slice_size(failed)

    def repaired(self, s: int, t: float, events: list[tuple[float, int, int]]) -> None:
        deadline = t + self.model.join_wait_seconds
        self.waiting[s] = deadline
        heapq.heappush(events, (deadline, _JOIN_DEADLINE, s))

    def join_deadline(self, s: int, t: float) -> None:
        """Slice `s` waited long enough: grow now, or join at the end of the reconfiguration running."""
        if t >= self.compute_start:
            self.end_compute(t, 0.0)  # a planned reconfiguration starts at a step boundary
            self.reconfigure(t, self.model.grow_seconds)
        else:
            del self.waiting[s]
            self.joining.append(s)
