"""Global evaluation (`node.evaluation`): who evaluates, when, what is published, and how a new evaluator
continues the curve of the one before it (a failover), on an in-memory store and the tiny model."""

from __future__ import annotations

import math

import pytest

from p2p_diloco.config import TrustConfig
from p2p_diloco.model.data import load_corpus
from p2p_diloco.model.gpt import build_model
from p2p_diloco.node.evaluation import (
    DEDICATED_STALE,
    HISTORY_TTL,
    EvalMode,
    EvalOptions,
    EvalWorker,
    GlobalEvaluator,
    read_histories,
)
from p2p_diloco.node.ledger import ContributionLedger
from p2p_diloco.node.logsinks import SafeSinks
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.memory import InMemoryKeyValueStore
from p2p_diloco.wire.keys import eval_key
from p2p_diloco.wire.observe import MAX_EVAL_SKEW, EvalHistory, EvalPoint, EvalRefusal, decode_eval_history
from tests.support.manifests import tiny_manifest

MANIFEST = tiny_manifest("eval-unit")
CORPUS = load_corpus(MANIFEST.data)
KEY = eval_key(MANIFEST.run_id, MANIFEST.manifest_hash)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


class World:
    """What an evaluator sees of its peer: versions, the lease, the replica's parameters."""

    def __init__(self) -> None:
        self.model = build_model(MANIFEST.model)
        self.versions = (0, 0)
        self.holder = False
        self.snapshots = 0

    def snapshot(self):  # noqa: ANN201
        self.snapshots += 1
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}, self.versions


class Sink:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, values: dict, step: int, wall_time: float) -> None:
        self.logged.append((values, step))

    def close(self) -> None:
        pass


class Evaluating:
    """One peer's evaluation as the node runs it, on one thread: `ask` and `finish` (owner thread) around
    `EvalWorker.evaluate` (training thread), the history read (I/O thread) then merged (owner thread)."""

    def __init__(self, evaluator: GlobalEvaluator, kv, clock, world) -> None:  # noqa: ANN001
        self.ev, self.kv, self.clock, self.world = evaluator, kv, clock, world
        options = evaluator.options
        self.worker = EvalWorker(MANIFEST, options, lambda: build_model(MANIFEST.model), CORPUS.eval)

    def __getattr__(self, name: str):  # noqa: ANN204 - history, ignored, ...: the evaluator's
        return getattr(self.ev, name)

    def wants_to_evaluate(self, now: float) -> bool:
        return self.ev.wants_to_evaluate(now, self.world.holder)

    def maybe_evaluate(self) -> EvalPoint | None:
        world = self.world
        request = self.ev.ask(
            self.clock.now(), versions=world.versions, holds_lease=world.holder, term=3, frozen=world.snapshot
        )
        return None if request is None else self.ev.finish(request, self.worker.evaluate(request))

    def refresh(self) -> None:
        self.ev.absorb(read_histories(self.kv, self.ev.key, self.ev.manifest, self.clock.now()))

    def publish(self) -> None:
        self.refresh()
        self.kv.store(self.ev.key, self.ev.peer_id, self.ev.record(), self.clock.now() + HISTORY_TTL)


def evaluator(
    peer_id: str, kv, clock, world, *, mode=EvalMode.AUTO, ledger=None, sinks=None, manifest=MANIFEST
) -> Evaluating:  # noqa: ANN001
    options = EvalOptions(mode=mode, every_updates=4, min_seconds=1.0, batches=1, batch_size=2)
    return Evaluating(
        GlobalEvaluator(manifest, options, peer_id=peer_id, ledger=ledger, sinks=sinks), kv, clock, world
    )


def published(kv) -> dict[str, EvalHistory]:  # noqa: ANN001
    return {peer: decode_eval_history(v.value, 2) for peer, v in kv.get(KEY, 0.0).items()}


