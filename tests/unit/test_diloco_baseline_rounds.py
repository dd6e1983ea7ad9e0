"""Synchronous DiLoCo's pure parts (`baseline.rounds`), its CLI options and the demo's `--compare` (no network)."""

from __future__ import annotations

import argparse
import itertools

import pytest
import torch

from p2p_diloco.baseline.command import options_from_args
from p2p_diloco.baseline.rounds import (
    Decision,
    DilocoSettings,
    PeerProgress,
    Settle,
    decide_round,
    epoch_group_bits,
    outer_gradients,
    outer_step,
    overdue,
    partial_average,
    settle_round,
)
from p2p_diloco.cli import build_parser
from p2p_diloco.demo import compared_systems
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.identity import write_identity
from tests.support.baseline_workers import agreed_rounds, heal_epoch, model_moves, round_disagreements

ME, A, B = b"me", b"peer-a", b"peer-b"
T = 16 * 32  # samples per round: H = 16 steps of 32 sequences


def decide(
    epoch: int,
    peers: list[PeerProgress],
    *,
    now: float = 100.0,
    waited: float = 0.0,
    expected: int = 1,
    lost_for: float | None = None,
):
    return decide_round(
        ME, epoch, peers, target_samples=T, now=now, grace=3.0, waited=waited, wait_limit=30.0,
        expected_peers=expected, lost_for=lost_for,
    )  # fmt: skip


def progress(peer: bytes, epoch: int, samples: int, *, sps: float = 100.0, at: float = 100.0) -> PeerProgress:
    return PeerProgress(peer, epoch, samples, sps, at)


# ---- the outer step ----------------------------------------------------------------------------------


def test_outer_gradient_is_global_minus_local_and_the_step_without_momentum_moves_by_lr_times_it():
    theta = [torch.tensor([1.0, 2.0]), torch.tensor([[0.5]])]
    local = [torch.tensor([0.5, 2.5]), torch.tensor([[1.5]])]
    grads = outer_gradients(theta, local)
    assert torch.equal(grads[0], torch.tensor([0.5, -0.5])) and torch.equal(grads[1], torch.tensor([[-1.0]]))
    momentum = [torch.zeros_like(t) for t in theta]
    outer_step(theta, momentum, grads, lr=1.0, mu=0.0)
    assert torch.equal(theta[0], local[0]) and torch.equal(theta[1], local[1])  # lr 1, no momentum: θ itself
    with pytest.raises(ValueError, match="tensors"):
        outer_gradients(theta, local[:1])


def test_outer_step_is_nesterov_with_the_manifest_lr_and_momentum():
    lr, mu = 0.7, 0.9
    param, buf = torch.tensor([1.0]), torch.tensor([0.0])
    for g in (0.5, -0.25):
        expected_buf = mu * buf + g
        expected = param - lr * (g + mu * expected_buf)
        outer_step([param], [buf], [torch.tensor([g])], lr=lr, mu=mu)
        assert torch.allclose(param, expected) and torch.allclose(buf, expected_buf)


def test_averaged_outer_step_lands_between_the_two_local_only_results():
    theta = torch.zeros(3)
    locals_ = [torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 1.0, -2.0])]
    results = []
    for grads in ([outer_gradients([theta], [loc])[0]] for loc in locals_):
        p, m = theta.clone(), torch.zeros(3)
        outer_step([p], [m], grads, lr=1.3, mu=0.0)
        results.append(p)
    averaged = (outer_gradients([theta], [locals_[0]])[0] + outer_gradients([theta], [locals_[1]])[0]) / 2
    p, m = theta.clone(), torch.zeros(3)
    outer_step([p], [m], [averaged], lr=1.3, mu=0.0)
    assert torch.allclose(p, (results[0] + results[1]) / 2)
    assert not torch.equal(p, results[0]) and not torch.equal(p, results[1])


# ---- round bookkeeping -------------------------------------------------------------------------------


def test_overdue_extrapolates_a_report_at_the_peers_own_speed():
    assert overdue(progress(A, 0, T), T, now=100.0) == 0.0  # reported done
    assert overdue(progress(A, 0, T - 100, sps=100.0), T, now=100.0) == pytest.approx(-1.0)
    assert overdue(progress(A, 0, T - 100, sps=100.0, at=96.0), T, now=100.0) == pytest.approx(3.0)
    assert overdue(progress(A, 0, 0, sps=0.0), T, now=100.0) == -float("inf")  # no speed known yet


