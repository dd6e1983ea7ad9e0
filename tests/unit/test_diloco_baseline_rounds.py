"""Synchronous DiLoCo's pure parts (`baseline.rounds`), its CLI options and the demo's `--compare` (no network)."""

from __future__ import annotations

import argparse

import pytest
import torch

from p2p_diloco.baseline.command import options_from_args
from p2p_diloco.baseline.ledger import AVERAGED
from p2p_diloco.baseline.rounds import (
    Decision,
    DilocoSettings,
    PeerProgress,
    decide_round,
    epoch_group_bits,
    holds_canonical_model,
    outer_gradients,
    outer_step,
    overdue,
    round_outcome,
)
from p2p_diloco.cli import build_parser
from p2p_diloco.demo import compared_systems
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.identity import write_identity

ME, A, B = b"me", b"peer-a", b"peer-b"
T = 16 * 32  # samples per round: H = 16 steps of 32 sequences


def decide(
    epoch: int, peers: list[PeerProgress], *, now: float = 100.0, waited: float = 0.0, expected: int = 1
):
    return decide_round(
        ME, epoch, peers, target_samples=T, now=now, grace=3.0, waited=waited, wait_limit=30.0,
        expected_peers=expected,
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


def test_round_outcome_needs_two_members_of_the_same_epoch():
    assert round_outcome(5, [{"epoch": 5}, {"epoch": 5, "digest": "x"}]) == AVERAGED
    assert round_outcome(5, None) is None
    assert round_outcome(5, [{"epoch": 5}]) is None
    assert round_outcome(5, [{"epoch": 5}, {"epoch": 4}]) is None
    assert round_outcome(5, [{"epoch": 5}, None]) is None


def test_members_with_different_models_keep_the_least_digest_and_the_others_reload():
    gathered = [{"epoch": 5, "digest": "b7"}, {"epoch": 5, "digest": "a1"}, {"epoch": 5, "digest": "a1"}]
    assert holds_canonical_model("a1", gathered)  # both holders of the least digest step
    assert not holds_canonical_model("b7", gathered)  # the other drops the round and reloads
    same = [{"epoch": 5, "digest": "c3"}, {"epoch": 5, "digest": "c3"}]
    assert holds_canonical_model("c3", same)  # the usual round: one model, everyone steps
    # a member that gathered no digest (an old peer) decides nothing for the others
    assert holds_canonical_model("c3", [{"epoch": 5}, {"epoch": 5, "digest": "c3"}])
    assert not holds_canonical_model("d4", [{"epoch": 5}, {"epoch": 5, "digest": "c3"}])


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
