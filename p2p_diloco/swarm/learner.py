"""The learner: inner AdamW steps, fragment deltas with error feedback, adoption of merged updates.

Sans-IO: the learner never touches the network or a clock. Its driver (the in-process swarm or a real
peer) calls `train_step`, sends the frames `take_due_delta` returns, feeds back the receiver's reply
with `on_delta_reply`, and calls `adopt` after the replica applied an update.

Thread safety: every public method that reads or changes state holds the learner's own re-entrant
`lock` (an acceptance reply changes nothing and returns without it), so a real peer runs
`train_step` without its peer lock while other threads apply updates to the replica. An adoption that
arrives while another thread holds the lock (mid-step) is queued with the replica's values of that
moment, and every public method first applies the queued adoptions in order: the learner then acts as
if each had happened at once, no step sees half-moved parameters, and the thread that applied the
update never waits for the step.

Adoption rule. The delta of fragment p is always `anchor_p - theta_p`, where the anchor is the global
Theta_p the learner last adopted (the replica's current value). When an update for p is applied:
- if it merged this learner's in-flight delta, theta_p becomes the new Theta_p plus the progress made
  since the delta was sent (`carry`, default), exactly the new Theta_p (`overwrite`, that progress is
  lost), or a blend `(1-alpha) theta_p + alpha Theta_p` (`blend`);
- otherwise (others' deltas were merged) theta_p moves by the global change Theta_new - Theta_old, so
  no local work is lost and the next delta still carries it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.trainer import InnerTrainer, make_trainer
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.schedule import LearnerSchedule
from p2p_diloco.wire.codec import ErrorFeedback
from p2p_diloco.wire.frames import encode_delta

ACCEPTED_REPLIES = ("accepted", "replaced", "opened round")

_Method = TypeVar("_Method", bound=Callable[..., Any])


def holding_lock(method: _Method) -> _Method:
    """Run a `Learner` method under the learner's `lock` (module docstring)."""

    @functools.wraps(method)
    def locked(self: Learner, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self._adopt_queued()
            result = method(self, *args, **kwargs)
            self._adopt_queued()  # what arrived during a step, before the lock is let go
            return result

    return locked  # type: ignore[return-value]


@dataclass
class FragmentWork:
    """Work on one fragment not yet handed over in a delta."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0  # compute time of those steps


@dataclass(frozen=True)
class DueDelta:
    """A fragment's delta taken at a step boundary and marked in flight, not yet compressed or framed."""

    fragment: int
    header: DeltaHeader
    delta: dict[str, torch.Tensor]


@dataclass
class SentDelta:
    """A delta in flight: sent, not yet merged (or rejected, or timed out)."""

    seq: int
    sent_at: float
    anchor_version: int
    tokens: int
    steps: int
    seconds: float
    theta_at_send: dict[str, torch.Tensor]


class Learner:
    def __init__(
        self,
        peer_id: str,
        manifest: RunManifest,
        plan: FragmentPlan,
        replica: GlobalReplica,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler,
        *,
        device: str = "cpu",
    ):
        self.lock = threading.RLock()
        # (record, old Theta_p, new Theta_p) of adoptions that arrived while the lock was busy, in order
        self._queued: deque[tuple[UpdateRecord, Mapping[str, torch.Tensor], dict[str, torch.Tensor]]] = (
            deque()
        )
        self.peer_id = peer_id
        self.manifest = manifest
        self.plan = plan
        self.replica = replica
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.device = device
        cfg = manifest.diloco
        self.schedule = LearnerSchedule(cfg.fragments, cfg.steps_per_fragment, cfg.max_in_flight)
        wire = manifest.wire
        self.feedback = ErrorFeedback(
            codec=wire.codec, block_size=wire.block_size, enabled=wire.error_feedback
        )
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self.work = [FragmentWork() for _ in range(plan.num_fragments)]
        self.sent: dict[int, SentDelta] = {}
        self.step = 0
        self.seq = 0
        self.tokens_trained = 0
        # Inner steps (and their compute seconds) whose work reached the global model, counted per
        # fragment: a step counts 1/P each time one of its fragments' deltas is merged.
        self.steps_merged = 0.0
        self.compute_seconds = 0.0
        self.compute_merged = 0.0
        self.deltas_sent = 0
        self.deltas_rejected = 0
        self.last_loss = float("nan")
        self.trainer: InnerTrainer | None = None  # built at the first step unless a driver sets one
        self.load_global_into_model()

    # ---- training -------------------------------------------------------------------------------

    @holding_lock
    def train_step(self, compute_seconds: float | None = None) -> float:
        """One inner AdamW step on this learner's shard; counts tokens, steps and compute time for every
        fragment. `compute_seconds` is the step's duration when the driver knows it (fake clock);
        otherwise it is measured."""
        started = time.perf_counter()
        # issue #13: the step itself (autocast, accumulation, clipping, LR schedule) is model/trainer.py's;
        # a driver may set `self.trainer` first (e.g. with the peer's --micro-batch).
        if self.trainer is None:
            self.trainer = make_trainer(
                self.manifest, self.model, self.optimizer, self.sampler, device=self.device
            )
        loss, tokens = self.trainer.step(self.model)
        seconds = time.perf_counter() - started if compute_seconds is None else compute_seconds
        self.compute_seconds += seconds
        for work in self.work:
            work.tokens += tokens
            work.steps += 1
            work.seconds += seconds
        self.step += 1
        self.tokens_trained += tokens
        if loss is not None:  # None: a step whose loss the trainer did not read (train.loss_every)
            self.last_loss = loss
        return self.last_loss

    def _theta(self, fragment: int) -> dict[str, torch.Tensor]:
        return {
            name: self.params[name].detach().to("cpu", torch.float32) for name in self.plan.names(fragment)
        }

    @holding_lock
    def delta_pending(self) -> bool:
        """Whether a fragment's send is due (maybe deferred by `max_in_flight`): `take_due_delta` may then
        have a frame. A cheap check for drivers that take a lock around `take_due_delta`."""
        return self.schedule.pending(self.step) is not None

    @holding_lock
    def settle(self) -> None:
        """Apply queued adoptions now (a driver that stopped training calls this: nothing else would)."""

    @holding_lock
    def take_due_delta(self, now: float) -> tuple[int, bytes] | None:
        """If the schedule says a fragment is due now, build its delta frame and mark it in flight."""
        due = self.snapshot_due_delta(now)
        frame = None if due is None else self.encode_due(due)
        return None if due is None or frame is None else (due.fragment, frame)

    @holding_lock
    def snapshot_due_delta(self, now: float) -> DueDelta | None:
        """The first half of `take_due_delta`: the due fragment's delta, marked in flight, uncompressed."""
        decision = self.schedule.on_step(self.step, frozenset(self.sent))
        if decision.action != "send" or decision.fragment is None:
            return None
        p = decision.fragment
        work = self.work[p]
        if work.steps == 0:
            return None
        anchor = self.replica.params_of(p)
        theta = self._theta(p)
        delta = {name: anchor[name] - theta[name] for name in anchor}
        self.seq += 1
        header = DeltaHeader(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=p,
            anchor_version=self.replica.versions()[p],
            tokens=work.tokens,
            steps=work.steps,
            seq=self.seq,
        )
        self.sent[p] = SentDelta(
            seq=self.seq,
            sent_at=now,
            anchor_version=header.anchor_version,
            tokens=work.tokens,
            steps=work.steps,
            seconds=work.seconds,
            theta_at_send={k: v.clone() for k, v in theta.items()},
        )
        self.work[p] = FragmentWork()
        self.deltas_sent += 1
        return DueDelta(p, header, delta)

    def encode_due(self, due: DueDelta) -> bytes | None:
        """The second half: compress (with error feedback) and frame `due`; None if it was released since
        (do not send it: its work is back in the counters).

        Not under the learner lock, so a real peer compresses while the next step runs. The error feedback
        is touched only here and where a delta is released or the model reloaded (`_release`,
        `load_global_into_model`); the caller keeps those apart (a real peer holds its peer lock for all).
        """
        sent = self.sent.get(due.fragment)
        if sent is None or sent.seq != due.header.seq:
            return None
        payload, _ = self.feedback.compress(due.fragment, due.delta)
        return encode_delta(due.header, payload)

    # ---- replies and timeouts -------------------------------------------------------------------

    def on_delta_reply(self, fragment: int, seq: int, reply: str) -> bool:
        """Handle the synchronizer's answer; returns True when the delta was refused and released.

        An acceptance changes nothing, so it returns at once: the reply thread (which holds the peer
        lock) never waits for a running step to learn that."""
        if reply.startswith(ACCEPTED_REPLIES):
            return False
        return self._on_refusal(fragment, seq)

    @holding_lock
    def _on_refusal(self, fragment: int, seq: int) -> bool:
        sent = self.sent.get(fragment)
        if sent is None or sent.seq != seq:
            return False
        self._release(fragment)
        self.deltas_rejected += 1
        return True

    @holding_lock
    def expire_in_flight(self, now: float, timeout: float) -> list[int]:
        """Release deltas with no merged update after `timeout` s (lost with a crashed synchronizer)."""
        expired = [p for p, s in self.sent.items() if now - s.sent_at > timeout]
        for p in expired:
            self._release(p)
        return expired

    def _release(self, fragment: int) -> None:
        """The delta will not be merged: its work goes back to the fragment's counters and is resent."""
        sent = self.sent.pop(fragment)
        self.work[fragment].tokens += sent.tokens
        self.work[fragment].steps += sent.steps
        self.work[fragment].seconds += sent.seconds
        self.feedback.reset(fragment)

    # ---- adoption -------------------------------------------------------------------------------

    def adopt(self, record: UpdateRecord, old_global: Mapping[str, torch.Tensor]) -> str:
        """Called after the replica applied `record`; moves theta_p as the module docstring says, now if
        the lock is free, else before the learner's next operation (queued, with this moment's Theta_p)."""
        new_global = self.replica.params_of(record.fragment)
        if not self.lock.acquire(blocking=False):
            self._queued.append((record, old_global, new_global))
            return "queued until the running step ends"
        try:
            self._adopt_queued()
            return self._adopt_now(record, old_global, new_global)
        finally:
            self.lock.release()

    def _adopt_queued(self) -> None:
        """Apply adoptions queued while the lock was busy (called holding it)."""
        while self._queued:
            self._adopt_now(*self._queued.popleft())

    def _adopt_now(
        self,
        record: UpdateRecord,
        old_global: Mapping[str, torch.Tensor],
        new_global: Mapping[str, torch.Tensor],
    ) -> str:
        p = record.fragment
        sent = self.sent.get(p)
        contributed = sent is not None and any(peer == self.peer_id for peer, _ in record.contributors)
        mode = self.manifest.diloco.adoption
        with torch.no_grad():
            for name in self.plan.names(p):
                param = self.params[name]
                theta = param.detach().to("cpu", torch.float32)
                if contributed:
                    if mode == "overwrite":
                        new_theta = new_global[name]
                    elif mode == "blend":
                        alpha = self.manifest.diloco.blend_alpha
                        new_theta = theta * (1 - alpha) + new_global[name] * alpha
                    else:
                        new_theta = new_global[name] + (theta - sent.theta_at_send[name])
                else:
                    shift = new_global[name] - old_global[name]
                    new_theta = theta + shift
                    if sent is not None:
                        sent.theta_at_send[name] += shift
                param.copy_(new_theta.to(param.device, param.dtype))
        if contributed:
            del self.sent[p]
            self.steps_merged += sent.steps / self.plan.num_fragments
            self.compute_merged += sent.seconds / self.plan.num_fragments
            if mode == "overwrite":
                self.work[p] = FragmentWork()
            return "adopted own merge"
        return "shifted by others' merge"

    @holding_lock
    def load_global_into_model(self, fragments: list[int] | None = None) -> None:
        """Overwrite theta with the replica's Theta (start, snapshot download); drops in-flight state."""
        with torch.no_grad():
            for p in range(self.plan.num_fragments) if fragments is None else fragments:
                for name, value in self.replica.params_of(p).items():
                    self.params[name].copy_(value.to(self.params[name].device, self.params[name].dtype))
                self.sent.pop(p, None)
                self.work[p] = FragmentWork()
                self.feedback.reset(p)
