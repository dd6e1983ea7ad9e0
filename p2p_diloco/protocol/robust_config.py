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
    LOSS_CHECK = "loss check"
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
    }
)


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
    # Direction outliers are not offences one by one (honest learners hit them after a failover), but
    # this many within `offence_window` count as one.
    direction_offence_limit: AtLeastOne = 3
    # The loss check (`model.probe`): before merging, each delta is tried alone on the global model and
    # refused if the held-out loss rises by more than `loss_tolerance` (relative). "auto": on in public
    # runs (`[trust] authority` set), off in private ones.
    loss_check: Literal["auto", "on", "off"] = "auto"
    loss_tolerance: Annotated[Number, Field(ge=0)] = 0.02
    loss_windows: AtLeastOne = 16

    @model_validator(mode="after")
    def _reject_beyond_clip(self) -> RobustConfig:
        if self.reject_factor < self.clip_factor:
            raise Rule(
                "reject_factor",
                self.reject_factor,
                f"must be >= clip_factor ({self.clip_factor}): a norm is clipped before it is refused",
            )
        return self
