"""The knobs and vocabulary of the robust checks: `RobustConfig` (a `[robust]` manifest section) and the
tags of every robust `Decision` (`RobustTag`), with `NON_OFFENCES`, the rejection tags that never count
towards a cool-down. The checks themselves, with their state, are `protocol.robust.RobustGuard`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.protocol.sync_round import RoundTag
from p2p_diloco.schema import Number, Rule, section


class RobustTag(StrEnum):
    """Why a robust check accepted, clipped or rejected a delta."""

    PLAUSIBLE = "plausible"
    NO_REFERENCE = "no reference"
    COOL_DOWN = "cool-down"
    TOKEN_CLAIM = "token claim"
    STEP_CLAIM = "step claim"
    REPLAY = "replay"
    NORM_OUTLIER = "norm outlier"
    NORM_CLIPPED = "norm clipped"
    DIRECTION_OUTLIER = "direction outlier"
    COOL_DOWN_STARTED = "cool-down started"
    LOSS_CHECK = "loss check"  # the loss rose over `loss_tolerance` with the delta alone
    LOSS_WORSE = "loss worse"  # the loss rose beyond `score_z` standard errors of the round's batch
    OWN_DELTA = "own delta"  # the holder's own work: not screened


# Rejection tags (of any module) that never count as offences. A direction outlier is a statistical call
# that honest learners also hit (after a failover or an overshooting outer step their deltas can be near
# orthogonal to recent updates): each such delta is refused and its work resent, but the sender is not
# cooled down for it; in the demo three honest learners were, losing 120 s of merges each.
NON_OFFENCES = frozenset(
    {
        RoundTag.STALE_ANCHOR,
        RoundTag.FUTURE_ANCHOR,
        RoundTag.ROUND_CLOSED,
        AdmissionTag.ALREADY_MERGED,  # a delta released at a term change that the old holder merged after all
        AdmissionTag.WRONG_RUN,
        AdmissionTag.WRONG_MANIFEST,
        AdmissionTag.NOT_ALLOWED,
        RobustTag.COOL_DOWN,
        RobustTag.DIRECTION_OUTLIER,
        RobustTag.LOSS_WORSE,
    }
)
# Statistical calls among NON_OFFENCES: `direction_offence_limit` of one sender's within `offence_window`
# count as one offence. Honest deltas taken alone are `loss worse` now and then (2 and 5 of about 150 in two
# clean runs of bench_byzantine --fresh-share); each one still counts -1 in its key's loss score.
STATISTICAL = frozenset({RobustTag.DIRECTION_OUTLIER, RobustTag.LOSS_WORSE})


Positive = Annotated[Number, Field(gt=0)]
AtLeastOne = Annotated[int, Field(ge=1)]


@section("robust")
class RobustConfig:
    """Knobs of the robust checks (a `[robust]` manifest section once wired in)."""

    enabled: bool = True
    prior_factor: Positive = 3.0
    norm_history: AtLeastOne = 32
    min_history: AtLeastOne = 4
    clip_factor: Positive = 4.0
    reject_factor: Positive = 10.0
    reference_decay: Annotated[Number, Field(ge=0, lt=1)] = 0.95
    reference_min_updates: AtLeastOne = 3
    min_cosine: Annotated[Number, Field(ge=-1, lt=1)] = 0.0
    noise_z: Annotated[Number, Field(ge=0)] = 4.0
    direction_window: AtLeastOne = 5
    round_min: Annotated[int, Field(ge=3, description="with two deltas no majority can judge")] = 3
    warmup_wait: Positive = 10.0
    token_tolerance: Annotated[Number, Field(ge=0)] = 0.01
    # Steps counted for a delta's per-step norm: at most this many times H (a learner trains on while its
    # delta is in flight). For its merge weight steps count at most H, whatever is claimed.
    max_steps_factor: Positive = 4.0
    replay_memory: AtLeastOne = 256
    offence_limit: AtLeastOne = 4
    offence_window: Positive = 30.0
    cooldown: Positive = 120.0
    # A new key's merge weight ramps up over its first rounds: (rounds merged + 1) / (new_peer_rounds + 1).
    new_peer_rounds: Annotated[int, Field(ge=0, description="0: no ramp")] = 4
    # Weight is earned (`protocol.standing`, issue #41): a key still on its ramp weighs at most the round's
    # median established claim, and all such keys of a round together at most this many of it.
    newcomer_share: Annotated[
        Number, Field(gt=0, description="keys on their ramp together weigh at most this x the round's median")
    ] = 1.0
    # Live learners (outer scaling, whom a round waits for) are those merged within `active_window`
    # seconds, or first heard within `newcomer_grace`: idle heartbeats of made-up keys change nothing.
    active_window: Positive = 120.0
    newcomer_grace: Positive = 60.0
    # Direction outliers and `loss worse` refusals are not offences one by one (honest learners hit them,
    # after a failover, or by a delta that happens to hurt alone), but this many within `offence_window`
    # count as one.
    direction_offence_limit: AtLeastOne = 3
    # The loss check and score (`protocol.loss_score`, `model.probe`): before merging, each delta is tried
    # alone on the global model, on `score_batch` held-out windows drawn from a seed of the round, and refused
    # if the loss rises by more than `loss_tolerance` (relative) or by more than `score_z` standard errors of
    # that batch; every checked delta moves its key's score (weight `score_decay` on the past), which caps
    # the key's weight. "auto": on in public runs (`[trust] authority` set), off in private ones.
    loss_check: Literal["auto", "on", "off"] = "auto"
    loss_tolerance: Annotated[Number, Field(ge=0)] = 0.02
    score_batch: Annotated[
        int,
        Field(
            ge=2,
            le=1024,
            description="held-out windows each delta is scored on, one forward pass of them per delta; "
            "at least 2 (the batch's noise needs two)",
        ),
    ] = 16
    score_z: Annotated[
        Number, Field(gt=0, description="standard errors of its batch a delta may raise the loss by")
    ] = 3.0
    score_decay: Annotated[
        Number, Field(ge=0, lt=1, description="the weight of a key's past score against its latest delta")
    ] = 0.7
    # The delta is tried as an outer step of score_step x outer_lr (about its share of a merge of four): a
    # delta pointing uphill raises the loss in proportion to the step, as does the batch's noise, while an
    # honest delta's overshoot, taken alone at the full outer lr, grows with its square. At the full step 11 %
    # of honest deltas were refused in a clean run (bench_byzantine --fresh-share), at a quarter 1 in 150.
    score_step: Annotated[
        Number, Field(gt=0, le=1, description="the outer step a delta is tried at, as a share of outer_lr")
    ] = 0.25

    @model_validator(mode="after")
    def _reject_beyond_clip(self) -> RobustConfig:
        if self.reject_factor < self.clip_factor:
            raise Rule(
                "reject_factor",
                self.reject_factor,
                f"must be >= clip_factor ({self.clip_factor}): a norm is clipped before it is refused",
            )
        return self