def test_the_synchronizer_evaluates_every_n_updates_and_publishes_its_history():
    kv, clock, world = InMemoryKeyValueStore(), Clock(), World()
    ev = evaluator("QmA", kv, clock, world)
    assert ev.maybe_evaluate() is None and world.snapshots == 0  # not the synchronizer: no copy taken
    world.holder = True
    assert ev.maybe_evaluate() is None  # the synchronizer, but it has not read the published history yet
    ev.refresh()
    first = ev.maybe_evaluate()
    assert first is not None and first.versions == (0, 0) and first.evaluator == "QmA" and first.term == 3
    assert math.isclose(first.loss, math.log(256), rel_tol=0.1)  # the untrained model: about uniform bytes
    ev.publish()
    assert published(kv)["QmA"].points == (first,) and not published(kv)["QmA"].dedicated
    world.versions = (2, 2)
    clock.t += 0.5
    assert ev.maybe_evaluate() is None  # 4 updates, but within min_seconds of the last evaluation
    clock.t += 1.0
    second = ev.maybe_evaluate()
    assert second is not None and second.updates == 4
    clock.t += 10
    world.versions = (3, 4)
    assert ev.maybe_evaluate() is None  # 3 updates < every_updates
    ev.publish()
    assert [p.updates for p in published(kv)["QmA"].points] == [0, 4]


def test_a_new_evaluator_continues_the_curve_and_its_merged_tokens(tmp_path):
    kv, clock, world = InMemoryKeyValueStore(), Clock(), World()
    world.holder = True
    old = evaluator("QmOld", kv, clock, world)
    old.refresh()
    old.maybe_evaluate()
    old.publish()
    clock.t += 5
    world.versions = (3, 3)  # the old evaluator dies after these updates
    ledger = ContributionLedger(tmp_path, MANIFEST)
    per_credit = 2 * 8 * 2  # batch 2 x block 8 tokens per step, P = 2
    for p in (0, 1):
        for v in (1, 2, 3):
            contributors = (("QmX", 10.0 * per_credit),)
            record = UpdateRecord(
                MANIFEST.run_id, MANIFEST.manifest_hash, p, v - 1, 1, "QmOld", contributors, "c", b""
            )
            ledger.record(record, 0.0)
    new = evaluator("QmNew", kv, clock, world, ledger=ledger)
    new.refresh()  # reads the old evaluator's record: the curve so far
    point = new.maybe_evaluate()
    assert point is not None and point.tokens == 6 * 10  # six updates since the old point, 10 tokens each
    new.publish()
    mine = published(kv)["QmNew"]
    assert [p.evaluator for p in mine.points] == [
        "QmOld",
        "QmNew",
    ]  # the old points live on in the new record
    assert mine.contributions == (("QmX", 60, 6),)
    ledger.close()


def test_a_dedicated_evaluator_keeps_the_synchronizer_from_evaluating():
    kv, clock, world = InMemoryKeyValueStore(), Clock(), World()
    dedicated = evaluator("QmDed", kv, clock, world, mode=EvalMode.ALWAYS)
    dedicated.refresh()
    assert dedicated.maybe_evaluate() is not None  # not the synchronizer, evaluates anyway
    dedicated.publish()
    assert published(kv)["QmDed"].dedicated
    world.holder = True
    sync = evaluator("QmSync", kv, clock, world)
    sync.refresh()
    assert not sync.wants_to_evaluate(clock.now())
    clock.t += DEDICATED_STALE + 1  # the dedicated evaluator went silent
    assert sync.wants_to_evaluate(clock.now())
    assert not evaluator("QmNo", kv, clock, world, mode=EvalMode.NEVER).wants_to_evaluate(clock.now())


