"""The DiLoCo core (`protocol.diloco`) on tiny hand-computed tensors: each formula of the algorithm page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2p_diloco.protocol import diloco
from p2p_diloco.protocol.kernels import QuantizedTensor


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_outer_delta_is_anchor_minus_theta():
    assert torch.equal(diloco.outer_delta(t(1.0, 2.0), t(0.5, 3.0)), t(0.5, -1.0))


def test_merge_weight_is_tokens_times_tokens_per_step():
    assert diloco.merge_weight(100, 4) == 100 * 25
    assert diloco.merge_weight(0, 1) == 0.0
    with pytest.raises(ValueError):
        diloco.merge_weight(10, 0)
    with pytest.raises(ValueError):
        diloco.merge_weight(-1, 1)


def test_merge_is_the_token_weighted_mean():
    merged = diloco.merge([t(1.0, 2.0), t(3.0, 6.0)], [1.0, 3.0])
    assert merged.dtype == torch.float32
    assert torch.equal(merged, t(2.5, 5.0))  # (1*1 + 3*3) / 4, (1*2 + 3*6) / 4
    assert torch.equal(diloco.merge([t(1.0), t(3.0)], [0.0, 2.0]), t(3.0))  # weight 0: not counted
    assert torch.equal(diloco.merge([t(1.0, -1.0).reshape(2, 1)], [7.0]), t(1.0, -1.0).reshape(2, 1))


def test_merge_sums_in_float64_and_rounds_once():
    # in float32, 2^24 + 1 rounds back to 2^24 (twice): the sum would be 2^24, not 2^24 + 2
    big, tiny = t(2.0**24), t(1.0)
    merged = diloco.merge([big, tiny, tiny], [1.0, 1.0, 1.0])
    assert merged.item() == np.float32((2.0**24 + 2.0) / 3.0)


def test_scale_to_live_scales_only_with_fewer_contributors_than_live():
    merged = [t(4.0, -8.0)]
    diloco.scale_to_live(merged, 1, 4)
    assert torch.equal(merged[0], t(1.0, -2.0))
    diloco.scale_to_live(merged, 4, 4)
    assert torch.equal(merged[0], t(1.0, -2.0))


def test_outer_step_is_nesterov_by_hand():
    theta, m, g = t(1.0, -2.0), t(0.5, 0.0), t(0.25, 1.0)
    new_theta, new_m = diloco.outer_step(theta, m, g, lr=0.5, momentum=0.5)
    # m' = 0.5*m + g = (0.5, 1.0); Θ' = Θ - 0.5*(g + 0.5*m') = (1 - 0.5*0.5, -2 - 0.5*1.5)
    assert torch.equal(new_m, t(0.5, 1.0))
    assert torch.equal(new_theta, t(0.75, -2.75))
    assert torch.equal(theta, t(1.0, -2.0)) and torch.equal(m, t(0.5, 0.0))  # inputs untouched


def test_outer_step_rounds_every_operation_in_float32():
    rng = np.random.default_rng(3)
    theta, m, g = (rng.standard_normal(257).astype(np.float32) for _ in range(3))
    new_theta, new_m = diloco.outer_step(
        torch.from_numpy(theta), torch.from_numpy(m), torch.from_numpy(g), lr=0.7, momentum=0.9
    )
    f32 = np.float32
    ref_m = (m * f32(0.9)).astype(f32) + g
    ref_theta = theta - (((ref_m * f32(0.9)).astype(f32) + g) * f32(0.7)).astype(f32)
    assert np.array_equal(new_m.numpy(), ref_m) and np.array_equal(new_theta.numpy(), ref_theta)


def test_outer_step_on_an_int8_gradient_equals_the_decoded_one():
    table = torch.linspace(-1.0, 1.0, 256, dtype=torch.float32)
    q = QuantizedTensor((5,), np.array([0, 17, 128, 200, 255], dtype=np.uint8), t(2.0, 0.5), 4, table)
    theta, m = t(1.0, 2.0, 3.0, 4.0, 5.0), t(0.1, 0.2, 0.3, 0.4, 0.5)
    mu, rate = torch.tensor(0.9), torch.tensor(0.7)
    out_q, out_d = (torch.empty(5), torch.empty(5)), (torch.empty(5), torch.empty(5))
    assert diloco.outer_step_into(theta, m, q, *out_q, mu=mu, rate=rate)
    assert diloco.outer_step_into(theta, m, q.decode(), *out_d, mu=mu, rate=rate)
    assert torch.equal(out_q[0], out_d[0]) and torch.equal(out_q[1], out_d[1])
    assert not torch.equal(out_q[0], theta)


def test_outer_step_into_reports_an_overflow():
    out = (torch.empty(1), torch.empty(1))
    finite = diloco.outer_step_into(
        t(1.0), t(0.0), t(3e38), *out, mu=torch.tensor(0.9), rate=torch.tensor(1.0)
    )
    assert not finite


def test_adopt_keeps_the_progress_made_since_sending():
    theta, at_send, new_global = t(5.0, 0.0), t(3.0, 1.0), t(10.0, 10.0)
    assert torch.equal(
        diloco.adopt(theta, new_global, at_send=at_send), t(12.0, 9.0)
    )  # carry: Θ' + (θ - θ_s)
    assert torch.equal(diloco.adopt(theta, new_global, mode="overwrite"), new_global)
    assert torch.equal(diloco.adopt(theta, new_global, mode="blend", alpha=0.25), t(6.25, 2.5))
    with pytest.raises(ValueError):
        diloco.adopt(theta, new_global)  # carry needs θ at send
    with pytest.raises(ValueError):
        diloco.adopt(theta, new_global, at_send=at_send, mode="keep")


def test_follow_moves_theta_by_the_global_change():
    new_theta, shift = diloco.follow(t(5.0, -1.0), t(1.0, 1.0), t(4.0, 0.5))
    assert torch.equal(shift, t(3.0, -0.5))
    assert torch.equal(new_theta, t(8.0, -1.5))


def test_one_round_without_momentum_lands_on_the_weighted_mean_of_the_learners():
    anchor = t(1.0, 1.0)
    thetas, tokens = [t(0.0, 2.0), t(2.0, 4.0)], [100, 300]  # one step each
    deltas = [diloco.outer_delta(anchor, theta) for theta in thetas]
    g = diloco.merge(deltas, [diloco.merge_weight(n, 1) for n in tokens])  # weights 1 : 9
    new_theta, _ = diloco.outer_step(anchor, torch.zeros(2), g, lr=1.0, momentum=0.0)
    assert torch.equal(new_theta, t(1.8, 3.8))  # (0*1 + 2*9)/10, (2*1 + 4*9)/10
