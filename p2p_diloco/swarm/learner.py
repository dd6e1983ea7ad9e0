"""The learner: inner AdamW steps and fragment deltas, owned by the training thread.

Only the thread that trains touches a `Learner`: the model, the optimizer, the data sampler, the work
counted per fragment, the deltas in flight and the anchors (the global Theta_p last adopted, with its
version). It talks to its peer through two queues: `take_due` hands a due fragment's delta to the peer
(`effects.DeltaReady`, which the peer compresses and sends), and the peer's messages (`Adopt`,
`Release`, `Reload`) wait in `inbox` until the next step boundary (`settle`, run before every step and
before a delta is taken). A message the peer posts while a step runs therefore takes effect as if it
had arrived at once: no step sees half-moved parameters and nobody waits for a step.

Adoption rule (`protocol.diloco`: `outer_delta`, `adopt`, `follow`). The delta of fragment p is always
`anchor_p - theta_p`. When an update for p is adopted:
- if it merged this learner's in-flight delta, theta_p becomes the new Theta_p plus the progress made
  since the delta was sent (`carry`, default), exactly the new Theta_p (`overwrite`, that progress is
  lost), or a blend `(1-alpha) theta_p + alpha Theta_p` (`blend`);
- otherwise (others' deltas were merged) theta_p moves by the global change Theta_new - Theta_old, so
  no local work is lost and the next delta still carries it.
Replica tensors are never changed in place (`GlobalReplica`), so anchors share them without copies.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.trainer import InnerTrainer, make_trainer
from p2p_diloco.protocol import diloco
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.messages import DeltaHeader
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.protocol.schedule import LearnerSchedule
from p2p_diloco.swarm.effects import Adopt, DeltaReady, LearnerMessage, Release, SendGate, Tensors
from p2p_diloco.wire.codecs.placement import delta_device, delta_for_encoder


@dataclass
class FragmentWork:
    """Work on one fragment not yet handed over in a delta."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0  # compute time of those steps


