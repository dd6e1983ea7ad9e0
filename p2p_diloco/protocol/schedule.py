"""The learner's send schedule: which fragment's outer delta goes out after which inner step.

Rules (the learner never blocks on the network):
- Round robin with absolute due times: the k-th send (k = 1, 2, ...) is fragment ``k mod P`` and
  becomes due at inner step ``k * steps_per_fragment``. With P = 4 and 6 steps per fragment:
  fragment 1 at step 6, 2 at 12, 3 at 18, 0 at 24, 1 at 30, ...
- At most one send per step. A due fragment is sent unless
  * its previous delta is still in flight (sent, merged update not yet adopted): "already in flight";
  * ``max_in_flight`` (tau) fragments are in flight already: "tau reached".
  Then the learner trains on and the fragment stays pending: it is sent at the first later step
  where it can go, before the next fragment in order. Due times of later fragments do not move; if
  several are overdue, they go out one per step, in order.
- Otherwise the step trains with "not due".

Steps passed to `on_step` must increase. `in_flight` is the set of fragments whose delta was sent
and whose merged update the learner has not adopted yet (the learner owns that bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol.decisions import Action, Decision

SEND, TRAIN = Action.SEND, Action.TRAIN


class ScheduleTag(StrEnum):
    """Why the learner sends or keeps training."""

    DUE = "due"
    NOT_DUE = "not due"
    TAU_REACHED = "tau reached"
    ALREADY_IN_FLIGHT = "already in flight"


@dataclass(frozen=True)
class ScheduleDecision(Decision):
    """A `Decision` that also names the fragment it is about (None when nothing is due)."""

    fragment: int | None = None


class LearnerSchedule:
    """Round-robin fragment sends with at most `max_in_flight` fragments outstanding (module docstring)."""

    def __init__(self, num_fragments: int, steps_per_fragment: int, max_in_flight: int):
        if num_fragments < 1:
            raise ConfigError(f"num_fragments must be >= 1, got {num_fragments}")
        if steps_per_fragment < 1:
            raise ConfigError(f"steps_per_fragment must be >= 1, got {steps_per_fragment}")
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight (tau) must be >= 1, got {max_in_flight}")
        self.num_fragments = num_fragments
        self.steps_per_fragment = steps_per_fragment
        self.max_in_flight = max_in_flight
        self._next_send = 1  # k of the next send in round-robin order
        self._last_step: int | None = None
        self.sends = 0
        self.deferred_steps = 0  # steps on which a due fragment could not go out

    def due_fragment(self, k: int) -> int:
        """The fragment of the k-th send."""
        return k % self.num_fragments

    def due_step(self, k: int) -> int:
        """The inner step at which the k-th send becomes due."""
        return k * self.steps_per_fragment

    @property
    def next_fragment(self) -> int:
        """The next fragment to send, in round-robin order (pending or not yet due)."""
        return self.due_fragment(self._next_send)

    @property
    def next_due_step(self) -> int:
        """The step at which `next_fragment` is (or was) due."""
        return self.due_step(self._next_send)

    def pending(self, step: int) -> int | None:
        """The fragment that is due at `step` but not sent yet, if any."""
        return self.next_fragment if self.next_due_step <= step else None

    def on_step(self, step: int, in_flight: frozenset[int]) -> ScheduleDecision:
        """Decide after inner step `step`: send the due fragment, or keep training (and why)."""
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"steps must increase: got {step} after {self._last_step}")
        bad = sorted(p for p in in_flight if not 0 <= p < self.num_fragments)
        if bad:
            raise ValueError(f"in_flight holds unknown fragments {bad} (have 0..{self.num_fragments - 1})")
        self._last_step = step

        fragment, due_at = self.next_fragment, self.next_due_step
        if due_at > step:
            return ScheduleDecision(
                TRAIN, ScheduleTag.NOT_DUE, f"next is fragment {fragment} at step {due_at}", None
            )
        late = f"due since step {due_at}, {step - due_at} steps late"
        if fragment in in_flight:
            self.deferred_steps += 1
            return ScheduleDecision(
                TRAIN,
                ScheduleTag.ALREADY_IN_FLIGHT,
                f"fragment {fragment} ({late}) waits until its previous delta is adopted",
                fragment,
            )
        if len(in_flight) >= self.max_in_flight:
            self.deferred_steps += 1
            return ScheduleDecision(
                TRAIN,
                ScheduleTag.TAU_REACHED,
                f"{len(in_flight)}/{self.max_in_flight} in flight {sorted(in_flight)}; "
                f"fragment {fragment} ({late}) stays pending",
                fragment,
            )
        self._next_send += 1
        self.sends += 1
        detail = f"due at step {due_at}" if due_at == step else late
        return ScheduleDecision(SEND, ScheduleTag.DUE, f"fragment {fragment} ({detail})", fragment)
