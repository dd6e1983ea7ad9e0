"""Moving averages of round timings and the adaptive merge grace window built from them.

grace = min(cap, gamma * max(0, tau * t_step - (t_quorum + t_sync)))

t_step is a learner's inner step time, t_quorum the time from a round's first usable delta to the
minimum quorum, t_sync the merge + broadcast time. While a quantity has no measurement yet it counts
as 0, so a synchronizer that has never seen a step time uses a grace of 0 (merge at quorum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field, model_validator

from p2p_diloco.errors import ConfigError
from p2p_diloco.schema import Number, Rule, section

DEFAULT_EMA_ALPHA = 0.2


class Ema:
    """Exponential moving average: ``value <- alpha * x + (1 - alpha) * value``; the first sample sets it.

    `initial` seeds the value (then the first sample is averaged in like any other).
    """

    def __init__(self, alpha: float, initial: float | None = None):
        if not 0.0 < alpha <= 1.0:
            raise ConfigError(f"Ema alpha must be in (0, 1], got {alpha}")
        if initial is not None and not math.isfinite(initial):
            raise ConfigError(f"Ema initial value must be finite, got {initial}")
        self.alpha = alpha
        self._value = initial
        self.samples = 0

    @property
    def value(self) -> float | None:
        """The current average, or None before the first sample (and without `initial`)."""
        return self._value

    def value_or(self, default: float) -> float:
        return default if self._value is None else self._value

    def update(self, x: float) -> float:
        """Fold in one sample and return the new average. Non-finite or negative samples are ignored."""
        x = float(x)
        if not math.isfinite(x) or x < 0:
            return self.value_or(0.0)
        self._value = x if self._value is None else self.alpha * x + (1.0 - self.alpha) * self._value
        self.samples += 1
        return self._value

    def __repr__(self) -> str:
        return f"Ema(alpha={self.alpha}, value={self._value}, samples={self.samples})"


def grace_window(gamma: float, tau: int, t_step: float, t_quorum: float, t_sync: float, cap: float) -> float:
    """``min(cap, gamma * max(0, tau * t_step - (t_quorum + t_sync)))``, never below 0."""
    return max(0.0, min(cap, gamma * max(0.0, tau * t_step - (t_quorum + t_sync))))


@dataclass
class RoundTimings:
    """Moving averages the synchronizer keeps: step time, time-to-quorum and sync (merge + broadcast) time."""

    step_time: Ema = field(default_factory=lambda: Ema(DEFAULT_EMA_ALPHA))
    time_to_quorum: Ema = field(default_factory=lambda: Ema(DEFAULT_EMA_ALPHA))
    sync_time: Ema = field(default_factory=lambda: Ema(DEFAULT_EMA_ALPHA))

    def round_time(self, tau: int) -> float:
        """tau * t_step: one round of the learners' schedule (0 before any step time is known)."""
        return tau * self.step_time.value_or(0.0)

    def grace(self, gamma: float, tau: int, cap: float) -> float:
        """The grace window from the current averages (unknown ones count as 0), bounded by `cap`."""
        return grace_window(
            gamma,
            tau,
            self.step_time.value_or(0.0),
            self.time_to_quorum.value_or(0.0),
            self.sync_time.value_or(0.0),
            cap,
        )


Seconds = Annotated[Number, Field(gt=0)]


@section("timing")
class SwarmTiming:
    """Seconds for heartbeats, leases and grace windows (real time on the network, fake time in the sim)."""

    heartbeat_period: Seconds = 1.0
    heartbeat_ttl: Seconds = 4.0
    lease_ttl: Seconds = 6.0
    # renew when this fraction of the TTL is left... of elapsed
    lease_renew_fraction: Annotated[Number, Field(gt=0, lt=1)] = 0.5
    claim_grace: Seconds = 2.0
    lease_margin: Annotated[Number, Field(ge=0)] = 0.5
    term_rounds: Annotated[int, Field(ge=1)] = 50
    rejoin_grace: Seconds = 60.0

    @model_validator(mode="after")
    def _ttl_spans_periods(self) -> SwarmTiming:
        if self.heartbeat_ttl <= self.heartbeat_period:
            raise Rule(
                "heartbeat_ttl",
                self.heartbeat_ttl,
                f"must exceed heartbeat_period ({self.heartbeat_period}); a few periods is typical",
            )
        return self