@dataclass
class SentDelta:
    """A delta in flight: taken, not yet merged (or released)."""

    seq: int
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
        on_params_changed: Callable[[Iterable[int]], None] | None = None,
        first_seq: int = 0,
    ):
        self.peer_id = peer_id
        self.manifest = manifest
        self.plan = plan
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.device = device
        self.inbox: queue.SimpleQueue[LearnerMessage] = queue.SimpleQueue()
        self.on_params_changed = on_params_changed or (lambda fragments: None)
        cfg = manifest.diloco
        self.schedule = LearnerSchedule(cfg.fragments, cfg.steps_per_fragment, cfg.max_in_flight)
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self.work = [FragmentWork() for _ in range(plan.num_fragments)]
        self.sent: dict[int, SentDelta] = {}
        # per fragment, the oldest delta that went back unmerged after it left (its work is in every later
        # delta of the fragment); an update that merges it after all is adopted as this learner's own
        self.released: dict[int, SentDelta] = {}
        self.urgent: set[int] = set()  # fragments to send at the next step (their deltas went back)
        self.anchors: list[tuple[int, Tensors]] = [
            (replica.version(p), replica.params_view(p)) for p in range(plan.num_fragments)
        ]
        self.ranks = 1  # processes whose equal batches one inner step trains on (an island's world size)
        self.step = 0
        # delta seqs keep increasing across restarts of the peer (a driver starts them at its clock in ms):
        # synchronizers recognise work merged already by them (`UpdateBook.merged_already`)
        self.seq = first_seq
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
        self._load(dict(enumerate(self.anchors)))

    # ---- training -------------------------------------------------------------------------------

    def train_step(self, compute_seconds: float | None = None) -> float:
        """One inner AdamW step on this learner's data; counts tokens, steps and compute time for every
        fragment. `compute_seconds` is the step's duration when the driver knows it (fake clock)."""
        self.settle()
        started = time.perf_counter()
        # the step itself (autocast, accumulation, clipping, LR schedule) is model/trainer.py's; a driver
        # may set `self.trainer` first (e.g. with the peer's --micro-batch)
        if self.trainer is None:
            self.trainer = make_trainer(
                self.manifest, self.model, self.optimizer, self.sampler, device=self.device
            )
        loss, tokens = self.trainer.step(self.model)
        seconds = time.perf_counter() - started if compute_seconds is None else compute_seconds
        self.count_step(tokens * self.ranks, self.ranks, seconds)
        if loss is not None:  # None: a step whose loss the trainer did not read (train.loss_every)
            self.last_loss = loss
        return self.last_loss

    def count_step(self, tokens: int, steps: int, seconds: float) -> None:
        """Credit one inner step's work (`steps` > 1: an island's ranks' batches) to every fragment."""
        self.compute_seconds += seconds
        for work in self.work:
            work.tokens += tokens
            work.steps += steps
            work.seconds += seconds
        self.step += 1
        self.tokens_trained += tokens

    def _theta(self, fragment: int) -> dict[str, torch.Tensor]:
        return {
            name: self.params[name].detach().to("cpu", torch.float32) for name in self.plan.names(fragment)
        }

    def take_due(self, now: float, gate: SendGate | None = None) -> DeltaReady | None:
        """If the schedule says a fragment is due now, its delta (marked in flight) for the peer. Nothing
        while the peer's `gate` is shut (no synchronizer known, or deltas held): the work accumulates."""
        self.settle()
        if gate is not None and not gate.open(now):
            return None
        p = self._urgent_fragment()
        if p is None:
            decision = self.schedule.on_step(self.step, frozenset(self.sent))
            if decision.action != "send" or decision.fragment is None:
                return None
            p = decision.fragment
        work = self.work[p]
        if work.steps == 0:
            return None
        version, anchor = self.anchors[p]
        theta = self._theta(p)
        self.seq += 1
        header = DeltaHeader(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            fragment=p,
            anchor_version=version,
            tokens=work.tokens,
            steps=work.steps,
            seq=self.seq,
            since_seq=self.released[p].seq if p in self.released else 0,
        )
        at_send = {name: t.clone() for name, t in theta.items()}  # theta may share the live parameters
        self.sent[p] = SentDelta(self.seq, work.tokens, work.steps, work.seconds, at_send)
        self.work[p] = FragmentWork()
        self.deltas_sent += 1
        # on the device whose encoder quantizes it (`wire.codecs.placement`): CUDA with bitsandbytes, else CPU
        where = delta_device(self.device, self.manifest.wire.codec)
        delta = delta_for_encoder(anchor, theta, self.params, where)
        return DeltaReady(fragment=p, seq=self.seq, header=header, delta=delta, now=now)

    # ---- messages from the peer -----------------------------------------------------------------

    def settle(self) -> None:
        """Handle every message the peer posted since the last step boundary, in order."""
        changed: set[int] = set()
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, Adopt):
                self._adopt(message)
                changed.add(message.record.fragment)
            elif isinstance(message, Release):
                self._release(message)
            else:
                self._load(message.fragments)
                changed.update(message.fragments)
        if changed:
            self.on_params_changed(sorted(changed))

    def _urgent_fragment(self) -> int | None:
        """A fragment whose delta went back at a change of synchronizer, if one can go out now (tau)."""
        for p in sorted(self.urgent):
            self.urgent.discard(p)
            if p not in self.sent and self.work[p].steps > 0 and len(self.sent) < self.schedule.max_in_flight:
                return p
        return None

    def _release(self, message: Release) -> None:
        fragment = message.fragment
        sent = self.sent.get(fragment)
        if sent is None or sent.seq != message.seq:
            return
        del self.sent[fragment]
        work = self.work[fragment]
        work.tokens += sent.tokens
        work.steps += sent.steps
        work.seconds += sent.seconds
        self.deltas_rejected += 1
        if message.sent_out:
            self.released.setdefault(fragment, sent)
        if message.resend:
            self.urgent.add(fragment)

    def _adopt(self, message: Adopt) -> None:
        record, old_global, new_global = message.record, message.old_global, message.new_global
        p = record.fragment
        sent, released = self.sent.get(p), self.released.get(p)
        seq = record.seq_of(self.peer_id)  # None: not mine, or a record without seqs
        contributed = sent is not None and record.merged_delta(self.peer_id, sent.seq)
        if not contributed and released is not None and seq is not None and seq == released.seq:
            self._adopt_released(message, released)
            return
        mode = self.manifest.diloco.adoption
        with torch.no_grad():
            for name in self.plan.names(p):
                param = self.params[name]
                theta = param.detach().to("cpu", torch.float32)
                if contributed:
                    alpha = self.manifest.diloco.blend_alpha
                    at_send = sent.theta_at_send[name]
                    new_theta = diloco.adopt(theta, new_global[name], at_send=at_send, mode=mode, alpha=alpha)
                else:
                    new_theta, shift = diloco.follow(theta, old_global[name], new_global[name])
                    if sent is not None:
                        sent.theta_at_send[name] += shift
                    if released is not None:
                        released.theta_at_send[name] += shift
                param.copy_(new_theta.to(param.device, param.dtype))
        self.anchors[p] = (message.version, new_global)
        if contributed:
            del self.sent[p]
            self.released.pop(p, None)  # its work went out again in this delta, now merged
            self.steps_merged += sent.steps / self.plan.num_fragments
            self.compute_merged += sent.seconds / self.plan.num_fragments
            if mode == "overwrite":
                self.work[p] = FragmentWork()

    def _adopt_released(self, message: Adopt, released: SentDelta) -> None:
        """An update merged a delta that had gone back to this learner (an old holder merged it after
        all): theta moves to the new global plus the progress since that delta was sent, so its work is
        not sent again. A delta in flight that repeats it is dropped (synchronizers refuse it as
        "already merged"); what it carried beyond the released work goes out with the next one."""
        p, new_global = message.record.fragment, message.new_global
        with torch.no_grad():
            for name in self.plan.names(p):
                param = self.params[name]
                theta = param.detach().to("cpu", torch.float32)
                new_theta = diloco.adopt(theta, new_global[name], at_send=released.theta_at_send[name])
                param.copy_(new_theta.to(param.device, param.dtype))
        self.anchors[p] = (message.version, new_global)
        del self.released[p]
        again = self.sent.pop(p, None)
        if again is not None:  # carried the released work and more: keep the more, drop the repeat
            work = self.work[p]
            work.tokens += max(0, again.tokens - released.tokens)
            work.steps += max(0, again.steps - released.steps)
            work.seconds += max(0.0, again.seconds - released.seconds)
            self.urgent.add(p)
        self.steps_merged += released.steps / self.plan.num_fragments
        self.compute_merged += released.seconds / self.plan.num_fragments

    def _load(self, fragments: Mapping[int, tuple[int, Tensors]]) -> None:
        with torch.no_grad():
            for p, (version, values) in fragments.items():
                for name, value in values.items():
                    self.params[name].copy_(value.to(self.params[name].device, self.params[name].dtype))
                self.anchors[p] = (version, values)
                self.sent.pop(p, None)
                self.released.pop(p, None)
                self.work[p] = FragmentWork()