def test_a_round_waits_until_every_peer_of_its_epoch_reported_its_round_done():
    assert decide(3, [progress(A, 3, 0)]).decision == Decision.WAIT  # 5 s of work left
    assert decide(3, [progress(A, 3, T - 50)]).decision == Decision.WAIT  # nearly done is not done
    view = decide(3, [progress(A, 3, T), progress(B, 3, T)])
    assert view.decision == Decision.AVERAGE and view.peers_at_epoch == 3 and view.peers_done == 2
    view = decide(3, [progress(A, 3, 0), progress(B, 3, T)], waited=31.0)  # past the limit: without A
    assert view.decision == Decision.AVERAGE and view.peers_at_epoch == 3 and view.peers_done == 1
    assert decide(3, [progress(A, 3, 0)], waited=31.0).decision == Decision.ALONE  # A will load its state


def test_a_silent_peer_is_skipped_once_overdue_by_the_grace():
    dead = progress(A, 3, 0, sps=200.0, at=90.0)  # last report 10 s ago with 2.56 s of work left
    assert decide(3, [dead, progress(B, 3, T)], now=100.0).decision == Decision.AVERAGE  # 7.4 s > 3 s grace
    assert decide(3, [dead], now=100.0).decision == Decision.ALONE  # nobody else is done
    assert decide(3, [dead], now=94.0).decision == Decision.WAIT  # 1.4 s overdue: may be slow, not dead


def test_a_peer_ahead_means_reload_one_behind_is_waited_for_and_nobody_else_means_alone():
    assert decide(3, [progress(A, 4, 0), progress(B, 3, T)]).decision == Decision.RELOAD
    assert decide(3, [progress(A, 2, T)]).decision == Decision.WAIT  # a stale record or about to reload
    assert decide(3, [progress(A, 2, T)], waited=31.0).decision == Decision.ALONE
    assert decide(3, []).decision == Decision.ALONE
    assert decide(3, [progress(ME, 3, T)]).decision == Decision.ALONE  # its own record does not count


def test_the_first_round_waits_for_the_expected_peers_to_show_up():
    assert decide(0, [progress(A, 0, T)], expected=3).decision == Decision.WAIT
    assert decide(0, [progress(A, 0, T), progress(B, 0, T)], expected=3).decision == Decision.AVERAGE
    assert decide(0, [progress(A, 0, T)], expected=3, waited=31.0).decision == Decision.AVERAGE
    assert decide(1, [progress(A, 1, T)], expected=3).decision == Decision.AVERAGE  # later rounds do not


def test_a_round_is_settled_only_by_two_members_of_its_epoch():
    assert settle_round(5, "x", [{"epoch": 5, "digest": "x"}, {"epoch": 5, "digest": "x"}]) == Settle.STEP
    assert settle_round(5, "x", None) == Settle.RETRY  # failed, or partial (`partial_average`)
    assert settle_round(5, "x", [{"epoch": 5, "digest": "x"}]) == Settle.RETRY
    assert settle_round(5, "x", [{"epoch": 5, "digest": "x"}, {"epoch": 4, "digest": "x"}]) == Settle.RETRY
    assert settle_round(5, "x", [{"epoch": 5, "digest": "x"}, None]) == Settle.RETRY


def test_members_with_different_outer_states_keep_the_least_digest_and_the_others_reload():
    gathered = [{"epoch": 5, "digest": "b7"}, {"epoch": 5, "digest": "a1"}, {"epoch": 5, "digest": "a1"}]
    assert settle_round(5, "a1", gathered) == Settle.STEP  # both holders of the least digest step
    assert settle_round(5, "b7", gathered) == Settle.RELOAD  # the other drops the round and reloads
    # a member that gathered no digest (an old peer) decides nothing for the others
    assert settle_round(5, "c3", [{"epoch": 5}, {"epoch": 5, "digest": "c3"}]) == Settle.STEP
    assert settle_round(5, "d4", [{"epoch": 5}, {"epoch": 5, "digest": "c3"}]) == Settle.RELOAD


