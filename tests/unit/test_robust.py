"""Robust aggregation: each rule of protocol/robust.py on hand-made tensors, then wired into Synchronizer."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.config import ConfigError, DilocoConfig, RunManifest
from p2p_diloco.protocol import robust
from p2p_diloco.protocol.direction import cosine, cosine_matrix
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import DeltaHeader
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.robust import RobustConfig, RobustGuard
from p2p_diloco.protocol.sync_round import RoundTag
from p2p_diloco.swarm.synchronizer import Synchronizer
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import decode_delta, encode_delta
from p2p_diloco.wire.replies import ReplyStatus

LR, H, TPS = 1e-2, 8, 100
N = 4096  # elements of the test tensor: random noise has cosine ~ 1/64 with anything


def guard(**knobs) -> RobustGuard:
    return RobustGuard(RobustConfig(**knobs), tokens_per_step=TPS, inner_steps=H, inner_lr=LR)


def direction(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def delta(d: torch.Tensor, rms: float = LR) -> dict[str, torch.Tensor]:
    return {"w": d * (rms * math.sqrt(N) / float(d.norm()))}


@pytest.mark.parametrize(
    "knobs",
    [
        {"clip_factor": 0},
        {"clip_factor": 5, "reject_factor": 4},
        {"reference_decay": 1.0},
        {"round_min": 2},
    ],
)
def test_bad_config_is_refused(knobs):
    with pytest.raises(ConfigError):
        RobustConfig(**knobs)


def test_token_claims_must_match_batch_times_block():
    g = guard()
    assert g.check_counters(8 * TPS, 8).decision.action == robust.ACCEPT
    assert g.check_counters(8 * TPS + 5, 8).decision.action == robust.ACCEPT  # within 1 %
    inflated = g.check_counters(800 * TPS, 8)
    assert inflated.decision.action == robust.REJECT and inflated.decision.tag == robust.RobustTag.TOKEN_CLAIM


def test_step_claims_beyond_the_cap_are_clipped_with_their_tokens():
    check = guard(max_steps_factor=4).check_counters(100 * TPS, 100)
    assert check.decision.action == robust.CLIP and check.decision.tag == robust.RobustTag.STEP_CLAIM
    assert (check.steps, check.tokens) == (4 * H, 4 * H * TPS)


def test_for_the_merge_weight_no_claim_counts_more_than_h_steps():
    g = guard()
    inflated = g.check_counters(10**6 * TPS, 10**6, for_weight=True)  # the claim-inflation attack
    assert (inflated.decision.action, inflated.steps, inflated.tokens) == (robust.CLIP, H, H * TPS)
    honest = g.check_counters(H * TPS, H, for_weight=True)
    assert (honest.decision.action, honest.steps) == (robust.ACCEPT, H)
    assert g.check_counters(10**6 * TPS, 10**6).steps == 4 * H  # norms per step: up to max_steps


def test_replayed_payload_is_refused_per_sender_and_forgotten_after_memory():
    g = guard(replay_memory=2)
    assert g.check_replay("a", b"one").action == robust.ACCEPT
    assert (g.check_replay("a", b"one")).tag == robust.RobustTag.REPLAY
    assert g.check_replay("b", b"one").action == robust.ACCEPT
    g.check_replay("a", b"two")
    g.check_replay("a", b"three")
    assert g.check_replay("a", b"one").action == robust.ACCEPT


def test_adamw_prior_rejects_scaled_delta_without_any_history():
    g = guard()
    assert g.screen(0, delta(direction(0), rms=LR * 8), steps=8).decision.action == robust.ACCEPT
    scaled = g.screen(0, delta(direction(0), rms=LR * 8 * 100), steps=8).decision
    assert scaled.action == robust.REJECT and scaled.tag == robust.RobustTag.NORM_OUTLIER


def test_norms_are_clipped_or_rejected_relative_to_the_median_of_the_history():
    g = guard(min_history=3, clip_factor=4, reject_factor=10)
    for seed in range(3):  # one contribution per round (K = 1): the history spans rounds
        g.note_accepted(0, delta(direction(seed), rms=LR / 10), steps=8)
    median = LR / 10 * math.sqrt(N)  # of 8-step deltas
    ok = g.screen(0, delta(direction(5), rms=LR / 5), steps=8)
    assert ok.decision.action == robust.ACCEPT
    clipped = g.screen(0, delta(direction(6), rms=LR / 10 * 6), steps=8)
    assert clipped.decision.action == robust.CLIP and clipped.decision.tag == robust.RobustTag.NORM_CLIPPED
    assert float(clipped.tensors["w"].norm()) == pytest.approx(4 * median, rel=1e-4)
    rejected = g.screen(0, delta(direction(7), rms=LR / 10 * 20), steps=8).decision
    assert rejected.action == robust.REJECT and rejected.tag == robust.RobustTag.NORM_OUTLIER
    assert g.screen(1, delta(direction(7), rms=LR / 10 * 20), steps=8).decision.action == robust.ACCEPT


def test_norms_are_compared_per_step_so_long_honest_deltas_pass():
    g = guard(min_history=3, clip_factor=4, reject_factor=10)
    small = LR / 10
    for seed in range(3):  # a throttled learner's 2-step deltas set the history
        g.note_accepted(0, delta(direction(seed), rms=small), steps=2)
    # a fast learner's 30-step delta at the same rate per step: 15x the norm, per step the same
    assert g.screen(0, delta(direction(5), rms=small * 15), steps=30).decision.action == robust.ACCEPT
    # the same norm claimed as 2 steps is 15x the median per step: refused
    short = g.screen(0, delta(direction(5), rms=small * 15), steps=2).decision
    assert short.action == robust.REJECT and "per step" in short.reason
    # claiming more steps than max_steps_factor x H widens nothing: counted as 32 steps
    huge = g.screen(0, delta(direction(6), rms=small * 200), steps=10_000).decision
    assert huge.action == robust.REJECT and "in 32 steps" in huge.reason


def warm(g: RobustGuard, d: torch.Tensor, updates: int = 3) -> None:
    for i in range(updates):
        g.observe_update(0, delta(d + 0.3 * direction(100 + i)))


def test_direction_needs_a_reference_then_drops_sign_flips_and_noise():
    g = guard()
    d = direction(1)
    assert (g.screen(0, delta(-d), steps=8).decision).tag == robust.RobustTag.NO_REFERENCE
    warm(g, d)
    assert g.screen(0, delta(d + direction(2)), steps=8, sender="honest").decision.action == robust.ACCEPT
    flipped = g.screen(0, delta(-d), steps=8, sender="flip").decision
    assert flipped.action == robust.REJECT and flipped.tag == robust.RobustTag.DIRECTION_OUTLIER
    noise = g.screen(0, delta(direction(3)), steps=8, sender="noise").decision
    assert noise.tag == robust.RobustTag.DIRECTION_OUTLIER


def test_one_off_direction_of_an_honest_sender_is_tolerated_by_the_window():
    g = guard(direction_window=5)
    d = direction(1)
    warm(g, d)
    for i in range(4):
        assert g.screen(0, delta(d + direction(10 + i)), steps=8, sender="h").decision.action == robust.ACCEPT
    assert g.screen(0, delta(direction(20)), steps=8, sender="h").decision.action == robust.ACCEPT
    assert g.screen(0, delta(direction(21)), steps=8, sender="new").decision.action == robust.REJECT


def test_reference_is_reset_when_two_senders_in_a_row_disagree():
    g = guard()
    warm(g, direction(1))
    assert g.screen(0, delta(direction(2)), steps=8, sender="a").decision.action == robust.REJECT
    assert g.screen(0, delta(direction(2)), steps=8, sender="b").decision.action == robust.REJECT
    assert (
        g.screen(0, delta(direction(2)), steps=8, sender="c").decision
    ).tag == robust.RobustTag.NO_REFERENCE


@pytest.mark.parametrize("bad", ["flip", "noise"])
def test_round_drops_the_delta_that_disagrees_with_most_others(bad):
    g = guard()
    d = direction(1)
    honest = [delta(d + 1.5 * direction(10 + i)) for i in range(3)]  # pairwise cosine about 0.3
    outlier = delta(-d - 1.5 * direction(20)) if bad == "flip" else delta(direction(20))
    for deltas in (honest[:2] + [outlier], honest + [outlier]):
        verdicts = g.screen_round(deltas)
        assert [v.action for v in verdicts] == [robust.ACCEPT] * (len(deltas) - 1) + [robust.REJECT]
        assert verdicts[-1].tag == robust.RobustTag.DIRECTION_OUTLIER
    assert [v.action for v in g.screen_round([honest[0], outlier])] == [robust.ACCEPT] * 2


def test_offences_within_the_window_start_a_cool_down_that_ends():
    g = guard(offence_limit=3, offence_window=10.0, cooldown=60.0)
    assert g.note_rejection("m", robust.RobustTag.NORM_OUTLIER, 0.0) is None
    assert g.note_rejection("m", robust.RobustTag.NORM_OUTLIER, 20.0) is None  # the first one left the window
    assert g.note_rejection("m", "stale anchor", 21.0) is None  # honest peers lag: not an offence
    assert g.note_rejection("m", robust.RobustTag.REPLAY, 22.0) is None
    started = g.note_rejection("m", "non-finite", 23.0)
    assert started is not None and started.tag == robust.RobustTag.COOL_DOWN_STARTED
    assert g.cooling(24.0) == {"m"} and g.cooldowns == [(23.0, "m", "non-finite")]
    assert (g.admit("m", 82.9)).tag == robust.RobustTag.COOL_DOWN
    assert g.admit("m", 83.0).action == robust.ACCEPT and g.cooling(83.0) == frozenset()
    assert g.admit("other", 30.0).action == robust.ACCEPT
    assert g.rejected[("m", "stale anchor")] == 1


def test_disabled_guard_accepts_everything_and_never_cools_down():
    g = guard(enabled=False)
    warm(g, direction(1))
    assert g.screen(0, delta(direction(1), rms=1.0), steps=8).decision.action == robust.ACCEPT
    assert g.check_counters(10**6, 1).decision.action == robust.ACCEPT
    assert all(g.note_rejection("m", robust.RobustTag.NORM_OUTLIER, float(t)) is None for t in range(10))


# ---- wired into the synchronizer ------------------------------------------------------------------

SHAPES = {"w": (64, 64)}


def make_sync(**manifest_kw) -> Synchronizer:
    manifest = RunManifest(
        run_id="r", diloco=DilocoConfig(inner_steps=8, fragments=1, batch_size=2, inner_lr=LR), **manifest_kw
    )
    plan = plan_fragments(list(SHAPES.items()), 1)
    replica = GlobalReplica(plan, {"w": torch.zeros(64, 64)})
    config = RobustConfig(offence_limit=2, offence_window=100.0, cooldown=50.0)
    return Synchronizer(
        "sync",
        manifest,
        plan,
        replica,
        term=1,
        shapes=SHAPES,
        guard=RobustGuard.from_manifest(manifest, config),
    )


def frame(sync: Synchronizer, scale: float, seq: int, tokens_per_step: int | None = None) -> bytes:
    tps = tokens_per_step or sync.manifest.diloco.batch_size * sync.manifest.model.block_size
    shared = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))  # honest deltas roughly agree
    w = (shared + torch.randn(64, 64, generator=torch.Generator().manual_seed(seq))) * LR * scale
    m = sync.manifest
    header = DeltaHeader(m.run_id, m.manifest_hash, 0, 0, tokens=8 * tps, steps=8, seq=seq)
    return encode_delta(header, encode_tensors({"w": w}))


def test_synchronizer_rejects_with_robust_reasons_and_cools_the_sender_down():
    sync = make_sync()
    assert sync.offer_delta("mallory", frame(sync, 1000, 1), 1.0).tag == robust.RobustTag.NORM_OUTLIER
    assert (
        sync.offer_delta("mallory", frame(sync, 1, 2, tokens_per_step=10**4), 2.0).tag
        == robust.RobustTag.TOKEN_CLAIM
    )
    assert sync.offer_delta("mallory", frame(sync, 1, 3), 3.0).tag == robust.RobustTag.COOL_DOWN
    assert sync.rejections_by_sender[("mallory", robust.RobustTag.NORM_OUTLIER)] == 1
    assert sync.rejections_by_sender[("mallory", robust.RobustTag.COOL_DOWN)] == 1
    assert any(line.startswith(robust.RobustTag.COOL_DOWN_STARTED) for line in sync.decisions)
    honest = sync.offer_delta("alice", frame(sync, 1, 4), 4.0)
    assert honest.tag == RoundTag.OPENED_ROUND
    assert sync.offer_delta("alice", frame(sync, 1, 4), 5.0).tag == robust.RobustTag.REPLAY
    # The round does not wait for a sender cooling down (grace window of 10 s ends early) ...
    sync.rounds.observe_step_time(5.0)
    (outcome,) = sync.poll(6.0, frozenset({"alice", "mallory"}), cap=10.0)
    assert [c for c, _ in outcome.record.contributors] == ["alice"]
    assert outcome.decision.tag == RoundTag.GRACE_ENDED_EARLY
    # ... but still counts as live in the outer scaling (1 contributor of 2 live): cool-downs keep the step size.
    merged = decode_tensors(outcome.record.payload)["w"]
    sent = decode_tensors(decode_delta(frame(sync, 1, 4), max_bytes=1 << 30)[1])["w"]
    assert float(merged.norm()) == pytest.approx(float(sent.norm()) / 2, rel=0.02)


def test_rounds_of_a_fragment_without_reference_gather_three_deltas_or_wait_it_out():
    sync = make_sync()
    live = frozenset({"a", "b", "c"})
    assert sync.offer_delta("a", frame(sync, 1, 1), 0.0).tag == RoundTag.OPENED_ROUND
    assert sync.poll(1.0, live, cap=0.0) == []  # waits for a first update screened by the round
    sync.offer_delta("b", frame(sync, 1, 2), 1.0)
    sync.offer_delta("c", frame(sync, 1, 3), 2.0)
    (outcome,) = sync.poll(2.0, live, cap=0.0)
    assert len(outcome.record.contributors) == 3
    sync.replica.apply(0, 0, {"w": torch.zeros(64, 64)}, lr=1.0, momentum=0.0, expected_checksum=None)
    sync.finish(0, 0.0)  # still no reference (no update observed): the next round waits too
    sync.offer_delta("a", frame(sync, 1, 4), 3.0)
    assert sync.poll(3.0 + sync.guard.config.warmup_wait - 0.1, live, cap=0.0) == []
    (alone,) = sync.poll(3.0 + sync.guard.config.warmup_wait, live, cap=0.0)
    assert [c for c, _ in alone.record.contributors] == ["a"]


def test_a_terms_synchronizer_refuses_an_undecodable_frame_with_its_decoding_tag():
    # senders are admitted once, before this (`SynchronizerRole.handle_delta`: test_fuzz_handlers)
    refused = make_sync(allowlist=("alice",)).offer_delta("alice", b"garbage", 1.0)
    assert refused.status == ReplyStatus.REFUSED and refused.tag == "bad magic"


def test_synchronizer_never_screens_or_cools_down_its_own_deltas():
    sync = make_sync()
    for t in range(3):  # an offence record against itself (e.g. from an earlier term) changes nothing
        sync.guard.note_rejection("sync", robust.RobustTag.NORM_OUTLIER, float(t))
    assert "sync" in sync.guard.cooling(3.0)
    # 30 x the honest scale: a norm another sender could not get accepted
    assert sync.offer_delta("sync", frame(sync, 30, 1), 4.0).tag == RoundTag.OPENED_ROUND
    assert sync.offer_delta("mallory", frame(sync, 1000, 2), 4.0).tag == robust.RobustTag.NORM_OUTLIER


def test_a_direction_outlier_alone_is_no_offence_but_repeated_ones_are():
    g = guard(offence_limit=2, direction_offence_limit=3, offence_window=30.0)
    # spread out (an honest learner after a failover now and then): never an offence
    assert all(g.note_rejection("h", robust.RobustTag.DIRECTION_OUTLIER, 40.0 * t) is None for t in range(10))
    assert g.cooling(400.0) == frozenset()
    # three within the window count as one offence; two offences start a cool-down
    started = [g.note_rejection("r", robust.RobustTag.DIRECTION_OUTLIER, 500.0 + t) for t in range(6)]
    assert [d is not None for d in started] == [False] * 5 + [True]
    assert "direction outliers" in started[-1].reason and g.cooling(506.0) == frozenset({"r"})


def test_rounds_are_held_for_a_first_reference_only_not_after_a_reset():
    g = guard()
    assert g.warming_up(0)
    warm(g, direction(0))
    assert not g.warming_up(0) and g.has_reference(0)
    for sender in ("a", "b"):  # two senders in a row disagree: the reference is reset ...
        g.screen(0, delta(-direction(0)), steps=8, sender=sender)
    assert not g.has_reference(0)
    assert not g.warming_up(0)  # ... but rounds are not held for warmup_wait again
    assert not guard(enabled=False).warming_up(0)


@pytest.mark.parametrize("reordered", [False, True])
def test_a_rounds_cosine_matrix_equals_each_pairs_cosine(reordered):
    """`screen_round`'s matrix takes each norm and each pair's dot once: the same values as `cosine` pair by
    pair, bit for bit (a zero delta has none); tensors named in another order take the pairwise path."""
    gen = torch.Generator().manual_seed(3)
    deltas = [{"w": torch.randn(40, generator=gen), "b": torch.randn(2, 3, generator=gen)} for _ in range(5)]
    deltas[1] = {"w": torch.zeros(40), "b": torch.zeros(2, 3)}
    if reordered:
        deltas[4] = {"b": deltas[4]["b"], "w": deltas[4]["w"]}
    matrix = cosine_matrix(deltas)
    for i, a in enumerate(deltas):
        assert matrix[i][i] is None
        for j, b in enumerate(deltas):
            if i != j:
                assert matrix[i][j] == cosine(a, b)
    assert matrix[0][1] is None and matrix[0][2] is not None
