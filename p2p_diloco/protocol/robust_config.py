"""The knobs and vocabulary of the robust checks: `RobustConfig` (a `[robust]` manifest section) and the
tags of every robust `Decision` (`RobustTag`), with `NON_OFFENCES`, the rejection tags that never count
towards a cool-down. The checks themselves, with their state, are `protocol.robust.RobustGuard`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.protocol.sync_round import RoundTag


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


@dataclass(frozen=True)
class RobustConfig:
    """Knobs of the robust checks (a `[robust]` manifest section once wired in)."""

    enabled: bool = True
    prior_factor: float = 3.0
    norm_history: int = 32
    min_history: int = 4
    clip_factor: float = 4.0
    reject_factor: float = 10.0
    reference_decay: float = 0.95
    reference_min_updates: int = 3
    min_cosine: float = 0.0
    noise_z: float = 4.0
    direction_window: int = 5
    round_min: int = 3
    warmup_wait: float = 10.0
    token_tolerance: float = 0.01
    # Steps counted for a delta's per-step norm: at most this many times H (a learner trains on while its
    # delta is in flight). For its merge weight steps count at most H, whatever is claimed.
    max_steps_factor: float = 4.0
    replay_memory: int = 256
    offence_limit: int = 4
    offence_window: float = 30.0
    cooldown: float = 120.0
    # A new key's merge weight ramps up over its first rounds: (rounds merged + 1) / (new_peer_rounds + 1).
    new_peer_rounds: int = 4
    # Live learners (outer scaling, whom a round waits for) are those merged within `active_window`
    # seconds, or first heard within `newcomer_grace`: idle heartbeats of made-up keys change nothing.
    active_window: float = 120.0
    newcomer_grace: float = 60.0
    # Direction outliers are not offences one by one (honest learners hit them after a failover), but
    # this many within `offence_window` count as one.
    direction_offence_limit: int = 3
    # The loss check (`model.probe`): before merging, each delta is tried alone on the global model and
    # refused if the held-out loss rises by more than `loss_tolerance` (relative). "auto": on in public
    # runs (`[trust] authority` set), off in private ones.
    loss_check: str = "auto"
    loss_tolerance: float = 0.02
    loss_windows: int = 16

    def __post_init__(self) -> None:
        positive = (
            "prior_factor",
            "clip_factor",
            "offence_window",
            "cooldown",
            "max_steps_factor",
            "warmup_wait",
            "active_window",
            "newcomer_grace",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"robust.{name} must be > 0, got {getattr(self, name)}")
        if not self.reject_factor >= self.clip_factor:
            raise ConfigError("robust.reject_factor must be >= robust.clip_factor")
        for name in (
            "norm_history",
            "min_history",
            "reference_min_updates",
            "offence_limit",
            "replay_memory",
            "direction_window",
            "direction_offence_limit",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"robust.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.reference_decay < 1.0:
            raise ConfigError(f"robust.reference_decay must be in [0, 1), got {self.reference_decay}")
        if not -1.0 <= self.min_cosine < 1.0 or self.noise_z < 0:
            raise ConfigError("robust.min_cosine must be in [-1, 1) and robust.noise_z >= 0")
        if self.round_min < 3:
            raise ConfigError("robust.round_min must be >= 3 (with two deltas no majority can judge)")
        if self.loss_check not in ("auto", "on", "off"):
            raise ConfigError(f'robust.loss_check must be "auto", "on" or "off", got {self.loss_check!r}')
        if not self.loss_tolerance >= 0 or self.loss_windows < 1:
            raise ConfigError("robust.loss_tolerance must be >= 0 and robust.loss_windows >= 1")
        if self.new_peer_rounds < 0:
            raise ConfigError(f"robust.new_peer_rounds must be >= 0 (0: no ramp), got {self.new_peer_rounds}")
        if self.token_tolerance < 0:
            raise ConfigError(f"robust.token_tolerance must be >= 0, got {self.token_tolerance}")
