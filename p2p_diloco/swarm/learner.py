"""The learner: inner AdamW steps and fragment deltas, owned by the training thread.

Only the thread that trains touches a `Learner`: the model, the optimizer, the data sampler, the work
counted per fragment not yet handed over, which seq of each fragment is out (`out`) and the anchors (the
global Theta_p last adopted, with its version). Everything else about a delta in flight (where it went,
when, the work it carries, theta when it was taken) is the owner thread's one record (`swarm.outbox`),
which decides whether an update merged it and says so in `Adopt.mine`. It talks to its peer through
two queues: `take_due` hands a due fragment's delta to the peer (`effects.DeltaReady`, which the peer
compresses and sends), and the peer's messages (`Adopt`, `Release`, `Reload`) wait in `inbox` until the
next step boundary (`settle`, run before every step and before a delta is taken). A message the peer
posts while a step runs therefore takes effect as if it had arrived at once: no step sees half-moved
parameters and nobody waits for a step.

Adoption rule (`protocol.diloco`: `outer_delta`, `adopt`, `follow`). The delta of fragment p is always
`anchor_p - theta_p`. When an update for p is adopted:
- if it merged this learner's delta (`Adopt.mine`), theta_p becomes the new Theta_p plus the progress made
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
from p2p_diloco.swarm.effects import (
    Adopt,
    DeltaReady,
    DeltaWork,
    LearnerMessage,
    MergedMine,
    Release,
    Reload,
    SendGate,
    Tensors,
)
from p2p_diloco.wire.codecs.placement import delta_device, delta_for_encoder


@dataclass
class FragmentWork:
    """Work on one fragment not yet handed over in a delta."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0  # compute time of those steps

    def add(self, work: DeltaWork) -> None:
        self.tokens += work.tokens
        self.steps += work.steps
        self.seconds += work.seconds

    def handed_over(self) -> DeltaWork:
        return DeltaWork(self.tokens, self.steps, self.seconds)


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
        self.out: dict[int, int] = {}  # fragment -> the seq of its delta handed over, not merged or back
        self.settled = [0] * plan.num_fragments  # messages handled per fragment (`DeltaReady.settled`)
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
            decision = self.schedule.on_step(self.step, frozenset(self.out))
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
        )  # since_seq: the owner thread's, which knows what went back (`Outbox.route`)
        at_send = {name: t.clone() for name, t in theta.items()}  # theta may share the live parameters
        self.out[p] = self.seq
        self.work[p] = FragmentWork()
        self.deltas_sent += 1
        # on the device whose encoder quantizes it (`wire.codecs.placement`): CUDA with bitsandbytes, else CPU
        where = delta_device(self.device, self.manifest.wire.codec)
        delta = delta_for_encoder(anchor, theta, self.params, where)
        return DeltaReady(
            fragment=p,
            seq=self.seq,
            header=header,
            delta=delta,
            now=now,
            work=work.handed_over(),
            theta_at_send=at_send,
            settled=self.settled[p],
        )

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
                self.settled[message.record.fragment] += 1
                self._adopt(message)
                changed.add(message.record.fragment)
            elif isinstance(message, Release):
                self.settled[message.fragment] += 1
                self._release(message)
            else:
                self._reload(message)
                changed.update(message.fragments)
        if changed:
            self.on_params_changed(sorted(changed))

    def _urgent_fragment(self) -> int | None:
        """A fragment whose delta went back at a change of synchronizer, if one can go out now (tau)."""
        for p in sorted(self.urgent):
            self.urgent.discard(p)
            if p not in self.out and self.work[p].steps > 0 and len(self.out) < self.schedule.max_in_flight:
                return p
        return None

    def _release(self, message: Release) -> None:
        """A delta handed over came back unmerged: its work goes out with the next delta of the fragment."""
        fragment = message.fragment
        if self.out.get(fragment) != message.seq:  # not the delta out now (a snapshot replaced the fragment)
            return
        del self.out[fragment]
        self.work[fragment].add(message.work)
        if message.sent_out:
            self.deltas_rejected += 1
        if message.resend:
            self.urgent.add(fragment)

    def _adopt(self, message: Adopt) -> None:
        p, mine = message.record.fragment, message.mine
        if mine is not None and mine.released:
            self._adopt_released(message, mine)
            return
        contributed = mine is not None and self.out.get(p) == mine.seq
        mode = self.manifest.diloco.adoption
        with torch.no_grad():
            for name in self.plan.names(p):
                param = self.params[name]
                theta = param.detach().to("cpu", torch.float32)
                if contributed:
                    alpha = self.manifest.diloco.blend_alpha
                    at_send = mine.theta_at_send[name]
                    new_theta = diloco.adopt(
                        theta, message.new_global[name], at_send=at_send, mode=mode, alpha=alpha
                    )
                else:
                    new_theta, _ = diloco.follow(theta, message.old_global[name], message.new_global[name])
                param.copy_(new_theta.to(param.device, param.dtype))
        self.anchors[p] = (message.version, message.new_global)
        if contributed:
            del self.out[p]
            self._count_merged(mine.work)
            if mode == "overwrite":
                self.work[p] = FragmentWork()

    def _adopt_released(self, message: Adopt, released: MergedMine) -> None:
        """An update merged a delta that had gone back to this learner (an old holder merged it after
        all): theta moves to the new global plus the progress since that delta was sent, and its work, which
        went back to this learner, is not sent again. A delta out that repeats it is dropped (the owner
        thread says so in `repeat`); what it carried beyond the released work goes out with the next one."""
        p, new_global = message.record.fragment, message.new_global
        with torch.no_grad():
            for name in self.plan.names(p):
                param = self.params[name]
                theta = param.detach().to("cpu", torch.float32)
                new_theta = diloco.adopt(theta, new_global[name], at_send=released.theta_at_send[name])
                param.copy_(new_theta.to(param.device, param.dtype))
        self.anchors[p] = (message.version, new_global)
        if released.repeat is not None:
            seq, beyond = released.repeat
            if self.out.get(p) == seq:
                del self.out[p]
                self.work[p].add(beyond)
                self.urgent.add(p)
        elif p not in self.out:  # else the delta out repeats it: it comes back without it (`Outbox.route`)
            remaining = self.work[p].handed_over().beyond(released.work)
            self.work[p] = FragmentWork(remaining.tokens, remaining.steps, remaining.seconds)
        self._count_merged(released.work)

    def _count_merged(self, work: DeltaWork) -> None:
        self.steps_merged += work.steps / self.plan.num_fragments
        self.compute_merged += work.seconds / self.plan.num_fragments

    def _reload(self, message: Reload) -> None:
        for p in message.fragments:
            self.settled[p] += 1
        self._load(message.fragments)

    def _load(self, fragments: Mapping[int, tuple[int, Tensors]]) -> None:
        with torch.no_grad():
            for p, (version, values) in fragments.items():
                for name, value in values.items():
                    self.params[name].copy_(value.to(self.params[name].device, self.params[name].dtype))
                self.anchors[p] = (version, values)
                self.out.pop(p, None)
                self.work[p] = FragmentWork()
