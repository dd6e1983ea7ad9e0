"""Contributions scored by loss (issue #41 item 2, `protocol.loss_score`, `model.probe`): each delta of a closing
round is measured on a batch of held-out windows drawn from the round's seed (its fragment, version, term and
the digests of all its deltas), so it differs from round to round and record to record and is the same given
them; a delta that makes the loss worse beyond the noise of that batch is refused `loss worse` (counted, an
offence) and lowers its key's score, a helpful one raises it; a negative score caps the key's merge weight
(min(earned weight, score cap)) and puts the key behind the others in a union round's gather order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.data import load_corpus
from p2p_diloco.model.probe import LossProbe, draw_starts, loss_probe_for
from p2p_diloco.protocol.decisions import Action
from p2p_diloco.protocol.gather import gather_order
from p2p_diloco.protocol.loss_score import (
    SCORE_FLOOR,
    LossChange,
    LossScores,
    capped,
    judge_round,
    score_factor,
    score_seed,
)
from p2p_diloco.protocol.messages import DeltaHeader
from p2p_diloco.protocol.robust import RobustGuard
from p2p_diloco.protocol.robust_config import RobustConfig, RobustTag
from p2p_diloco.protocol.standing import Earned, Standing
from p2p_diloco.protocol.sync_round import Contribution
from p2p_diloco.swarm.synchronizer import Synchronizer
from p2p_diloco.wire.codecs.codec import encode_tensors
from p2p_diloco.wire.frames import encode_delta
from tests.support.manifests import tiny_manifest, tiny_training

ON = tiny_manifest("score", robust=RobustConfig(loss_check="on"))
FULL = 4 * 2 * 8  # H x batch x block of the tiny manifest: a full claim's tokens


def test_the_batch_differs_per_round_and_record_and_is_deterministic_given_them():
    digests = [b"a" * 16, b"b" * 16]
    seed = score_seed("run", 0, 7, 2, digests)
    assert seed == score_seed("run", 0, 7, 2, reversed(digests))  # the round's deltas, in any order
    others = {
        score_seed("run", 0, 8, 2, digests),  # the next version
        score_seed("run", 0, 7, 3, digests),  # another term
        score_seed("run", 1, 7, 2, digests),  # another fragment
        score_seed("run", 0, 7, 2, [b"a" * 16, b"c" * 16]),  # another record
        score_seed("other", 0, 7, 2, digests),
    }
    assert seed not in others and len(others) == 5
    t = tiny_training(ON)
    probe = loss_probe_for(ON, t.replica, load_corpus(ON.data).eval)
    assert isinstance(probe, LossProbe) and probe.windows == ON.robust.score_batch
    batch = probe.batch(seed)
    assert batch.shape == (ON.robust.score_batch, ON.model.block_size + 1)
    assert torch.equal(batch, probe.batch(seed))  # deterministic given the round
    for other in others:
        assert not torch.equal(batch, probe.batch(other))  # not a fixed set of windows
    salted = loss_probe_for(ON, t.replica, load_corpus(ON.data).eval, salt=b"secret")
    assert salted is not None and not torch.equal(batch, salted.batch(seed))  # a real peer's secret salt
    starts = draw_starts(seed, b"", 64, 10_000)
    assert starts.min() >= 0 and starts.max() <= 10_000 and len(set(starts.tolist())) > 50


def change(mean: float, stderr: float, base: float = 5.0) -> LossChange:
    return LossChange(base=base, mean=mean, stderr=stderr, windows=16)


def test_a_delta_worse_beyond_the_noise_of_its_batch_is_refused_and_values_are_gains_per_claimed_token():
    verdicts = judge_round(
        [
            change(-0.05, 0.005),  # helps, as the round's others
            change(-0.05, 0.005),
            change(-0.0125, 0.002),  # the same gain per token as them, for a quarter of the tokens
            change(-0.0125, 0.002),  # a quarter of their gain, claiming as many tokens
            change(0.02, 0.005),  # +0.4 %: under the 2 % tolerance, but 4 standard errors worse
            change(0.2, 0.1),  # +4 %: over the tolerance, whatever the noise
            change(0.01, 0.005),  # +2 standard errors: within the noise
        ],
        [FULL, FULL, FULL // 4, FULL, FULL, FULL, FULL],
        full_tokens=FULL,
        z=3.0,
        tolerance=0.02,
    )
    tags = [v.decision.tag for v in verdicts]
    assert [v.decision.action for v in verdicts[:4]] == [Action.ACCEPT] * 4
    assert tags[4:6] == [RobustTag.LOSS_WORSE, RobustTag.LOSS_CHECK]
    assert verdicts[4].value == verdicts[5].value == -1.0
    assert "4.0 standard errors" in verdicts[4].decision.detail
    assert verdicts[0].value == verdicts[2].value == 1.0
    assert verdicts[3].value == pytest.approx(0.25)  # claimed work it did not do scores less
    assert verdicts[6].decision.action == Action.ACCEPT and -1.0 < verdicts[6].value < 0
    # once gains sink into the noise, values are z-scores over score_z
    quiet = judge_round(
        [change(-0.001, 0.001), change(0.001, 0.001)], [FULL, FULL], full_tokens=FULL, z=3.0, tolerance=0.02
    )
    assert [v.value for v in quiet] == pytest.approx([1 / 3, -1 / 3])


def descent(
    manifest: RunManifest, probe: LossProbe, names: list[str], scale: float
) -> dict[str, torch.Tensor]:
    """The held-out loss gradient of the global model on `names`, each tensor at `scale` x 2e-3 RMS: as an outer
    step it lowers the loss on any batch (a negative `scale` raises it)."""
    model = probe.model
    model.zero_grad()
    block = manifest.model.block_size
    data = probe.eval_data
    windows = torch.stack([data[i : i + block + 1] for i in range(0, 256 * block, block)]).long()
    with torch.enable_grad():
        _, loss = model(windows[:, :-1], windows[:, 1:])
        loss.backward()
    params = dict(model.named_parameters())
    grads = {n: params[n].grad.detach().clone() for n in names}
    return {n: g * (scale * 2e-3 / max(float(g.pow(2).mean().sqrt()), 1e-12)) for n, g in grads.items()}


def frame(manifest: RunManifest, tensors: dict[str, torch.Tensor], seq: int, tokens: int = FULL) -> bytes:
    wire = manifest.wire
    payload = encode_tensors(tensors, codec=wire.codec, block_size=wire.block_size)
    steps = tokens // (manifest.diloco.batch_size * manifest.model.block_size)
    header = DeltaHeader(manifest.run_id, manifest.manifest_hash, 0, 0, tokens=tokens, steps=steps, seq=seq)
    return encode_delta(header, payload)


def test_a_harmful_delta_is_refused_with_its_reason_and_lowers_its_keys_score_and_weight():
    t = tiny_training(ON)
    probe = loss_probe_for(ON, t.replica, load_corpus(ON.data).eval)
    assert probe is not None
    shapes = {n: tuple(p.shape) for n, p in t.model.named_parameters()}
    sync = Synchronizer("me", ON, t.plan, t.replica, term=1, shapes=shapes)
    sync.guard.loss_probe = probe
    names = t.plan.names(0)
    probe.measure([{}], b"load")  # loads the global model into the probe's copy
    helpful, harmful = descent(ON, probe, names, 4.0), descent(ON, probe, names, -1.0)
    assert sync.offer_delta("good", frame(ON, helpful, 1), 0.0).ok
    assert sync.offer_delta("bad", frame(ON, harmful, 1), 0.0).ok
    (outcome,) = sync.poll(30.0, frozenset({"good", "bad"}), cap=0.0)
    assert sync.rejections[RobustTag.LOSS_WORSE] == 1  # under the 2 % tolerance, beyond the batch's noise
    assert sync.rejections_by_sender[("bad", RobustTag.LOSS_WORSE)] == 1
    assert sync.guard.rejected[("bad", RobustTag.LOSS_WORSE)] == 1  # reported to the guard
    assert any("loss worse" in line and "bad" in line for line in sync.decisions)
    assert [who for who, _ in outcome.record.contributors] == ["good"]
    scores = sync.guard.scores
    assert scores.score("bad") == pytest.approx(-(1 - ON.robust.score_decay))
    assert scores.score("good") > 0 and scores.score("never") == 0.0
    assert probe.calls == 3  # the holder scores each delta once (+ the loading call above)
    # the next round: "good" helps again, "bad" sends a delta that does nothing; it weighs what its score allows
    sync.rounds.abort(0)  # (the replica never applied it: the next round is at the same version)
    assert sync.offer_delta("good", frame(ON, descent(ON, probe, names, 2.0), 2), 40.0).ok
    assert sync.offer_delta(
        "bad", frame(ON, {n: torch.zeros_like(g) for n, g in helpful.items()}, 2), 40.0
    ).ok
    (second,) = sync.poll(70.0, frozenset({"good", "bad"}), cap=0.0)
    weights = dict(second.record.contributors)
    assert scores.score("bad") == pytest.approx(-0.21) and scores.score("good") > 0
    assert weights["bad"] == pytest.approx(weights["good"] * 0.79, rel=1e-6)  # equal claims


def test_the_score_caps_weight_and_takes_nothing_from_keys_at_or_above_zero():
    scores = LossScores(decay=0.5, forget_after=100.0)
    scores.note("bad", -1.0, 0.0)  # -0.5
    scores.note("good", 1.0, 0.0)
    assert scores.factor("bad") == 0.5 and scores.factor("good") == scores.factor("new") == 1.0
    assert score_factor(-5.0) == SCORE_FLOOR
    s = Standing(new_peer_rounds=4, active_window=60.0, newcomer_grace=60.0)
    claims = [("bad", 100.0), ("good", 100.0), ("new", 100.0)]
    assert s.earned(claims) == Earned((100.0, 100.0, 100.0), 3.0)  # no history: founders' claims
    assert capped(s.earned(claims), claims, scores.factor) == Earned(
        (50.0, 100.0, 100.0), 2.5
    )  # half a learner
    for _ in range(4):
        s.note_merged(["good", "bad"], 1.0)
    # "new" is on its ramp (1/5 of the median); the score caps "bad": min(earned, score cap) for each
    assert capped(s.earned(claims), claims, scores.factor).weights == (50.0, 100.0, 20.0)
    scores.note("new", -1.0, 0.0)  # -0.5: its score cap (50) is above its earned weight (20)
    assert capped(s.earned(claims), claims, scores.factor).weights == (50.0, 100.0, 20.0)
    scores.note("good", 0.0, 500.0)  # memory is bounded: keys not scored within forget_after are forgotten
    assert len(scores) == 1 and scores.score("bad") == 0.0


def test_the_gather_order_puts_keys_with_a_negative_score_last_and_weighs_by_the_score_cap():
    deltas = [Contribution(w, 0, FULL, 4, 0.0, None, seq=1) for w in ("a", "b", "c")]
    scores = LossScores(decay=0.5, forget_after=100.0)
    waits = {"a": 0.0, "b": 5.0, "c": 5.0}.__getitem__  # a has waited longest
    order = gather_order(deltas, waiting_since=waits, ramp=lambda _: 1.0, fragment=0, version=3)
    assert [d.sender for d in order][0] == "a"
    scores.note("a", -0.2, 0.0)
    order = gather_order(
        deltas, waiting_since=waits, ramp=lambda _: 1.0, fragment=0, version=3, score=scores.score
    )
    assert [d.sender for d in order][-1] == "a"  # behind every key whose score is not negative
    # on an equal wait, within a band, the greater weight first: tokens x ramp x score cap
    scores.note("c", -0.1, 0.0)  # -0.05: factor 0.95, while a's is 0.9
    order = gather_order(
        deltas, waiting_since=lambda _: 5.0, ramp=lambda _: 1.0, fragment=0, version=3, score=scores.score
    )
    assert [d.sender for d in order] == ["b", "c", "a"]


def test_score_batch_is_a_validated_knob_with_a_clear_error():
    assert RobustConfig().score_batch == 16
    raw = {"run_id": "x", "robust": {"score_batch": 64, "score_z": 2.5, "score_decay": 0.5}}
    m = RunManifest.from_dict(raw)
    assert (m.robust.score_batch, m.robust.score_z, m.robust.score_decay) == (64, 2.5, 0.5)
    for bad in (1, 0, 1025):
        with pytest.raises(ConfigError, match=r"\[robust\] score_batch = .*batch's noise needs two"):
            RunManifest.from_dict({"run_id": "x", "robust": {"score_batch": bad}})
    with pytest.raises(ConfigError, match=r"score_decay"):
        RunManifest.from_dict({"run_id": "x", "robust": {"score_decay": 1.0}})
    small = dataclasses.replace(ON, robust=dataclasses.replace(ON.robust, score_batch=4))
    t = tiny_training(small)
    probe = loss_probe_for(small, t.replica, load_corpus(small.data).eval)
    assert probe is not None and len(probe.batch(b"x")) == 4


def test_loss_worse_is_a_statistical_call_three_within_the_offence_window_count_as_one_offence():
    guard = RobustGuard(RobustConfig(offence_limit=1), tokens_per_step=16, inner_steps=4, inner_lr=1e-3)
    assert guard.note_rejection("k", RobustTag.LOSS_WORSE, 0.0) is None  # honest deltas hit it now and then
    assert guard.note_rejection("k", RobustTag.LOSS_WORSE, 1.0) is None
    started = guard.note_rejection("k", RobustTag.LOSS_WORSE, 2.0)
    assert (
        started is not None
        and started.tag == RobustTag.COOL_DOWN_STARTED
        and "3 loss worse refusals" in started.detail
    )
    assert guard.note_rejection("j", RobustTag.LOSS_CHECK, 0.0) is not None  # over the tolerance: an offence
