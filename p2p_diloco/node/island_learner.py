"""Rank 0's learner of an island (`node/island.py`): a `Learner` whose inner step is a DDP step of the
island, preceded by the control broadcast that tells the other ranks to step (or stop) and which
fragments the peer changed since (adoptions, snapshot loads), so every rank trains on the same weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

from p2p_diloco.node.island import CMD_STOP, CMD_TRAIN, Island
from p2p_diloco.swarm.learner import Learner

log = logging.getLogger(__name__)


class IslandLearner(Learner):
    """Rank 0's learner: a `Learner` whose inner step is a DDP step of the island, preceded by the
    control broadcast; fragments the peer changed (adoptions, snapshot loads) are broadcast first."""

    def __init__(self, island: Island, *args, state_dir: Path, **kwargs):
        self.island = island
        self.state_dir = state_dir
        self.dirty: set[int] = set()
        self.finished = False
        super().__init__(*args, on_params_changed=self.dirty.update, **kwargs)
        self.dirty.update(range(self.plan.num_fragments))  # the replica was loaded into the model
        self.ranks = island.world_size
        self.ddp = island.wrap(self.model)

    def _lead(self, command: int) -> None:
        dirty = sorted(self.dirty)
        self.dirty.clear()
        self.island.exchange_control(command, self.step, dirty, self.plan.num_fragments)
        if dirty and not self.island.sync_fragments(self.params, self.plan, dirty):
            self.dirty.update(range(self.plan.num_fragments))  # repair: everything again next step

    def train_step(self, compute_seconds: float | None = None) -> float:
        self.settle()
        self._lead(CMD_TRAIN)
        raw, self.model = self.model, self.ddp  # the base step runs forward/backward through DDP
        try:
            return super().train_step(compute_seconds)
        finally:
            self.model = raw

    def finish(self) -> None:
        """Release the followers (STOP after a last broadcast) and write rank 0's digest; idempotent,
        never raises (also called on the way out after a rank died)."""
        if self.finished:
            return
        self.finished = True
        try:
            if not self.island.broken:
                self.settle()
                self._lead(CMD_STOP)
            self.island.write_digest(self.state_dir, self.step, self.params)
        except Exception as exc:
            log.warning("island: could not release the other ranks: %r", exc)


def finish_island(learner: Learner | None) -> None:
    """`IslandLearner.finish` for rank 0 of an island; nothing for a plain learner."""
    if isinstance(learner, IslandLearner):
        learner.finish()
