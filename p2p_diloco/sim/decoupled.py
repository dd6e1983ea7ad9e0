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
    """(time, useful chip-seconds, compute seconds) since the previous send, one every `every` s of compute."""
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
    sizes = split_chips(chips, learners)
    runs = [
        simulate_elastic_job(n, horizon, model, random.Random(f"{seed}:learner:{i}"), record=True)
        for i, n in enumerate(sizes)
    ]
    out = DecoupledRun(chips=chips, horizon=horizon, learners=runs)
    out.uptime = _live_union_fraction(runs, horizon)
    frags = model.sim_fragments
    rounds = SynchronizerRounds(
        frags,
        [0] * frags,
        min_quorum=model.min_quorum,
        max_staleness=model.max_staleness,
        gamma=model.grace_gamma,
        tau=model.tau,
    )
    names = [f"learner-{i}" for i in range(learners)]
    anchors = [[0] * frags for _ in range(learners)]  # version of each fragment the learner adopted
    work_since = [[0.0] * frags for _ in range(learners)]  # chip-seconds on each fragment since its delta
    seconds_since = [[0.0] * frags for _ in range(learners)]
    next_fragment = [0] * learners
    live: set[str] = set()
    live_frozen: list[frozenset[str]] = [frozenset()]  # cache of `live`, rebuilt when it changes
    streams = [_sends(run.intervals, model.send_seconds) for run in runs]
    heads: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * learners
    merging: dict[int, list[Contribution]] = {}
    events: list[tuple[float, int, int]] = []

    def reject(decision: Decision, work: float) -> None:
        out.deltas_rejected += 1
        out.lost_chip_seconds += work
        tag = str(decision.tag)
        out.reject_reasons[tag] = out.reject_reasons.get(tag, 0) + 1

    def advance_stream(i: int) -> None:
        for send in streams[i]:
            if send[0] == float("inf"):  # trained before the horizon, never sent
                out.in_flight_chip_seconds += send[1]
                continue
            heads[i] = send
            heapq.heappush(events, (send[0], _SEND, i))
            return

    def poll(t: float) -> None:
        for fragment, decision in rounds.ready(t, live_frozen[0]):
            if decision.action == CLOSE:
                merging[fragment] = rounds.close(fragment, t)
                heapq.heappush(events, (t + model.sync_seconds, _FINISH, fragment))
                continue
            current = rounds.round(fragment)
            if current is not None and current.quorum_at is not None and fragment not in rounds.merging:
                cap = rounds.timings.round_time(model.tau)
                deadline = current.quorum_at + min(rounds.grace(), cap)
                heapq.heappush(events, (max(deadline, t), _CHECK, fragment))

    def send(i: int, t: float) -> None:
        _, work, seconds = heads[i]
        row_work, row_seconds = work_since[i], seconds_since[i]
        for p in range(frags):  # every inner step trains every fragment
            row_work[p] += work / frags
            row_seconds[p] += seconds
        p = next_fragment[i]
        next_fragment[i] = (p + 1) % frags
        delta_work, delta_seconds = row_work[p], row_seconds[p]
        row_work[p] = row_seconds[p] = 0.0
        out.deltas_sent += 1
        rounds.observe_step_time(model.step_seconds)
        contribution = Contribution(
            sender=names[i],
            anchor_version=anchors[i][p],
            tokens=max(1, round(delta_work)),
            steps=max(1, round(delta_seconds / model.step_seconds)),
            received_at=t,
            payload=delta_work,
        )
        decision = rounds.offer(p, contribution, t)
        if decision.action == REJECT:
            reject(decision, delta_work)
            anchors[i][p] = rounds.version(p)  # told to catch up: adopts the current fragment
        else:
            poll(t)

    def finish(fragment: int, t: float) -> None:
        closed = merging.pop(fragment)
        waiting = rounds.round(fragment)
        before = {c.sender: c for c in waiting.contributions()} if waiting is not None else {}
        new_version = rounds.version(fragment) + 1
        dropped = rounds.finish(fragment, new_version, model.sync_seconds, now=t)
        after = rounds.round(fragment)
        kept = after.reporters if after is not None else frozenset()
        reasons = iter(dropped)
        for sender, c in before.items():
            if sender not in kept:
                reject(next(reasons), c.payload)
        out.rounds_merged += 1
        out.contributors_per_round += len(closed)
        out.merged_chip_seconds += sum(c.payload for c in closed)
        for row in anchors:  # the update is pushed to every learner, which adopts it
            row[fragment] = new_version
        poll(t)

    for i, run in enumerate(runs):
        advance_stream(i)
        for iv in run.intervals:
            events.append((iv.start, _START, i))
            events.append((iv.end, _STOP, i))
    heapq.heapify(events)
    while events:
        t, kind, a = heapq.heappop(events)
        if t >= horizon:
            break
        if kind == _START or kind == _STOP:
            (live.add if kind == _START else live.discard)(names[a])
            live_frozen[0] = frozenset(live)
        elif kind == _SEND:
            send(a, t)
            advance_stream(a)
        elif kind == _CHECK:
            poll(t)
        else:
            finish(a, t)

    # Work not merged by the horizon: still in learners' counters, in open rounds or being merged.
    out.in_flight_chip_seconds += sum(sum(row) for row in work_since)
    for fragment in rounds.open_fragments:
        out.in_flight_chip_seconds += sum(c.payload for c in rounds.round(fragment).contributions())
    for closed in merging.values():
        out.in_flight_chip_seconds += sum(c.payload for c in closed)
    if out.rounds_merged:
        out.contributors_per_round /= out.rounds_merged
    return out
