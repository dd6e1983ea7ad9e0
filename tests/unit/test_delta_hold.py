"""How long a learner holds its deltas after a refusal (`swarm.outbox.delta_hold_seconds`)."""

from __future__ import annotations

import pytest

from p2p_diloco.net.transport import REPLY_UNREACHABLE
from p2p_diloco.node.guard import REJECT_BUSY, REJECT_NOT_READY
from p2p_diloco.protocol.robust_config import RobustTag
from p2p_diloco.protocol.sync_round import RoundTag
from p2p_diloco.swarm.outbox import MAX_DELTA_HOLD, delta_hold_seconds
from p2p_diloco.wire.replies import Reply


def test_cool_down_is_held_for_the_seconds_the_synchronizer_names():
    cool_down = RobustTag.COOL_DOWN
    assert delta_hold_seconds(Reply.refused(cool_down, "QmX is ignored", retry_after=88.1), 1.0) == 88.1
    assert delta_hold_seconds(Reply.refused(cool_down, "QmX", retry_after=9999.0), 1.0) == MAX_DELTA_HOLD
    assert delta_hold_seconds(Reply.refused(cool_down, "no time named"), 2.0) == 2.0


@pytest.mark.parametrize("tag", [REPLY_UNREACHABLE, REJECT_BUSY, REJECT_NOT_READY])
def test_transient_refusals_wait_one_heartbeat_period(tag):
    assert delta_hold_seconds(Reply.transient(tag, "cannot open a delta stream"), 1.5) == 1.5


@pytest.mark.parametrize(
    ("tag", "detail"),
    [
        (RoundTag.STALE_ANCHOR, "v3 < v5 - 4"),
        (RobustTag.NORM_OUTLIER, "w norm 3 > 10 x median 0.1"),
        (RoundTag.ROUND_CLOSED, ""),
    ],
)
def test_refusals_about_the_delta_itself_are_not_held(tag, detail):
    assert delta_hold_seconds(Reply.refused(tag, detail), 1.0) == 0.0
