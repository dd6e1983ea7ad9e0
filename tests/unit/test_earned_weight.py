"""Weight is earned (issue #41, `protocol.standing.Standing.earned`): a key without history weighs at most
its round's median established claim (less on its ramp), the keys on their ramp together at most
`newcomer_share` of it, and a round counts for the outer scaling the sum of weight / claim (a round of fresh
keys alone at most one contributor); established keys are untouched, nothing changes before any key has
history, and an honest newcomer reaches full weight after `new_peer_rounds` merged rounds whatever it
claims."""

from __future__ import annotations

import pytest

from p2p_diloco.protocol.robust_config import RobustConfig
from p2p_diloco.protocol.standing import Earned, Standing
from p2p_diloco.schema import ConfigError

FULL = 16.0 * 2048 * 2048  # an honest H-step delta's claim (tokens x tokens / steps)


def standing(
    rounds: dict[str, int] | None = None, *, new_peer_rounds: int = 4, share: float = 1.0
) -> Standing:
    s = Standing(
        new_peer_rounds=new_peer_rounds, active_window=60.0, newcomer_grace=60.0, newcomer_share=share
    )
    for peer, n in (rounds or {}).items():
        for _ in range(n):
            s.note_merged([peer], now=0.0)
    return s


def test_established_keys_are_untouched():
    s = standing({"a": 4, "b": 9})
    claims = [("a", FULL), ("b", 0.3 * FULL)]
    assert s.earned(claims) == Earned((FULL, 0.3 * FULL), 2.0)


def test_a_fresh_key_weighs_at_most_its_ramp_of_the_median_whatever_it_claims():
    s = standing({"a": 4, "b": 4, "c": 4})
    claims = [("a", 0.5 * FULL), ("b", 0.5 * FULL), ("c", 0.6 * FULL), ("fresh", FULL)]
    earned = s.earned(claims)
    assert earned.weights[:3] == (0.5 * FULL, 0.5 * FULL, 0.6 * FULL)
    assert earned.weights[3] == pytest.approx(0.5 * FULL / 5)  # ramp 1/5 x min(claim, median 0.5 FULL)
    assert earned.counted == pytest.approx(3 + 0.1)  # its weight is a tenth of its claim


def test_keys_on_their_ramp_together_weigh_at_most_newcomer_share_of_the_median():
    s = standing({"a": 4, "b": 4})
    fresh = [(f"fresh-{i}", FULL) for i in range(1000)]
    earned = s.earned([("a", FULL), ("b", FULL), *fresh])
    assert earned.weights[:2] == (FULL, FULL)
    assert sum(earned.weights[2:]) == pytest.approx(FULL)  # a thousand fresh keys weigh one median learner
    assert max(earned.weights[2:]) <= FULL / 5
    assert earned.counted == pytest.approx(3.0)  # ... and count as one contributor
    quarter = standing({"a": 4}, share=0.25).earned([("a", FULL), *fresh])
    assert sum(quarter.weights[1:]) == pytest.approx(FULL / 4)


def test_a_round_of_fresh_keys_alone_counts_at_most_newcomer_share_contributors():
    s = standing({"a": 4})  # the swarm has history; the round has none of it
    alone = s.earned([("fresh", 10 * FULL)])
    assert alone.counted == pytest.approx(0.2)  # a lone new key moves the model a fifth of a learner's step
    flood = s.earned([(f"fresh-{i}", FULL) for i in range(50)])
    assert flood.counted == pytest.approx(1.0)


def test_before_any_key_has_history_every_claim_counts_as_it_is():
    s = standing({"a": 3, "b": 1})
    assert s.earned([("a", FULL), ("b", 0.5 * FULL)]) == Earned((FULL, 0.5 * FULL), 2.0)


def test_an_honest_newcomer_reaches_full_weight_after_new_peer_rounds_merged_rounds():
    s = standing({"a": 4, "b": 4})
    seen = []
    for _ in range(6):
        earned = s.earned([("a", FULL), ("b", FULL), ("new", FULL)])
        seen.append(earned.weights[2] / FULL)
        s.note_merged(["a", "b", "new"], now=0.0)
    assert seen == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_the_ramp_off_leaves_every_claim():
    s = standing(new_peer_rounds=0)
    assert s.earned([("x", FULL), ("y", 3 * FULL)]) == Earned((FULL, 3 * FULL), 2.0)


def test_newcomer_share_must_be_positive():
    with pytest.raises((ConfigError, ValueError), match="newcomer_share"):
        RobustConfig(newcomer_share=0)
