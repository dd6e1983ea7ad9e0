"""The training thread of a `join` process (its main thread): the loop of inner steps, and what it publishes.

`TrainingLoop` owns the `Learner` (model, optimizer, data stream, inbox) and the step timing: one inner
step, then the due delta (if any) goes to the peer's owner thread as an event (`DeltaReady`); adoptions
come back through the learner's inbox and are applied at step boundaries. Between steps it runs the
global evaluation the owner thread asked for (`node.observing`). After `--max-steps` (or SIGUSR1) it
stops training and only settles what the peer posts until `stop`.

No other thread reads the learner: after every step the loop publishes a `TrainingView`, an immutable
snapshot of its numbers replaced whole (`view`), which the owner thread reads for heartbeats, progress
lines, metrics and the demo's goodput counters. The one thing the training thread reads of the peer is
its `SendGate` (`Learner.take_due`), one tuple attribute the owner thread replaces whole.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2p_diloco.node.island_learner import finish_island
from p2p_diloco.node.options import NodeOptions
from p2p_diloco.node.priority import lower_this_thread
from p2p_diloco.owner import Owner
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.wire.interfaces import Clock

IDLE_POLL_SECONDS = 0.05  # how often a peer that does not train (max steps reached) checks for work
STEP_TIME_EMA = 0.1


@dataclass(frozen=True)
class TrainingView:
    """What the training thread last published about its learner (module docstring); never changed."""

    training: bool = True  # False once it stopped training (it still serves the swarm)
    step: int = 0
    loss: float = math.nan
    tokens: int = 0  # tokens trained by this process
    steps_merged: float = 0.0  # inner steps whose deltas reached the global model
    compute_seconds: float = 0.0
    compute_merged: float = 0.0
    deltas_sent: int = 0
    deltas_rejected: int = 0
    step_time: float = 0.0  # moving average of the seconds between two step ends
    tokens_per_s: float = 0.0  # 0 when not training
    loop_started: float = 0.0  # monotonic start of the training loop, 0 before it


class StepTimer:
    """The moving average of the time between two step ends."""

    def __init__(self) -> None:
        self.step_time = 0.0
        self._last_end: float | None = None

    def finished(self, monotonic_now: float) -> None:
        if self._last_end is not None:
            seconds = monotonic_now - self._last_end
            if self.step_time == 0:
                self.step_time = seconds
            else:
                self.step_time = (1 - STEP_TIME_EMA) * self.step_time + STEP_TIME_EMA * seconds
        self._last_end = monotonic_now


class TrainingLoop:
    """The training thread's loop (module docstring); `run` until `stop`, `view` for the other threads."""

    def __init__(
        self,
        options: NodeOptions,
        learner: Learner,
        *,
        gate: Callable[[], object],  # the peer's `SendGate` (its state replaced whole by the owner thread)
        post: Callable[[object], None],  # to the owner thread (`ThreadedDriver.post`)
        clock: Clock,
        stop: threading.Event,
        finish_training: threading.Event,
        tokens_per_step: int,
        after_step: Callable[[], None] = lambda: None,
        event: Callable[..., None] = lambda kind, **fields: None,
        say: Callable[[str], None] = lambda line: None,
    ):
        self.options, self.learner, self.gate, self.post, self.clock = options, learner, gate, post, clock
        self.stop, self.finish_training = stop, finish_training
        self.tokens_per_step = tokens_per_step
        self.after_step, self.event, self.say = after_step, event, say
        self.owner = Owner("training")  # the constructing thread, which runs the loop (the main thread)
        self.timer = StepTimer()
        self.training = True
        self.loop_started = 0.0
        self.view = TrainingView()

    def run(self) -> None:
        opts = self.options
        lower_this_thread(opts.train_nice)  # the owner, DHT and transport threads keep their priority
        self.owner.take()
        self.loop_started = time.monotonic()
        self._publish()
        while not self.stop.is_set():
            started = time.monotonic()
            if self.training and self._training_done():
                self.training = False
                finish_island(self.learner)  # an island's other ranks stop with the training
                self._publish()
            if self.training:
                self._train_step()
            if not self.training:
                self.learner.settle()  # adopt what the peer posted: no step does it now
                self._publish()
                self.stop.wait(IDLE_POLL_SECONDS)
            elif opts.min_step_time > 0:  # a paced learner emulates a slower device
                self.stop.wait(max(0.0, started + opts.min_step_time - time.monotonic()))
            self.after_step()  # global eval, when the owner thread asked for one

    def _training_done(self) -> bool:
        max_steps = self.options.max_steps
        reached = max_steps is not None and self.learner.step >= max_steps
        if reached or self.finish_training.is_set():
            why = f"reached --max-steps {max_steps}" if reached else "asked to finish training"
            self.event("training_stopped", step=self.learner.step, why=why)
            self.say(f"{why}: training stopped at step {self.learner.step}; still serving the swarm")
            return True
        return False

    def _train_step(self) -> None:
        # a paced (--min-step-time) learner emulates a slower device: its step counts as that long
        min_step = self.options.min_step_time
        paced = max(min_step, self.timer.step_time) if min_step else None
        self.learner.train_step(compute_seconds=paced)
        ready = self.learner.take_due(self.clock.now(), self.gate())
        if ready is not None:
            self.post(ready)  # compressed and sent on the owner thread while the next step runs
        self.timer.finished(time.monotonic())
        self._publish()

    def _publish(self) -> None:
        """Replace `view` with this moment's numbers (the training thread's only shared output)."""
        self.owner.check("the training view")
        learner, step_time = self.learner, self.timer.step_time
        training = self.training
        self.view = TrainingView(
            training=training,
            step=learner.step,
            loss=learner.last_loss,
            tokens=learner.tokens_trained,
            steps_merged=learner.steps_merged,
            compute_seconds=learner.compute_seconds,
            compute_merged=learner.compute_merged,
            deltas_sent=learner.deltas_sent,
            deltas_rejected=learner.deltas_rejected,
            step_time=step_time if training else 0.0,
            tokens_per_s=self.tokens_per_step / step_time if training and step_time > 0 else 0.0,
            loop_started=self.loop_started,
        )