def test_a_lost_member_never_steps_its_epoch_again_even_when_it_meets_only_its_own_state():
    same = [{"epoch": 5, "digest": "b7"}, {"epoch": 5, "digest": "b7"}]
    assert settle_round(5, "b7", same, lost=True) == Settle.RELOAD
    assert settle_round(5, "b7", None, lost=True) == Settle.RETRY  # a failed try is a failed try


def test_the_stepping_members_of_any_group_share_one_state_and_the_least_one_always_steps():
    """Rules 2 and 3 over every group of 2-4 members with digests from {a, b, c} and any lost flags."""
    for size in (2, 3, 4):
        for digests in itertools.product("abc", repeat=size):
            for lost in itertools.product((False, True), repeat=size):
                gathered = [{"epoch": 7, "digest": d} for d in digests]
                settled = [settle_round(7, d, gathered, lost=x) for d, x in zip(digests, lost, strict=True)]
                stepped = {d for d, how in zip(digests, settled, strict=True) if how == Settle.STEP}
                assert len(stepped) <= 1, (digests, lost, settled)
                least = min(digests)
                if any(d == least and not x for d, x in zip(digests, lost, strict=True)):
                    assert stepped == {least}, (digests, lost, settled)


def test_a_partial_average_is_refused_and_a_complete_one_accepted():
    assert partial_average(0, 30176) is None
    reason = partial_average(8180, 30176)  # the CI run of 2026-11-28: W1 got 72.9 % of its average
    assert reason is not None and "72.9%" in reason
    assert partial_average(30176, 30176) is not None
    assert partial_average(0, 0) is not None and partial_average(-1, 10) is not None
    assert partial_average(11, 10) is not None


def test_a_lost_member_waits_a_grace_for_one_that_stepped_then_joins_the_epoch_again():
    done = progress(A, 3, T)  # the record of the member that stepped, not yet refreshed
    assert decide(3, [done]).decision == Decision.AVERAGE  # not lost: the usual round
    assert decide(3, [done], lost_for=0.0).decision == Decision.WAIT
    assert decide(3, [done], lost_for=2.9).decision == Decision.WAIT
    assert decide(3, [progress(A, 4, 0)], lost_for=0.1).decision == Decision.RELOAD  # it stepped: load it
    # past the grace: A may have failed its own try and retries this epoch; join it (as a contributor)
    assert decide(3, [done], lost_for=3.0).decision == Decision.AVERAGE


def test_the_ci_failure_of_2026_11_28_now_ends_in_a_reload_instead_of_a_step():
    """w1 reloaded epoch 1 from w2, then its all-reduce of epoch 1 came back 72.9 % complete while w2's
    was whole: w1 stepped on a part of its own gradient and the global models differed at epoch 2."""
    assert partial_average(8180, 30176) is not None  # the averager fails w1's try: gathered None
    assert settle_round(1, "cb33", None) == Settle.RETRY
    assert decide(1, [progress(A, 2, 0)]).decision == Decision.RELOAD  # w2 stepped: w1 loads its epoch 2
    # w2 got every part: it steps, as w1 would have had it been whole
    both = [{"epoch": 1, "digest": "cb33"}, {"epoch": 1, "digest": "cb33"}]
    assert settle_round(1, "cb33", both) == Settle.STEP


def _step(epoch: int, digest: str, local: str) -> dict:
    return {"event": "global_step", "t": float(epoch), "epoch": epoch, "outcome": "averaged", "group_size": 2,
            "digest": digest, "local_digest": local}  # fmt: skip


