"""The learner's adoption rule and the one record of deltas in flight, on a tiny model with a hand-made
replica.

The test plays the rest of the peer around a real `Learner` (training thread) and `Outbox` (owner
thread): it routes the deltas the learner takes, answers them, applies updates to the replica and tells
the outbox (`on_applied`), whose messages reach the learner's inbox as in a peer; the learner handles them
at its next step boundary."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import load_corpus
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.effects import (
    Adopt,
    DeltaReady,
    DeltaReplied,
    MergedMine,
    Release,
    Reload,
    SendGate,
    ToLearner,
)
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.outbox import Outbox
from p2p_diloco.wire.frames import decode_delta
from p2p_diloco.wire.replies import Reply
from tests.support.manifests import TINY_DILOCO, tiny_manifest, tiny_training

HOLDER = ("holder", 1)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(RunManifest(run_id="t").data)


class Pair:
    """A learner and its peer's outbox, wired as in a peer: the outbox's messages go to the inbox."""

    def __init__(self, corpus, adoption="carry", **diloco):  # noqa: ANN001, ANN003
        manifest = tiny_manifest("t", diloco=dataclasses.replace(TINY_DILOCO, adoption=adoption, **diloco))
        t = tiny_training(manifest, corpus=corpus)
        self.learner = Learner("me", manifest, t.plan, t.replica, t.model, t.optimizer, t.sampler)
        self.replica, self.plan = t.replica, t.plan
        self.outbox = Outbox("me", manifest, Journal("me", self._emit), self._emit)
        self.outbox.follow(HOLDER)
        self.headers = []  # the headers of the frames the outbox sent, in order

    def _emit(self, intent) -> None:  # noqa: ANN001
        if isinstance(intent, ToLearner):
            self.learner.inbox.put(intent.message)

    def take(self) -> DeltaReady | None:
        return self.learner.take_due(float(self.learner.step), self.outbox.gate)

    def route(self, ready: DeltaReady) -> bool:
        frame = self.outbox.route(ready)
        if frame is not None:
            self.headers.append(decode_delta(frame, max_bytes=1 << 24)[0])
        return frame is not None

    def train_until_delta(self, *, route: bool = True) -> DeltaReady:
        for _ in range(20):
            self.learner.train_step()
            due = self.take()
            if due is not None:
                assert not route or self.route(due)
                return due
        raise AssertionError("no fragment became due")

    def refuse(self, ready: DeltaReady) -> None:
        reply = Reply.refused("test", "refused")
        self.outbox.on_reply(
            DeltaReplied(*HOLDER, ready.fragment, ready.seq, reply, float(self.learner.step))
        )

    def apply(self, p: int, contributors, seqs=(), scale: float = 0.5) -> UpdateRecord:  # noqa: ANN001
        """Apply an update of fragment `p` to the replica and tell the outbox, as the peer does."""
        old, new = update_replica(self.replica, p, scale)
        record = UpdateRecord("t", "x", p, self.replica.version(p) - 1, 1, "sync", contributors, "", b"")
        record = dataclasses.replace(record, seqs=tuple(seqs))
        self.outbox.on_applied(record, old, new)
        return record


def update_replica(replica, p, scale=0.5):  # noqa: ANN001
    old = replica.params_view(p)
    grad = {n: torch.full_like(t, scale) for n, t in old.items()}
    pending = replica.compute_update(p, grad, lr=0.7, momentum=0.9)
    assert replica.commit(pending).action == "apply"
    return old, replica.params_view(p)


def others_update(replica, p) -> Adopt:  # noqa: ANN001
    """Apply an update of others' deltas to the replica; the message the outbox posts for it."""
    old, new = update_replica(replica, p)
    record = UpdateRecord("t", "x", p, replica.version(p) - 1, 1, "sync", (("other", 1.0),), "", b"")
    return Adopt(record, old, new, record.to_version)


def theta(learner, p):  # noqa: ANN001
    return {n: learner.params[n].detach().clone() for n in learner.plan.names(p)}


