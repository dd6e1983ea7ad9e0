"""Synchronizer rounds: collecting learners' deltas for one fragment and deciding when to merge.

A round for fragment p at version v (the version the merge will be applied to):
- opens with the first usable delta for p (`SynchronizerRounds.offer`);
- accepts a delta whose anchor a satisfies ``v - max_staleness <= a <= v`` and whose token and step
  counters are positive; keeps only the latest delta per learner (receive order);
- once `min_quorum` distinct learners have reported (time `quorum_at`), runs a grace window and then
  closes: early if every live learner has reported, at ``quorum_at + min(grace, cap)`` otherwise.

Decisions (action, `RoundTag`):
- offer: "accept" (ACCEPTED, REPLACED, OPENED_ROUND) or "reject" (STALE_ANCHOR, FUTURE_ANCHOR,
  BAD_COUNTERS, ROUND_CLOSED, or `AdmissionTag.UNKNOWN_FRAGMENT`);
- poll/ready: "wait" (QUORUM_NOT_MET, GRACE_RUNNING, MERGING) or "close" (GRACE_ENDED_EARLY,
  GRACE_ENDED, GRACE_CAPPED).
Callers compare `decision.tag` with a member; the detail is for people.

Payloads are opaque here; validation of their contents (shapes, finite values, norms) and the merge
itself live elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol import diloco
from p2p_diloco.protocol.decisions import Action, AdmissionTag, Decision
from p2p_diloco.protocol.timing import DEFAULT_EMA_ALPHA, Ema, RoundTimings

ACCEPT, REJECT, WAIT, CLOSE = Action.ACCEPT, Action.REJECT, Action.WAIT, Action.CLOSE


class RoundTag(StrEnum):
    """Why a round accepted, rejected, waited or closed."""

    ACCEPTED = "accepted"
    REPLACED = "replaced"
    OPENED_ROUND = "opened round"
    STALE_ANCHOR = "stale anchor"
    FUTURE_ANCHOR = "future anchor"
    BAD_COUNTERS = "bad counters"
    ROUND_CLOSED = "round closed"
    QUORUM_NOT_MET = "quorum not met"
    GRACE_RUNNING = "grace running"
    MERGING = "merging"
    GRACE_ENDED_EARLY = "grace ended early"
    GRACE_ENDED = "grace ended"
    GRACE_CAPPED = "grace capped"


@dataclass(frozen=True)
class Contribution:
    """One learner's delta for one fragment, as received by the synchronizer."""

    sender: str
    anchor_version: int
    tokens: int
    steps: int
    received_at: float
    payload: Any
    seq: int = 0  # the sender's `DeltaHeader.seq`
    frame: bytes = b""  # sparse codecs: the signed delta frame as received, which a union round bundles
    digest: bytes = b""  # `protocol.loss_score.delta_digest` of its payload: seeds its round's score batch

    @property
    def weight(self) -> float:
        """tokens * (tokens / steps): tokens trained times tokens per step (0 for invalid counters)."""
        if self.tokens <= 0 or self.steps <= 0:
            return 0.0
        return diloco.merge_weight(self.tokens, self.steps)