def test_the_integration_checks_see_the_rounds_past_the_last_heal_and_flag_a_difference():
    """The event logs of the CI failure of 2026-11-28, shortened: w1 healed at epochs 0 and 2."""
    w1 = [
        {"event": "global_models_differ", "t": 0.5, "epoch": 0},
        {"event": "reloaded", "t": 1.5, "epoch": 1},
        _step(2, "e33e", "4e07"),  # the partial average: another model than w2's
        {"event": "global_models_differ", "t": 2.5, "epoch": 2},
        {"event": "reloaded", "t": 3.5, "epoch": 3},
        _step(4, "0373", "38b3"),
        _step(5, "8153", "5248"),
    ]
    w2 = [
        _step(1, "cb33", "b2d8"),
        _step(2, "801b", "6196"),
        _step(3, "e2e7", "cdf0"),
        _step(4, "0373", "42c5"),
    ]
    w2.append(_step(5, "8153", "e10f"))
    logs = {"w1": w1, "w2": w2}
    assert heal_epoch(logs) == 3 and agreed_rounds(logs) == [4, 5] and not round_disagreements(logs)
    assert agreed_rounds(logs, after=4.5) == [5]
    unhealed = {"w1": w1[:3] + w1[5:], "w2": w2}  # had w1 not found the difference at epoch 2
    assert heal_epoch(unhealed) == 1 and agreed_rounds(unhealed) == [2, 4, 5]
    assert round_disagreements(unhealed) == ["epoch 2: the global models differ (['801b', 'e33e'])"]
    alone = {"w1": [_step(1, "aa", "aa")], "w2": [{**_step(1, "aa", "bb"), "group_size": 1}]}
    assert round_disagreements(alone) == [
        "epoch 1: group sizes [1, 2]",
        "epoch 1: the outer step did not average",
    ]
    assert model_moves(w1) == w1 and heal_epoch({"w2": w2}) == -1


def test_group_bits_separate_consecutive_epochs():
    bits = [epoch_group_bits(e) for e in range(4)]
    assert len(set(bits)) == 4 and all(len(b) == 16 and set(b) <= {"0", "1"} for b in bits)
    assert epoch_group_bits(1 << 16) == epoch_group_bits(0)
    with pytest.raises(ValueError):
        epoch_group_bits(-1)


def test_settings_refuse_nonsense():
    DilocoSettings(inner_steps=16, outer_lr=1.3, outer_momentum=0.0, group_size=4, wait_limit=30.0)
    with pytest.raises(ValueError):
        DilocoSettings(inner_steps=0, outer_lr=1.3, outer_momentum=0.0, group_size=4, wait_limit=30.0)


# ---- command lines -----------------------------------------------------------------------------------


def test_baseline_worker_mode_diloco_takes_h_and_the_outer_optimizer_from_the_manifest(tmp_path):
    manifest = tmp_path / "run.toml"
    manifest.write_text('run_id = "m"\n[diloco]\ninner_steps = 8\nouter_lr = 0.9\nouter_momentum = 0.5\n')
    key = tmp_path / "me.key"
    write_identity(key)
    base = ["baseline-worker", str(manifest), "--identity", str(key), "--state-dir", str(tmp_path / "s")]
    options = options_from_args(build_parser().parse_args([*base, "--mode", "diloco", "--learners", "3"]))
    assert options.diloco == DilocoSettings(
        inner_steps=8, outer_lr=0.9, outer_momentum=0.5, group_size=3, wait_limit=30.0
    )
    assert options.elastic.run_id.endswith("-diloco")
    dp = options_from_args(build_parser().parse_args(base))
    assert dp.diloco is None and dp.elastic.run_id.endswith("-baseline")
    with pytest.raises(ConfigError, match="--wait-for-peers"):
        options_from_args(build_parser().parse_args([*base, "--mode", "diloco", "--wait-for-peers", "-1"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--mode", "sync"])


def test_demo_compare_values():
    parse = build_parser().parse_args
    assert compared_systems(parse(["demo"])) == ()
    assert compared_systems(parse(["demo", "--compare"])) == ("baseline",)  # as before: the dp baseline
    assert compared_systems(parse(["demo", "--compare", "dp", "--chaos"])) == ("baseline",)
    assert compared_systems(parse(["demo", "--compare", "diloco"])) == ("diloco",)
    assert compared_systems(parse(["demo", "--compare", "all"])) == ("baseline", "diloco")
    assert compared_systems(parse(["demo", "--baseline", "hivemind"])) == ("baseline",)
    assert compared_systems(argparse.Namespace(compare=True, baseline=None)) == ("baseline",)
    with pytest.raises(ConfigError, match="dp, diloco, all"):
        compared_systems(parse(["demo", "--compare", "sync"]))