def test_delta_is_anchor_minus_theta_and_counts_work(corpus):
    pair = Pair(corpus)
    due = pair.train_until_delta()
    learner, p, header = pair.learner, due.fragment, due.header
    assert header.fragment == p and header.anchor_version == 0 and header.seq == due.seq == learner.seq
    assert header.steps == learner.step and header.tokens == learner.step * 2 * 8
    for n, t in pair.replica.params_view(p).items():
        torch.testing.assert_close(due.delta[n], t - learner.params[n].detach())
    assert learner.out == {p: due.seq} and learner.work[p].steps == 0
    kept = pair.outbox.in_flight[p]  # the one record of it: on the owner thread
    assert (kept.seq, kept.target, kept.work) == (due.seq, HOLDER, due.work)
    assert (due.work.tokens, due.work.steps) == (header.tokens, header.steps) and due.work.seconds > 0


def test_carry_keeps_progress_made_after_sending(corpus):
    pair = Pair(corpus)
    learner = pair.learner
    due = pair.train_until_delta()
    p = due.fragment
    at_send = {n: t.clone() for n, t in pair.outbox.in_flight[p].theta_at_send.items()}
    learner.train_step()
    before = theta(learner, p)
    pair.apply(p, (("me", 1.0),), seqs=(due.seq,))
    learner.settle()
    new_global = pair.replica.params_view(p)
    for n in before:
        torch.testing.assert_close(learner.params[n].detach(), new_global[n] + (before[n] - at_send[n]))
    assert p not in learner.out and p not in pair.outbox.in_flight and learner.work[p].steps == 1
    assert learner.steps_merged > 0 and learner.anchors[p][0] == 1


def test_overwrite_takes_the_global_fragment_exactly(corpus):
    pair = Pair(corpus, adoption="overwrite")
    p = pair.train_until_delta().fragment
    pair.learner.train_step()
    pair.apply(p, (("me", 1.0),))
    pair.learner.settle()
    for n, t in pair.replica.params_view(p).items():
        assert torch.equal(pair.learner.params[n].detach(), t)
    assert pair.learner.work[p].steps == 0


def test_others_merge_shifts_theta_and_the_in_flight_theta_at_send_alike(corpus):
    pair = Pair(corpus)
    learner = pair.learner
    due = pair.train_until_delta()
    p = due.fragment
    before, at_send = theta(learner, p), {n: t.clone() for n, t in due.theta_at_send.items()}
    old = pair.replica.params_of(p)
    pair.apply(p, (("other", 1.0),))
    learner.settle()
    new = pair.replica.params_view(p)
    for n in before:
        torch.testing.assert_close(learner.params[n].detach(), before[n] + (new[n] - old[n]))
        torch.testing.assert_close(pair.outbox.in_flight[p].theta_at_send[n], at_send[n] + (new[n] - old[n]))
    assert learner.out == {p: due.seq}  # still in flight: the local work is still owed to the swarm


def test_a_refused_delta_returns_its_work_and_a_stale_release_changes_nothing(corpus):
    pair = Pair(corpus)
    learner = pair.learner
    due = pair.train_until_delta()
    p = due.fragment
    learner.inbox.put(Release(p, due.seq + 1, due.work))  # not the delta out: ignored
    learner.settle()
    assert learner.out == {p: due.seq} and learner.deltas_rejected == 0 and learner.work[p].steps == 0
    pair.refuse(due)
    learner.settle()
    assert p not in learner.out and p not in pair.outbox.in_flight
    assert learner.work[p].steps == due.work.steps and learner.deltas_rejected == 1


