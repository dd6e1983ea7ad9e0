"""What a node tells the swarm and its operator about itself: step timing, contributions, rejections.

`Telemetry` keeps the step-time average and when this peer's work last reached the global model, and
builds the status fields of its heartbeat (`HeartbeatInfo`: tokens/s, rejection counters by reason
and by sender, last decisions; what `p2p-diloco status` shows) and the progress line `join` prints.
Callers hold the peer's lock.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from p2p_diloco.config import RunManifest
from p2p_diloco.node.guard import GuardedHandlers
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.swarm.records import MAX_COUNTERS, MAX_DECISIONS, MAX_TEXT

STEP_TIME_EMA = 0.1
MAX_TAG_CHARS = 64


def _top(counter: Counter, limit: int) -> list:
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]


def _short(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rejection_counts(peer: Peer | None, guard: GuardedHandlers | None, transport: Any) -> Counter[str]:
    """Every rejection this peer answered or dropped, by reason tag (peer, synchronizer, guard, transport)."""
    total: Counter[str] = Counter()
    if peer is not None:
        total.update(peer.rejections)
        if peer.sync is not None:
            total.update(peer.sync.rejections)
    if guard is not None:
        total.update(guard.rejections)
    if transport is not None:
        try:
            total.update(transport.rejected.copy())
        except RuntimeError:  # changed by the transport's thread while copying: next time
            pass
    return total


def rejections_by_sender(peer: Peer) -> Counter[tuple[str, str]]:
    total: Counter[tuple[str, str]] = Counter(peer.rejections_by_sender)
    if peer.sync is not None:
        total.update(peer.sync.rejections_by_sender)
    return total


class Telemetry:
    """Step timing and contribution tracking of one node (module docstring)."""

    def __init__(self, manifest: RunManifest):
        self.tokens_per_step = manifest.diloco.batch_size * manifest.model.block_size
        self.step_time = 0.0  # moving average of the seconds between two step ends
        self.last_contribution = 0.0  # DHT time at which an update merging our delta was first seen
        self._steps_merged_seen = 0.0
        self._last_step_end: float | None = None

    def step_finished(self, monotonic_now: float) -> None:
        if self._last_step_end is not None:
            seconds = monotonic_now - self._last_step_end
            self.step_time = (
                seconds
                if self.step_time == 0
                else (1 - STEP_TIME_EMA) * self.step_time + STEP_TIME_EMA * seconds
            )
        self._last_step_end = monotonic_now

    def tokens_per_s(self, training: bool) -> float:
        return self.tokens_per_step / self.step_time if training and self.step_time > 0 else 0.0

    def heartbeat_fields(
        self,
        now: float,
        peer: Peer,
        learner: Learner,
        guard: GuardedHandlers | None,
        transport: Any,
        *,
        training: bool,
    ) -> dict[str, Any]:
        """Keyword arguments for `Peer.heartbeat` (the status fields of `HeartbeatInfo`)."""
        if learner.steps_merged > self._steps_merged_seen:
            self._steps_merged_seen = learner.steps_merged
            self.last_contribution = now
        rejections = _top(rejection_counts(peer, guard, transport), MAX_COUNTERS)
        by_sender = _top(rejections_by_sender(peer), MAX_COUNTERS)
        return {
            "step_time": self.step_time if training else 0.0,
            "tokens_per_s": self.tokens_per_s(training),
            "tokens": learner.tokens_trained,
            "updates_applied": peer.updates_applied,
            "last_contribution": self.last_contribution,
            "rejections": tuple((_short(tag, MAX_TAG_CHARS), n) for tag, n in rejections),
            "rejections_by_sender": tuple(
                (sender, _short(tag, MAX_TAG_CHARS), n) for (sender, tag), n in by_sender
            ),
            "decisions": tuple(_short(line) for line in list(peer.decisions)[-MAX_DECISIONS:]),
        }

    def progress_line(
        self, peer: Peer, learner: Learner, guard: GuardedHandlers | None, transport: Any, *, training: bool
    ) -> str:
        versions = ",".join(str(v) for v in peer.replica.versions())
        role = "synchronizer" if peer.sync else "learner"
        rejected = sum(rejection_counts(peer, guard, transport).values())
        return (
            f"step {learner.step} loss {learner.last_loss:.3f} tok/s {self.tokens_per_s(training):.0f} "
            f"role {role} sync {(peer.holder or 'none')[:12]} term {peer.term_seen} versions {versions} "
            f"applied {peer.updates_applied} digest {peer.replica.digest()[:12]} rejected {rejected}"
        )
