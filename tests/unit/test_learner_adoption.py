"""The learner's adoption rule and in-flight bookkeeping, on a tiny model with a hand-made replica."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import DilocoConfig, ModelConfig, RunManifest
from p2p_diloco.model.data import BatchSampler, load_corpus
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.wire.frames import decode_delta

CFG = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(RunManifest(run_id="t").data)


def make(corpus, adoption="carry", **diloco):
    manifest = RunManifest(
        run_id="t",
        model=CFG,
        diloco=DilocoConfig(inner_steps=4, fragments=2, batch_size=2, adoption="overwrite", **diloco),
    )
    if adoption != "overwrite":
        manifest = dataclasses.replace(
            manifest, diloco=dataclasses.replace(manifest.diloco, adoption=adoption)
        )
    model = build_model(CFG)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = plan_fragments(shapes, 2)
    replica = GlobalReplica(plan, dict(model.named_parameters()))
    sampler = BatchSampler(corpus.train, block_size=8, batch_size=2, shard=0, num_shards=1, seed=0)
    learner = Learner("me", manifest, plan, replica, model, make_inner_optimizer(model, 1e-2, 0.0), sampler)
    return learner, replica, plan


def train_until_delta(learner):
    for _ in range(20):
        learner.train_step()
        due = learner.take_due_delta(now=float(learner.step))
        if due is not None:
            return due
    raise AssertionError("no fragment became due")


def apply_update(replica, learner, p, contributors, scale=0.5):
    old = replica.params_of(p)
    grad = {n: torch.full_like(t, scale) for n, t in old.items()}
    pending = replica.compute_update(p, grad, lr=0.7, momentum=0.9)
    assert (
        replica.apply(p, replica.version(p), grad, lr=0.7, momentum=0.9, expected_checksum=None).action
        == "apply"
    )
    record = UpdateRecord("t", "x", p, pending.from_version, 1, "sync", contributors, pending.checksum, b"")
    return learner.adopt(record, old)


def theta(learner, p):
    return {n: learner.params[n].detach().clone() for n in learner.plan.names(p)}


def test_delta_is_anchor_minus_theta_and_counts_work(corpus):
    learner, replica, _ = make(corpus)
    p, frame = train_until_delta(learner)
    header, _ = decode_delta(frame, max_bytes=1 << 20)
    assert header.fragment == p and header.anchor_version == 0
    assert header.steps == learner.step and header.tokens == learner.step * 2 * 8
    assert p in learner.sent and learner.work[p].steps == 0


def test_carry_keeps_progress_made_after_sending(corpus):
    learner, replica, _ = make(corpus)
    p, _ = train_until_delta(learner)
    at_send = learner.sent[p].theta_at_send
    learner.train_step()
    before = theta(learner, p)
    assert apply_update(replica, learner, p, (("me", 1.0),)) == "adopted own merge"
    new_global = replica.params_of(p)
    for n in before:
        torch.testing.assert_close(learner.params[n].detach(), new_global[n] + (before[n] - at_send[n]))
    assert p not in learner.sent and learner.work[p].steps == 1
    assert learner.steps_merged > 0


def test_overwrite_takes_the_global_fragment_exactly(corpus):
    learner, replica, _ = make(corpus, adoption="overwrite")
    p, _ = train_until_delta(learner)
    learner.train_step()
    apply_update(replica, learner, p, (("me", 1.0),))
    for n, t in replica.params_of(p).items():
        assert torch.equal(learner.params[n].detach(), t)
    assert learner.work[p].steps == 0


def test_others_merge_shifts_theta_by_the_global_change(corpus):
    learner, replica, plan = make(corpus)
    learner.train_step()
    q = 0
    before = theta(learner, q)
    old = replica.params_of(q)
    assert apply_update(replica, learner, q, (("other", 1.0),)) == "shifted by others' merge"
    new = replica.params_of(q)
    for n in before:
        torch.testing.assert_close(learner.params[n].detach(), before[n] + (new[n] - old[n]))
    assert learner.work[q].steps == 1  # the local work is still owed to the swarm


def test_rejected_delta_returns_its_work_and_is_resent(corpus):
    learner, _, _ = make(corpus)
    p, _ = train_until_delta(learner)
    sent_steps = learner.sent[p].steps
    assert learner.on_delta_reply(p, learner.seq, "stale anchor: a=0 v=9") is True
    assert p not in learner.sent and learner.work[p].steps == sent_steps
    assert learner.on_delta_reply(p, learner.seq, "stale anchor") is False  # nothing in flight any more


def test_accepted_reply_keeps_delta_in_flight_and_timeout_releases_it(corpus):
    learner, _, _ = make(corpus)
    p, _ = train_until_delta(learner)
    assert learner.on_delta_reply(p, learner.seq, "accepted: fragment 1") is False
    assert p in learner.sent
    sent_at = learner.sent[p].sent_at
    assert learner.expire_in_flight(sent_at + 1.0, timeout=5.0) == []
    assert learner.expire_in_flight(sent_at + 6.0, timeout=5.0) == [p]
    assert p not in learner.sent


def test_an_update_applied_mid_step_is_adopted_after_the_step_as_if_at_once(corpus):
    """A real peer trains without its peer lock: an update landing mid-step is queued, not waited for."""
    import threading

    learner, replica, _ = make(corpus)
    twin, twin_replica, _ = make(corpus)  # same weights, same batches: adopts the same update after its step
    replies: list[str] = []
    next_batch = learner.sampler.next_batch

    def next_batch_while_an_update_lands():
        before = theta(learner, 0)
        landing = threading.Thread(
            target=lambda: replies.append(apply_update(replica, learner, 0, [("o", 1.0)]))
        )
        landing.start()
        landing.join(timeout=30)
        assert not landing.is_alive()  # the applying thread did not wait for this step to end
        assert all(torch.equal(before[n], learner.params[n]) for n in before)  # nothing moved mid-step
        return next_batch()

    learner.sampler.next_batch = next_batch_while_an_update_lands
    learner.train_step()
    twin.train_step()
    assert replies == ["queued until the running step ends"]
    assert apply_update(twin_replica, twin, 0, [("o", 1.0)]) == "shifted by others' merge"
    for p in range(2):
        assert all(torch.equal(a, b) for a, b in zip(theta(learner, p).values(), theta(twin, p).values()))
    for name in ("train_step", "take_due_delta", "_on_refusal", "expire_in_flight", "settle"):
        assert getattr(Learner, name).__wrapped__  # every entry point adopts what was queued first


def test_an_acceptance_mid_step_is_handled_at_once_and_a_refusal_after_the_step(corpus):
    """The reply thread holds the peer lock: an acceptance must not wait for the running step."""
    import threading

    learner, _, _ = make(corpus)
    p, _ = train_until_delta(learner)
    seq, sent_steps = learner.seq, learner.sent[p].steps
    answers: list[bool] = []
    next_batch = learner.sampler.next_batch

    def next_batch_while_replies_arrive():
        accepted = threading.Thread(target=lambda: answers.append(learner.on_delta_reply(p, seq, "accepted")))
        accepted.start()
        accepted.join(timeout=30)
        assert not accepted.is_alive() and answers == [False]  # answered without the learner lock
        refused.start()  # needs the lock: handled once the step lets go of it
        return next_batch()

    refused = threading.Thread(target=lambda: answers.append(learner.on_delta_reply(p, seq, "stale anchor")))
    learner.sampler.next_batch = next_batch_while_replies_arrive
    learner.train_step()
    refused.join(timeout=30)
    assert answers == [False, True]
    assert p not in learner.sent and learner.work[p].steps == sent_steps + 1  # its work is owed again


def test_delta_pending_says_when_take_due_delta_may_have_a_frame(corpus):
    learner, _, _ = make(corpus)  # H = 4, P = 2: sends due at steps 2 (fragment 1), 4 (0), 6 (1), ...
    pending, frames = [], []
    for _ in range(6):
        learner.train_step()
        pending.append(learner.delta_pending())
        frames.append(learner.take_due_delta(now=float(learner.step)) is not None)
    assert pending == [False, True, False, True, False, True]
    assert frames == [False, True, False, True, False, False]  # step 6: fragment 1 is still in flight


def test_a_delta_taken_at_the_step_boundary_and_compressed_later_is_the_same_frame(corpus):
    learner, _, _ = make(corpus)
    twin, _, _ = make(corpus)
    for _ in range(2):
        learner.train_step()
        twin.train_step()
    due = learner.snapshot_due_delta(now=2.0)
    assert due is not None and due.fragment in learner.sent and learner.work[due.fragment].steps == 0
    learner.train_step()  # a real peer's next step runs before the send thread compresses
    assert learner.encode_due(due) == twin.take_due_delta(now=2.0)[1]  # compressed from the boundary's delta

    learner.train_step()
    again = learner.snapshot_due_delta(now=4.0)
    assert again is not None
    learner.expire_in_flight(now=5.0, timeout=0.0)  # the synchronizer changed before it went out
    assert learner.encode_due(again) is None  # not sent: its work is back in the counters
    assert learner.work[again.fragment].steps > 0