class FragmentRound:
    """The open round of one fragment at one version; see the module docstring for the rules."""

    def __init__(self, fragment: int, version: int, *, min_quorum: int, max_staleness: int, opened_at: float):
        if min_quorum < 1:
            raise ConfigError(f"min_quorum (K) must be >= 1, got {min_quorum}")
        if max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {max_staleness}")
        self.fragment = fragment
        self.version = version
        self.min_quorum = min_quorum
        self.max_staleness = max_staleness
        self.opened_at = opened_at
        self.quorum_at: float | None = None
        self.closed_at: float | None = None
        self.rejected = 0
        self._latest: dict[str, Contribution] = {}

    @property
    def reporters(self) -> frozenset[str]:
        return frozenset(self._latest)

    def __len__(self) -> int:
        return len(self._latest)

    def _check(self, c: Contribution) -> Decision | None:
        """The rejection for `c` at this round's version, or None if it is usable."""
        if self.closed_at is not None:
            return Decision(
                REJECT, RoundTag.ROUND_CLOSED, f"fragment {self.fragment} v{self.version} already merging"
            )
        if c.tokens <= 0 or c.steps <= 0 or c.anchor_version < 0:
            return Decision(
                REJECT,
                RoundTag.BAD_COUNTERS,
                f"from {c.sender}: tokens={c.tokens}, steps={c.steps}, "
                f"anchor={c.anchor_version} (tokens and steps must be > 0, anchor >= 0)",
            )
        if c.anchor_version > self.version:
            return Decision(
                REJECT,
                RoundTag.FUTURE_ANCHOR,
                f"from {c.sender}: anchor v{c.anchor_version} is ahead of "
                f"fragment {self.fragment} v{self.version}",
            )
        lag = self.version - c.anchor_version
        if lag > self.max_staleness:
            return Decision(
                REJECT,
                RoundTag.STALE_ANCHOR,
                f"from {c.sender}: anchor v{c.anchor_version} is {lag} versions behind "
                f"fragment {self.fragment} v{self.version} (max_staleness {self.max_staleness}); "
                "catch up first",
            )
        return None

    def offer(self, contribution: Contribution, now: float) -> Decision:
        """Accept `contribution` (replacing that sender's earlier one) or reject it with a reason."""
        rejection = self._check(contribution)
        if rejection is not None:
            self.rejected += 1
            return rejection
        replaced = contribution.sender in self._latest
        self._latest[contribution.sender] = contribution
        if self.quorum_at is None and len(self._latest) >= self.min_quorum:
            self.quorum_at = now
        tag = RoundTag.REPLACED if replaced else RoundTag.ACCEPTED
        return Decision(
            ACCEPT,
            tag,
            f"{contribution.sender} for fragment {self.fragment} v{self.version} "
            f"(anchor v{contribution.anchor_version}, {len(self._latest)}/{self.min_quorum} learners)",
        )

    def poll(self, now: float, live_learners: frozenset[str], grace: float, cap: float) -> Decision:
        """Wait or close at time `now`; the window is ``min(grace, cap)`` from `quorum_at`."""
        n, k = len(self._latest), self.min_quorum
        if self.quorum_at is None:
            return Decision(
                WAIT, RoundTag.QUORUM_NOT_MET, f"{n}/{k} learners reported for fragment {self.fragment}"
            )
        grace, cap = max(0.0, grace), max(0.0, cap)
        window = min(grace, cap)
        deadline = self.quorum_at + window
        if now >= deadline:
            if grace > cap:
                return Decision(
                    CLOSE,
                    RoundTag.GRACE_CAPPED,
                    f"{n} learners, grace {grace:.3f}s cut to the cap of {cap:.3f}s",
                )
            return Decision(CLOSE, RoundTag.GRACE_ENDED, f"{n} learners after a {window:.3f}s grace window")
        missing = live_learners - self.reporters
        if live_learners and not missing:
            return Decision(
                CLOSE,
                RoundTag.GRACE_ENDED_EARLY,
                f"all {len(live_learners)} live learners reported, {deadline - now:.3f}s of grace left",
            )
        return Decision(
            WAIT,
            RoundTag.GRACE_RUNNING,
            f"{deadline - now:.3f}s left, {n} reported, {len(missing)} live learners missing",
        )

    def contributions(self) -> list[Contribution]:
        """The latest contribution of each learner, ordered by sender."""
        return [self._latest[s] for s in sorted(self._latest)]

    def close(self, now: float) -> list[Contribution]:
        """Stop accepting (later offers get RoundTag.ROUND_CLOSED) and return `contributions()`."""
        self.closed_at = now
        return self.contributions()

    def rebase(self, version: int, now: float) -> list[Decision]:
        """Move the round to `version` (the fragment advanced while it was open).

        Contributions no longer usable at the new version are dropped, each with its rejection; the
        quorum time is cleared if fewer than `min_quorum` learners remain, and kept otherwise.
        """
        self.version = version
        dropped: list[Decision] = []
        for sender in sorted(self._latest):
            rejection = self._check(self._latest[sender])
            if rejection is not None:
                del self._latest[sender]
                dropped.append(rejection)
        if len(self._latest) < self.min_quorum:
            self.quorum_at = None
        return dropped