def test_bad_records_are_ignored_with_a_counter_and_sinks_get_each_point_once():
    kv, clock, world = InMemoryKeyValueStore(), Clock(), World()
    kv.store(KEY, "QmBad", b'{"points": "junk"}', 1e12)
    world.holder = True
    good = evaluator("QmGood", kv, clock, world)
    good.refresh()
    good.maybe_evaluate()
    good.publish()
    sink = Sink()
    follower = evaluator("QmF", kv, clock, world, mode=EvalMode.NEVER, sinks=SafeSinks([sink]))
    follower.refresh()
    follower.refresh()
    assert follower.ignored["bad eval history"] == 2
    assert len(sink.logged) == 1 and set(sink.logged[0][0]) == {"global/eval_loss", "global/perplexity"}


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_non_finite_loss_is_not_published(monkeypatch, loss):
    kv, clock, world = InMemoryKeyValueStore(), Clock(), World()
    world.holder = True
    monkeypatch.setattr("p2p_diloco.node.evaluation.evaluate", lambda *a, **k: loss)
    ev = evaluator("QmA", kv, clock, world)
    ev.refresh()
    assert ev.maybe_evaluate() is None and ev.history == ()


SYNC, DEDICATED, STRANGER = "Qm" + "S" * 44, "Qm" + "D" * 44, "Qm" + "X" * 44
PUBLIC = tiny_manifest(
    "eval-unit", trust=TrustConfig(authority=SYNC, synchronizers=(SYNC,), evaluators=(DEDICATED,))
)
PUBLIC_KEY = eval_key(PUBLIC.run_id, PUBLIC.manifest_hash)


def forged(evaluator_id: str, t: float, loss: float = 9.0) -> EvalPoint:
    if evaluator_id == STRANGER:
        return EvalPoint(t, 10**9, (10**6, 10**6), loss, evaluator_id, term=10**4)
    return EvalPoint(t, 0, (0, 0), loss, evaluator_id, term=1)


def test_only_permitted_evaluators_count_and_a_strangers_record_never_pauses_evaluation():
    """Issue #27: a stranger's dedicated record dated far in the future once stopped the synchronizer from
    evaluating until restart, and honest evaluators re-published its points. Only the run's synchronizers
    and `[trust] evaluators` count; a point dated ahead refuses its record even from a permitted writer."""
    kv, clock, world = InMemoryKeyValueStore(), Clock(), World()
    far = clock.t + 10**7
    kv.store(PUBLIC_KEY, STRANGER, EvalHistory((forged(STRANGER, far),), dedicated=True).to_bytes(), 1e12)
    # a listed writer relaying a point it cannot attribute to a permitted evaluator: that point is dropped
    relay = EvalHistory((forged(STRANGER, clock.t - 5), forged(DEDICATED, clock.t - 4, loss=3.0)), True)
    kv.store(PUBLIC_KEY, DEDICATED, relay.to_bytes(), 1e12)
    world.holder = True
    sync = evaluator(SYNC, kv, clock, world, manifest=PUBLIC)
    sync.refresh()
    assert sync.ignored[EvalRefusal.WRITER] == 1 and sync.ignored[EvalRefusal.UNATTRIBUTED] == 1
    assert [p.evaluator for p in sync.history] == [DEDICATED]  # nothing of the stranger's
    assert not sync.wants_to_evaluate(clock.now())  # the listed dedicated evaluator evaluates (recently)
    clock.t += DEDICATED_STALE + 1
    assert sync.wants_to_evaluate(clock.now())  # the stranger's far-future point pauses nothing
    world.versions = (2, 2)  # due: every_updates after the dedicated evaluator's point
    point = sync.maybe_evaluate()
    assert point is not None
    sync.publish()
    mine = decode_eval_history(kv.get(PUBLIC_KEY, 0.0)[SYNC].value, 2)
    assert {p.evaluator for p in mine.points} == {DEDICATED, SYNC}  # never re-publishes the stranger's point

    # the listed dedicated evaluator itself, with a point dated ahead (clock off, or hostile): refused
    ahead = EvalHistory((forged(DEDICATED, clock.t + MAX_EVAL_SKEW + 100),), dedicated=True)
    kv.store(PUBLIC_KEY, DEDICATED, ahead.to_bytes(), 2e12)
    sync.refresh()
    assert sync.ignored[EvalRefusal.FUTURE] == 1
    assert sync.wants_to_evaluate(clock.now())