def test_a_message_posted_mid_step_takes_effect_at_the_step_boundary_as_if_at_once(corpus):
    """The peer's owner thread posts while the training thread steps: nothing moves mid-step, and the
    result equals a twin that got the same message right after the same step."""
    import threading

    pair, twin = Pair(corpus), Pair(corpus)  # same weights, same batches
    learner = pair.learner
    next_batch = learner.sampler.next_batch

    def next_batch_while_an_update_lands():
        before = theta(learner, 0)
        poster = threading.Thread(target=lambda: learner.inbox.put(others_update(pair.replica, 0)))
        poster.start()
        poster.join(timeout=30)
        assert not poster.is_alive()  # posting never waits for the step
        assert all(torch.equal(before[n], learner.params[n]) for n in before)  # nothing moved mid-step
        return next_batch()

    learner.sampler.next_batch = next_batch_while_an_update_lands
    learner.train_step()
    twin.learner.train_step()
    twin.learner.inbox.put(others_update(twin.replica, 0))
    learner.settle()
    twin.learner.settle()
    for p in range(2):
        assert all(
            torch.equal(a, b) for a, b in zip(theta(learner, p).values(), theta(twin.learner, p).values())
        )


def test_messages_are_handled_in_the_order_posted(corpus):
    """An adoption of an own merge posted before a release of the same delta wins; after it, not."""
    pair = Pair(corpus)
    learner = pair.learner
    due = pair.train_until_delta()
    p = due.fragment
    adopt = others_update(pair.replica, p)
    mine = MergedMine(due.seq, due.work, due.theta_at_send)
    learner.inbox.put(dataclasses.replace(adopt, mine=mine))
    learner.inbox.put(Release(p, due.seq, due.work))  # the delta was merged first: nothing left to release
    learner.settle()
    assert p not in learner.out and learner.deltas_rejected == 0 and learner.steps_merged > 0
    assert learner.work[p].steps == 0


def test_take_due_follows_the_schedule_and_waits_while_the_gate_is_shut(corpus):
    learner = Pair(corpus).learner  # H = 4, P = 2: sends due at steps 2 (fragment 1), 4 (0), 6 (1), ...
    gate = SendGate()
    learner.train_step()
    learner.train_step()
    assert learner.take_due(2.0, gate) is None  # no synchronizer known: the work keeps accumulating
    gate.state = (("holder", 1), 0.0)
    frames = []
    for _ in range(4):
        learner.train_step()
        frames.append(learner.take_due(float(learner.step), gate) is not None)
    # step 3: fragment 1 (due since step 2), step 4: fragment 0; step 6: fragment 1 is still in flight
    assert frames == [True, True, False, False]
    gate.state = (("holder", 1), 100.0)  # held until t = 100
    learner.train_step()
    assert learner.take_due(7.0, gate) is None


def release_to_a_new_holder(pair: Pair) -> DeltaReady:
    """A delta that left, then went back: a new synchronizer took over."""
    first = pair.train_until_delta()
    pair.outbox.follow(("holder2", 2))
    pair.learner.settle()
    assert pair.outbox.released[first.fragment].seq == first.seq and first.fragment in pair.learner.urgent
    return first


def test_a_released_delta_goes_out_again_at_once_carrying_its_seq(corpus):
    pair = Pair(corpus)
    first = release_to_a_new_holder(pair)
    p = first.fragment
    pair.learner.train_step()
    again = pair.take()  # not its turn in the round robin, sent anyway
    assert again is not None and again.fragment == p and again.seq > first.seq and pair.route(again)
    assert pair.headers[-1].since_seq == first.seq  # it repeats the released delta's work
    assert again.header.steps == first.header.steps + 1


