"""The learner's adoption rule and in-flight bookkeeping, on a tiny model with a hand-made replica.

The test plays the peer: it applies updates to the replica and posts `Adopt`/`Release` messages to the
learner's inbox, which the learner handles at its next step boundary."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import load_corpus
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm.effects import Adopt, Release, SendGate
from p2p_diloco.swarm.learner import Learner
from tests.support.manifests import TINY_DILOCO, tiny_manifest, tiny_training


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(RunManifest(run_id="t").data)


def make(corpus, adoption="carry", **diloco):
    manifest = tiny_manifest("t", diloco=dataclasses.replace(TINY_DILOCO, adoption=adoption, **diloco))
    t = tiny_training(manifest, corpus=corpus)
    learner = Learner("me", manifest, t.plan, t.replica, t.model, t.optimizer, t.sampler)
    return learner, t.replica, t.plan


def train_until_delta(learner):
    for _ in range(20):
        learner.train_step()
        due = learner.take_due(now=float(learner.step))
        if due is not None:
            return due
    raise AssertionError("no fragment became due")


def adopt_message(replica, p, contributors, scale=0.5):
    """Apply an update of fragment `p` to the replica, as the peer does; the message it posts."""
    old = replica.params_view(p)
    grad = {n: torch.full_like(t, scale) for n, t in old.items()}
    pending = replica.compute_update(p, grad, lr=0.7, momentum=0.9)
    assert replica.commit(pending).action == "apply"
    record = UpdateRecord("t", "x", p, pending.from_version, 1, "sync", contributors, pending.checksum, b"")
    return Adopt(record, old, replica.params_view(p), record.to_version)


def theta(learner, p):
    return {n: learner.params[n].detach().clone() for n in learner.plan.names(p)}


def test_delta_is_anchor_minus_theta_and_counts_work(corpus):
    learner, replica, _ = make(corpus)
    due = train_until_delta(learner)
    p, header = due.fragment, due.header
    assert header.fragment == p and header.anchor_version == 0 and header.seq == due.seq == learner.seq
    assert header.steps == learner.step and header.tokens == learner.step * 2 * 8
    for n, t in replica.params_view(p).items():
        torch.testing.assert_close(due.delta[n], t - learner.params[n].detach())
    assert p in learner.sent and learner.work[p].steps == 0


def test_carry_keeps_progress_made_after_sending(corpus):
    learner, replica, _ = make(corpus)
    p = train_until_delta(learner).fragment
    at_send = learner.sent[p].theta_at_send
    learner.train_step()
    before = theta(learner, p)
    learner.inbox.put(adopt_message(replica, p, (("me", 1.0),)))
    learner.settle()
    new_global = replica.params_view(p)
    for n in before:
        torch.testing.assert_close(learner.params[n].detach(), new_global[n] + (before[n] - at_send[n]))
    assert p not in learner.sent and learner.work[p].steps == 1
    assert learner.steps_merged > 0 and learner.anchors[p][0] == 1


def test_overwrite_takes_the_global_fragment_exactly(corpus):
    learner, replica, _ = make(corpus, adoption="overwrite")
    p = train_until_delta(learner).fragment
    learner.train_step()
    learner.inbox.put(adopt_message(replica, p, (("me", 1.0),)))
    learner.settle()
    for n, t in replica.params_view(p).items():
        assert torch.equal(learner.params[n].detach(), t)
    assert learner.work[p].steps == 0


def test_others_merge_shifts_theta_by_the_global_change(corpus):
    learner, replica, _ = make(corpus)
    learner.train_step()
    q = 0
    before = theta(learner, q)
    old = replica.params_of(q)
    learner.inbox.put(adopt_message(replica, q, (("other", 1.0),)))
    learner.settle()
    new = replica.params_view(q)
    for n in before:
        torch.testing.assert_close(learner.params[n].detach(), before[n] + (new[n] - old[n]))
    assert learner.work[q].steps == 1  # the local work is still owed to the swarm


def test_a_released_delta_returns_its_work_and_a_stale_release_changes_nothing(corpus):
    learner, _, _ = make(corpus)
    due = train_until_delta(learner)
    p, sent_steps = due.fragment, learner.sent[due.fragment].steps
    learner.inbox.put(Release(p, due.seq + 1))  # not the delta in flight: ignored
    learner.settle()
    assert p in learner.sent and learner.deltas_rejected == 0
    learner.inbox.put(Release(p, due.seq))
    learner.settle()
    assert p not in learner.sent and learner.work[p].steps == sent_steps and learner.deltas_rejected == 1


def test_a_message_posted_mid_step_takes_effect_at_the_step_boundary_as_if_at_once(corpus):
    """The peer's owner thread posts while the training thread steps: nothing moves mid-step, and the
    result equals a twin that got the same message right after the same step."""
    import threading

    learner, replica, _ = make(corpus)
    twin, twin_replica, _ = make(corpus)  # same weights, same batches
    next_batch = learner.sampler.next_batch

    def next_batch_while_an_update_lands():
        before = theta(learner, 0)
        poster = threading.Thread(target=lambda: learner.inbox.put(adopt_message(replica, 0, [("o", 1.0)])))
        poster.start()
        poster.join(timeout=30)
        assert not poster.is_alive()  # posting never waits for the step
        assert all(torch.equal(before[n], learner.params[n]) for n in before)  # nothing moved mid-step
        return next_batch()

    learner.sampler.next_batch = next_batch_while_an_update_lands
    learner.train_step()
    twin.train_step()
    twin.inbox.put(adopt_message(twin_replica, 0, [("o", 1.0)]))
    learner.settle()
    twin.settle()
    for p in range(2):
        assert all(torch.equal(a, b) for a, b in zip(theta(learner, p).values(), theta(twin, p).values()))


def test_messages_are_handled_in_the_order_posted(corpus):
    """An adoption of an own merge posted before a release of the same delta wins; after it, not."""
    learner, replica, _ = make(corpus)
    due = train_until_delta(learner)
    p = due.fragment
    learner.inbox.put(adopt_message(replica, p, (("me", 1.0),)))
    learner.inbox.put(Release(p, due.seq))  # the delta was merged first: nothing left to release
    learner.settle()
    assert p not in learner.sent and learner.deltas_rejected == 0 and learner.steps_merged > 0


def test_take_due_follows_the_schedule_and_waits_while_the_gate_is_shut(corpus):
    learner, _, _ = make(corpus)  # H = 4, P = 2: sends due at steps 2 (fragment 1), 4 (0), 6 (1), ...
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


def with_seqs(message: Adopt, *seqs: int) -> Adopt:
    return dataclasses.replace(message, record=dataclasses.replace(message.record, seqs=seqs))


def test_a_released_delta_goes_out_again_at_once_carrying_its_seq(corpus):
    learner, _, _ = make(corpus)
    first = train_until_delta(learner)
    p = first.fragment
    learner.inbox.put(Release(p, first.seq, resend=True))  # a new synchronizer took over
    learner.train_step()
    again = learner.take_due(now=float(learner.step))  # not its turn in the round robin, sent anyway
    assert again is not None and again.fragment == p and again.seq > first.seq
    assert again.header.since_seq == first.seq  # it repeats the released delta's work
    assert again.header.steps == first.header.steps + 1


def test_an_update_that_merged_a_released_delta_is_adopted_as_own_and_its_resend_dropped(corpus):
    """The double count at a term change: the old holder merges delta s after the learner took it back
    and resent its work in s'. The learner recognises s by its seq: theta keeps only the progress made
    since s was sent, s' is dropped (synchronizers refuse it as "already merged"), and what s' carried
    beyond s goes out with the next delta."""
    learner, replica, _ = make(corpus)
    first = train_until_delta(learner)
    p = first.fragment
    at_send = {n: t.clone() for n, t in learner.sent[p].theta_at_send.items()}
    learner.inbox.put(Release(p, first.seq, resend=True))
    learner.train_step()
    resent = learner.take_due(now=float(learner.step))
    assert resent is not None and resent.header.since_seq == first.seq
    learner.train_step()
    before = theta(learner, p)
    learner.inbox.put(with_seqs(adopt_message(replica, p, (("me", 1.0),)), first.seq))
    learner.settle()
    new_global = replica.params_view(p)
    for n in before:
        torch.testing.assert_close(learner.params[n].detach(), new_global[n] + (before[n] - at_send[n]))
    assert p not in learner.sent and p not in learner.released
    assert learner.work[p].steps == 2  # the step in the dropped resend beyond s, and the one after it
    nxt = learner.take_due(now=float(learner.step))
    assert nxt is not None and nxt.fragment == p and nxt.header.since_seq == 0
    for n in before:  # exactly the work since s was sent, nothing of s itself
        torch.testing.assert_close(nxt.delta[n], new_global[n] - learner.params[n].detach())


def test_an_update_with_another_seq_of_mine_does_not_count_as_my_in_flight_delta(corpus):
    learner, replica, _ = make(corpus)
    p = train_until_delta(learner).fragment
    sent = learner.sent[p]
    learner.inbox.put(with_seqs(adopt_message(replica, p, (("me", 1.0),)), sent.seq + 7))
    learner.settle()
    assert learner.sent[p] is sent  # still in flight: that update merged some other delta