class SynchronizerRounds:
    """At most one open round per fragment, plus the timing averages that size the grace window.

    The lifecycle of fragment p: ``offer`` (opens a round) ... ``ready`` says close -> ``close``
    (p is now merging; new deltas open the next round, which waits) -> ``finish`` with the new
    version (or ``abort`` when the merge produced no update).

    `cap` in `ready` defaults to one round of the learners' schedule, ``tau * t_step`` from the
    step-time average (0 before any step time is known, so the first rounds merge at quorum).
    """

    def __init__(
        self,
        num_fragments: int,
        versions: Sequence[int],
        *,
        min_quorum: int,
        max_staleness: int,
        gamma: float,
        tau: int,
        ema_alpha: float = DEFAULT_EMA_ALPHA,
    ):
        if num_fragments < 1:
            raise ConfigError(f"num_fragments must be >= 1, got {num_fragments}")
        if len(versions) != num_fragments:
            raise ConfigError(
                f"need one version per fragment: {len(versions)} versions, {num_fragments} fragments"
            )
        if min_quorum < 1:
            raise ConfigError(f"min_quorum (K) must be >= 1, got {min_quorum}")
        if max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {max_staleness}")
        if not 0.0 <= gamma < 1.0:
            raise ConfigError(f"grace gamma must be in [0, 1), got {gamma}")
        if tau < 1:
            raise ConfigError(f"tau must be >= 1, got {tau}")
        self.num_fragments = num_fragments
        self.min_quorum = min_quorum
        self.max_staleness = max_staleness
        self.gamma = gamma
        self.tau = tau
        self.timings = RoundTimings(Ema(ema_alpha), Ema(ema_alpha), Ema(ema_alpha))
        self._versions = [int(v) for v in versions]
        self._rounds: dict[int, FragmentRound] = {}
        self._merging: set[int] = set()

    def _known(self, fragment: int) -> None:
        if not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment {fragment} out of range 0..{self.num_fragments - 1}")

    def version(self, fragment: int) -> int:
        self._known(fragment)
        return self._versions[fragment]

    def set_version(self, fragment: int, v: int, now: float = 0.0) -> list[Decision]:
        """Adopt version `v` for `fragment` (a new holder that took over a replica).

        An open round moves to `v`; contributions no longer usable are dropped and returned as
        rejections, and a round left empty is discarded.
        """
        self._known(fragment)
        self._versions[fragment] = v
        self._merging.discard(fragment)
        current = self._rounds.get(fragment)
        if current is None:
            return []
        dropped = current.rebase(v, now)
        if len(current) == 0:  # nothing usable left: the next usable delta opens a fresh round
            del self._rounds[fragment]
        return dropped

    def round(self, fragment: int) -> FragmentRound | None:
        return self._rounds.get(fragment)

    @property
    def open_fragments(self) -> tuple[int, ...]:
        return tuple(sorted(self._rounds))

    @property
    def merging(self) -> frozenset[int]:
        return frozenset(self._merging)

    def offer(self, fragment: int, contribution: Contribution, now: float) -> Decision:
        """Route a delta to the fragment's round, opening one if it is the first usable delta."""
        if not 0 <= fragment < self.num_fragments:
            return Decision(
                REJECT,
                AdmissionTag.UNKNOWN_FRAGMENT,
                f"{fragment} from {contribution.sender} (fragments are 0..{self.num_fragments - 1})",
            )
        current = self._rounds.get(fragment)
        if current is not None:
            return current.offer(contribution, now)
        fresh = FragmentRound(
            fragment,
            self._versions[fragment],
            min_quorum=self.min_quorum,
            max_staleness=self.max_staleness,
            opened_at=now,
        )
        decision = fresh.offer(contribution, now)
        if decision.action != ACCEPT:
            return decision
        self._rounds[fragment] = fresh
        return Decision(
            ACCEPT, RoundTag.OPENED_ROUND, f"fragment {fragment} v{fresh.version}; {decision.reason}"
        )

    def observe_step_time(self, seconds: float) -> None:
        """Fold one learner inner-step duration into the step-time average."""
        self.timings.step_time.update(seconds)

    def grace(self) -> float:
        """The current uncapped grace window in seconds."""
        return self.timings.grace(self.gamma, self.tau, math.inf)

    def ready(
        self, now: float, live_learners: frozenset[str], cap: float | None = None
    ) -> list[tuple[int, Decision]]:
        """A wait-or-close decision for every open round, by fragment (see the class docstring for `cap`)."""
        if cap is None:
            cap = self.timings.round_time(self.tau)
        grace = self.grace()
        decisions: list[tuple[int, Decision]] = []
        for fragment in sorted(self._rounds):
            if fragment in self._merging:
                decisions.append(
                    (
                        fragment,
                        Decision(
                            WAIT,
                            RoundTag.MERGING,
                            f"fragment {fragment} v{self._versions[fragment]} is still being merged",
                        ),
                    )
                )
                continue
            decisions.append((fragment, self._rounds[fragment].poll(now, live_learners, grace, cap)))
        return decisions

    def next_deadline(
        self, now: float, live_learners: frozenset[str], cap: float | None = None
    ) -> dict[int, float]:
        """By fragment, when each open round may close without a new delta: `now` when it may close now,
        its grace window's end once it has its quorum; rounds short of a quorum wait for deltas (none)."""
        if cap is None:
            cap = self.timings.round_time(self.tau)
        window = min(max(0.0, self.grace()), max(0.0, cap))
        deadlines = {}
        for fragment, decision in self.ready(now, live_learners, cap):
            quorum_at = self._rounds[fragment].quorum_at
            if decision.action == CLOSE:
                deadlines[fragment] = now
            elif quorum_at is not None and fragment not in self._merging:
                deadlines[fragment] = quorum_at + window
        return deadlines

    def close(self, fragment: int, now: float) -> list[Contribution]:
        """Take the fragment's round for merging; records its time-to-quorum. Raises if none can close."""
        self._known(fragment)
        if fragment in self._merging:
            raise ValueError(f"fragment {fragment} is still merging; call finish() or abort() first")
        current = self._rounds.pop(fragment, None)
        if current is None:
            raise ValueError(f"fragment {fragment} has no open round")
        if current.quorum_at is not None:
            self.timings.time_to_quorum.update(current.quorum_at - current.opened_at)
        self._merging.add(fragment)
        return current.close(now)

    def finish(
        self, fragment: int, new_version: int, sync_seconds: float, now: float = 0.0
    ) -> list[Decision]:
        """The merge of `fragment` produced `new_version`; records the sync time.

        A round that opened during the merge moves to the new version; contributions that became too
        stale are dropped and returned as rejections.
        """
        self._known(fragment)
        if fragment not in self._merging:
            raise ValueError(f"fragment {fragment} is not merging; close() its round first")
        if new_version <= self._versions[fragment]:
            raise ValueError(
                f"fragment {fragment}: new version {new_version} <= current {self._versions[fragment]}"
            )
        self._merging.discard(fragment)
        self.timings.sync_time.update(sync_seconds)
        return self.set_version(fragment, new_version, now)

    def abort(self, fragment: int) -> None:
        """The merge of `fragment` produced no update (e.g. every delta failed validation)."""
        self._known(fragment)
        self._merging.discard(fragment)