def test_an_update_that_merged_a_released_delta_is_adopted_as_own_and_its_resend_dropped(corpus):
    """The double count at a term change: the old holder merges delta s after the learner took it back
    and resent its work in s'. The outbox recognises s by its seq: theta keeps only the progress made
    since s was sent, s' is dropped (synchronizers refuse it as "already merged"), and what s' carried
    beyond s goes out with the next delta."""
    pair = Pair(corpus)
    learner = pair.learner
    first = release_to_a_new_holder(pair)
    p = first.fragment
    at_send = {n: t.clone() for n, t in first.theta_at_send.items()}
    learner.train_step()
    resent = pair.take()
    assert resent is not None and pair.route(resent) and pair.headers[-1].since_seq == first.seq
    learner.train_step()
    before = theta(learner, p)
    pair.apply(p, (("me", 1.0),), seqs=(first.seq,))
    learner.settle()
    new_global = pair.replica.params_view(p)
    for n in before:
        torch.testing.assert_close(learner.params[n].detach(), new_global[n] + (before[n] - at_send[n]))
    assert p not in learner.out and p not in pair.outbox.in_flight and p not in pair.outbox.released
    assert learner.work[p].steps == 2  # the step in the dropped resend beyond s, and the one after it
    nxt = pair.take()
    assert nxt is not None and nxt.fragment == p and pair.route(nxt) and pair.headers[-1].since_seq == 0
    for n in before:  # exactly the work since s was sent, nothing of s itself
        torch.testing.assert_close(nxt.delta[n], new_global[n] - learner.params[n].detach())


def test_a_released_delta_merged_after_all_takes_its_work_out_of_what_is_owed(corpus):
    """Nothing out when the old holder's merge of s arrives: the work of s, given back to the learner,
    is not claimed again by the next delta."""
    pair = Pair(corpus)
    learner = pair.learner
    first = release_to_a_new_holder(pair)
    p = first.fragment
    assert learner.work[p].steps == first.work.steps
    learner.train_step()
    pair.apply(p, (("me", 1.0),), seqs=(first.seq,))
    learner.settle()
    assert learner.work[p].steps == 1 and learner.steps_merged > 0


def test_a_delta_taken_before_the_learner_saw_an_update_of_its_fragment_goes_back_at_once(corpus):
    """The owner thread applied an update of p between the learner's last step boundary and the delta
    reaching it: the delta's anchor and theta-at-send are stale, so it goes back whole and is taken again
    at the next step, anchored on the new version."""
    pair = Pair(corpus)
    learner = pair.learner
    due = pair.train_until_delta(route=False)
    p = due.fragment
    pair.apply(p, (("other", 1.0),))
    assert not pair.route(due) and p not in pair.outbox.in_flight
    learner.settle()
    assert p not in learner.out and p in learner.urgent and learner.deltas_rejected == 0
    assert learner.work[p].steps == due.work.steps
    learner.train_step()
    again = pair.take()
    assert (
        again is not None and again.fragment == p and again.header.anchor_version == 1 and pair.route(again)
    )


def test_a_resend_taken_before_the_released_delta_was_merged_comes_back_without_its_work(corpus):
    pair = Pair(corpus)
    learner = pair.learner
    first = release_to_a_new_holder(pair)
    learner.train_step()
    resent = pair.take()
    assert resent is not None and resent.fragment == first.fragment
    pair.apply(first.fragment, (("me", 1.0),), seqs=(first.seq,))  # before the resend reached the outbox
    assert not pair.route(resent)
    learner.settle()
    assert first.fragment not in learner.out
    assert learner.work[first.fragment].steps == resent.work.steps - first.work.steps == 1


def test_a_snapshot_reload_voids_the_delta_in_flight_on_both_threads(corpus):
    pair = Pair(corpus)
    learner = pair.learner
    due = pair.train_until_delta()
    p = due.fragment
    pair.outbox.on_reload(Reload({p: (pair.replica.version(p), pair.replica.params_view(p))}))
    learner.settle()
    assert p not in pair.outbox.in_flight and p not in learner.out and learner.work[p].steps == 0
    pair.refuse(due)  # a late refusal of the voided delta
    learner.settle()
    assert learner.work[p].steps == 0 and learner.deltas_rejected == 0


def test_an_update_with_another_seq_of_mine_does_not_count_as_my_in_flight_delta(corpus):
    pair = Pair(corpus)
    due = pair.train_until_delta()
    p = due.fragment
    kept = pair.outbox.in_flight[p]
    pair.apply(p, (("me", 1.0),), seqs=(due.seq + 7,))
    pair.learner.settle()
    assert pair.outbox.in_flight[p] is kept and pair.learner.out == {p: due.seq}  # merged some other delta
