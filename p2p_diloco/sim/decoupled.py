"""Decoupled DiLoCo at paper scale: M elastic learners feeding the real synchronizer round logic.

Each learner is an elastic data-parallel job on its share of the chips (`simulate_elastic_job`), so
its failures pause only itself. While it computes it sends one fragment delta every `send_seconds`
of compute, fragments in round-robin order; a delta carries the learner's work on that fragment
since its previous delta of it (1/P of its chip-seconds). The deltas go through
`p2p_diloco.protocol.sync_round.SynchronizerRounds` exactly as a synchronizer peer would use it:
`offer`, `ready` with the set of live learners, `close`, and `finish` after `sync_seconds` of merge
and broadcast, after which every learner adopts the new fragment version. Work in a delta that is
merged "ended up in the model"; work in a rejected or dropped delta is lost.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from p2p_diloco.protocol.decisions import Decision
from p2p_diloco.protocol.sync_round import CLOSE, REJECT, Contribution, SynchronizerRounds
from p2p_diloco.sim.failure_model import FailureModel
from p2p_diloco.sim.jobs import ComputeInterval, JobRun, simulate_elastic_job


@dataclass
class DecoupledRun:
    """Outcome of one Decoupled DiLoCo simulation."""

    chips: int
    horizon: float
    learners: list[JobRun]
    merged_chip_seconds: float = 0.0
    in_flight_chip_seconds: float = 0.0  # sent or trained but not merged when the horizon ends
    lost_chip_seconds: float = 0.0  # in rejected or dropped deltas
    deltas_sent: int = 0
    deltas_rejected: int = 0
    rounds_merged: int = 0
    contributors_per_round: float = 0.0
    reject_reasons: dict[str, int] = field(default_factory=dict)
    uptime: float = 0.0

    @property
    def goodput(self) -> float:
        return (self.merged_chip_seconds + self.in_flight_chip_seconds) / (self.chips * self.horizon)


def split_chips(chips: int, learners: int) -> list[int]:
    """Chips per learner: as equal as possible, the first `chips % learners` learners one chip larger."""
    base, extra = divmod(chips, learners)
    return [base + (1 if i < extra else 0) for i in range(learners)]


def _sends(intervals: list[ComputeInterval], every: float) -> Iterator[tuple[float, float, float]]:
    """(time, useful chip-seconds, compute seconds) since the previous send, one every `every` s of
    compute."""
    work = seconds = 0.0
    for iv in intervals:
        span = iv.end - iv.start
        rate = (iv.chips * span - iv.lost) / span  # useful chip-seconds per second in this interval
        t = iv.start
        while t < iv.end:
            step = min(every - seconds, iv.end - t)
            t += step
            seconds += step
            work += rate * step
            if seconds >= every - 1e-9:
                yield t, work, seconds
                work = seconds = 0.0
    if seconds > 0:
        yield float("inf"), work, seconds  # trained but never sent before the horizon


def _live_union_fraction(runs: list[JobRun], horizon: float) -> float:
    """Fraction of [0, horizon] during which at least one learner computes."""
    edges: list[tuple[float, int]] = []
    for run in runs:
        for iv in run.intervals:
            edges.append((iv.start, 1))
            edges.append((iv.end, -1))
    edges.sort()
    covered, depth, since = 0.0, 0, 0.0
    for t, d in edges:
        if depth == 0 and d > 0:
            since = t
        depth += d
        if depth == 0:
            covered += t - since
    return covered / horizon


# Event kinds, in the order they are handled at equal times: a learner stops or starts computing
# before anything is polled, a merge finishes before new deltas arrive.
_STOP, _START, _FINISH, _SEND, _CHECK = 0, 1, 2, 3, 4


def simulate_decoupled(
    learners: int, chips: int, horizon: float, model: FailureModel, seed: int | str
) -> DecoupledRun:
    """Run M elastic learners and the synchronizer rounds over `horizon` seconds."""
    runs = [
        simulate_elastic_job(n, horizon, model, random.Random(f"{seed}:learner:{i}"), record=True)
        for i, n in enumerate(split_chips(chips, learners))
    ]
    out = DecoupledRun(chips=chips, horizon=horizon, learners=runs)
    out.uptime = _live_union_fraction(runs, horizon)
    replay = _RoundsReplay(runs, model, out)
    replay.run_until(horizon)
    replay.count_unmerged()
    if out.rounds_merged:
        out.contributors_per_round /= out.rounds_merged
    return out


class _RoundsReplay:
    """The learners' sends replayed in time order through `SynchronizerRounds`, tallied in a `DecoupledRun`.

    Events are (time, kind, index): a learner starting or stopping, a learner's send, a grace deadline
    to poll at, a merge finishing.
    """

    def __init__(self, runs: list[JobRun], model: FailureModel, out: DecoupledRun) -> None:
        self.model = model
        self.out = out
        self.runs = runs
        frags = self.frags = model.sim_fragments
        self.rounds = SynchronizerRounds(
            frags,
            [0] * frags,
            min_quorum=model.min_quorum,
            max_staleness=model.max_staleness,
            gamma=model.grace_gamma,
            tau=model.tau,
        )
        learners = len(runs)
        self.names = [f"learner-{i}" for i in range(learners)]
        # per learner and fragment: the version it adopted, the chip-seconds and seconds since its delta
        self.anchors = [[0] * frags for _ in range(learners)]
        self.work_since = [[0.0] * frags for _ in range(learners)]
        self.seconds_since = [[0.0] * frags for _ in range(learners)]
        self.next_fragment = [0] * learners
        self.live: set[str] = set()
        self.live_frozen: frozenset[str] = frozenset()  # cache of `live`, rebuilt when it changes
        self.streams = [_sends(run.intervals, model.send_seconds) for run in runs]
        self.heads: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * learners
        self.merging: dict[int, list[Contribution]] = {}
        self.events: list[tuple[float, int, int]] = []

    def run_until(self, horizon: float) -> None:
        """Queue every learner's first send and its compute intervals, then handle events up to `horizon`."""
        events = self.events
        for i, run in enumerate(self.runs):
            self.advance_stream(i)
            for iv in run.intervals:
                events.append((iv.start, _START, i))
                events.append((iv.end, _STOP, i))
        heapq.heapify(events)
        while events:
            t, kind, a = heapq.heappop(events)
            if t >= horizon:
                break
            if kind == _START or kind == _STOP:
                (self.live.add if kind == _START else self.live.discard)(self.names[a])
                self.live_frozen = frozenset(self.live)
            elif kind == _SEND:
                self.send(a, t)
                self.advance_stream(a)
            elif kind == _CHECK:
                self.poll(t)
            else:
                self.finish(a, t)

    def reject(self, decision: Decision, work: float) -> None:
        out = self.out
        out.deltas_rejected += 1
        out.lost_chip_seconds += work
        tag = str(decision.tag)
        out.reject_reasons[tag] = out.reject_reasons.get(tag, 0) + 1

    def advance_stream(self, i: int) -> None:
        """Queue learner `i`'s next send; work it trained but never sent before the horizon is in flight."""
        for send in self.streams[i]:
            if send[0] == float("inf"):
                self.out.in_flight_chip_seconds += send[1]
                continue
            self.heads[i] = send
            heapq.heappush(self.events, (send[0], _SEND, i))
            return

    def poll(self, t: float) -> None:
        """Close the rounds that are ready; for a round with quorum still waiting, queue its grace
        deadline."""
        rounds = self.rounds
        for fragment, decision in rounds.ready(t, self.live_frozen):
            if decision.action == CLOSE:
                self.merging[fragment] = rounds.close(fragment, t)
                heapq.heappush(self.events, (t + self.model.sync_seconds, _FINISH, fragment))
                continue
            current = rounds.round(fragment)
            if current is not None and current.quorum_at is not None and fragment not in rounds.merging:
                cap = rounds.timings.round_time(self.model.tau)
                deadline = current.quorum_at + min(rounds.grace(), cap)
                heapq.heappush(self.events, (max(deadline, t), _CHECK, fragment))

    def take_delta(self, i: int) -> tuple[int, float, float]:
        """Credit learner `i`'s latest work to every fragment, then take its next fragment's delta.

        Every inner step trains every fragment, but a delta carries one fragment (round-robin): the
        (fragment, chip-seconds, compute seconds) it carries since that fragment's previous delta.
        """
        _, work, seconds = self.heads[i]
        row_work, row_seconds = self.work_since[i], self.seconds_since[i]
        for p in range(self.frags):
            row_work[p] += work / self.frags
            row_seconds[p] += seconds
        p = self.next_fragment[i]
        self.next_fragment[i] = (p + 1) % self.frags
        delta_work, delta_seconds = row_work[p], row_seconds[p]
        row_work[p] = row_seconds[p] = 0.0
        return p, delta_work, delta_seconds

    def send(self, i: int, t: float) -> None:
        """Learner `i` offers its next fragment delta at `t`."""
        p, delta_work, delta_seconds = self.take_delta(i)
        self.out.deltas_sent += 1
        rounds, step_seconds = self.rounds, self.model.step_seconds
        rounds.observe_step_time(step_seconds)
        contribution = Contribution(
            sender=self.names[i],
            anchor_version=self.anchors[i][p],
            tokens=max(1, round(delta_work)),
            steps=max(1, round(delta_seconds / step_seconds)),
            received_at=t,
            payload=delta_work,
        )
        decision = rounds.offer(p, contribution, t)
        if decision.action == REJECT:
            self.reject(decision, delta_work)
            self.anchors[i][p] = rounds.version(p)  # told to catch up: adopts the current fragment
        else:
            self.poll(t)

    def finish(self, fragment: int, t: float) -> None:
        """The merge of `fragment` lands: count its work, reject what the new version dropped, push it to
        all."""
        rounds, out = self.rounds, self.out
        closed = self.merging.pop(fragment)
        waiting = rounds.round(fragment)
        before = {c.sender: c for c in waiting.contributions()} if waiting is not None else {}
        new_version = rounds.version(fragment) + 1
        dropped = rounds.finish(fragment, new_version, self.model.sync_seconds, now=t)
        after = rounds.round(fragment)
        kept = after.reporters if after is not None else frozenset()
        reasons = iter(dropped)
        for sender, c in before.items():
            if sender not in kept:
                self.reject(next(reasons), c.payload)
        out.rounds_merged += 1
        out.contributors_per_round += len(closed)
        out.merged_chip_seconds += sum(c.payload for c in closed)
        for row in self.anchors:  # the update is pushed to every learner, which adopts it
            row[fragment] = new_version
        self.poll(t)

    def count_unmerged(self) -> None:
        """Work not merged by the horizon: still in learners' counters, in open rounds or being merged."""
        out, rounds = self.out, self.rounds
        out.in_flight_chip_seconds += sum(sum(row) for row in self.work_since)
        for fragment in rounds.open_fragments:
            out.in_flight_chip_seconds += sum(c.payload for c in rounds.round(fragment).contributions())
        for closed in self.merging.values():
            out.in_flight_chip_seconds += sum(c.payload for c in closed)
