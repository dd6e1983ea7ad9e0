"""`p2p-diloco baseline-worker --mode diloco`: one peer of synchronous DiLoCo on hivemind, the stronger
baseline.

Every peer trains what a decoupled learner trains (the manifest's model and initial weights, its own
stream of the corpus, batch size, AdamW and the ``[train]`` inner step of `model.trainer`) for H inner
steps (the manifest's `inner_steps`), then all peers all-reduce their outer gradients Θ − θ through
hivemind (`outer_averager.OuterAverager`) and each applies the manifest's outer Nesterov step to Θ and
trains on from it (θ ← Θ). Nobody trains while waiting for a round: that is what makes it synchronous.

Round rules (`rounds.decide_round`, `rounds.settle_round`; why they converge: `rounds`' docstring): wait
for the peers of this epoch to report their round done (one silent for a grace period past when its
progress records said it would be done is skipped; at most `wait_limit` s in all) and for peers whose
record is behind; all-reduce with whoever joined within the matchmaking window; a failed all-reduce is
tried again, and so is one that hivemind reported done while part of the average never came back (it
fills such parts with this peer's own values: `outer_averager`); a peer that finds another one ahead (it
missed a round or restarted) loads Θ, momentum and epoch from the most advanced peer and drops its own
round; a peer with no other peer done steps alone. Members of one all-reduce whose outer states differ
(as when two peers stepped alone at one epoch) keep the least digest's: the others
(``global_models_differ`` event) never step that epoch; they wait for a member that stepped to show up
ahead and load its state, joining the epoch's all-reduce again only after a grace. A SIGKILLed peer
loses its unfinished round; restarted, it resumes from its ``baseline.pt`` (Θ, momentum, AdamW state,
epoch: `checkpoint` format with this mode's optimizer dict) or from a peer that is ahead.

The books, events, checkpoint file and shutdown are `worker.BaselineWorker`'s, so the demo accounts both
baselines alike: compute (forward, backward and AdamW of every inner step) is merged when its round is
averaged or stepped alone, dropped on a reload; the wait and the all-reduce are blocked time.
``global_step`` events add ``local_digest`` (Θ had this peer applied only its own outer gradient) and
``attempts``; ``round_failed`` reports an all-reduce that will be tried again.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from typing import Any, TextIO

import torch
from hivemind.compression import NoCompression
from hivemind.utils import get_dht_time

from p2p_diloco.baseline.checkpoint import CHECKPOINT_FILE, load_checkpoint
from p2p_diloco.baseline.elastic import COMPRESSIONS
from p2p_diloco.baseline.ledger import ALONE, AVERAGED, allreduce_bytes
from p2p_diloco.baseline.outer_averager import EXACT_DTYPE, OuterAverager, RoundTracker
from p2p_diloco.baseline.rounds import (
    Decision,
    Settle,
    decide_round,
    outer_gradients,
    outer_step,
    settle_round,
)
from p2p_diloco.baseline.worker import BaselineOptions, BaselineWorker, parameter_digest, tensors_digest
from p2p_diloco.model.data import load_corpus, make_sampler
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.model.trainer import make_trainer
from p2p_diloco.net.dht_store import create_dht
from p2p_diloco.net.identity import signing_key
from p2p_diloco.node.state import StateDir
from p2p_diloco.protocol import diloco

MODE = "diloco"
RELOAD_BACKOFF = 3.0  # seconds between two tries to load a peer's state
GRACE_MIN, GRACE_WINDOWS = 3.0, 3  # a silent peer is waited for max(3 s, 3 matchmaking times) past its due


def outer_state_digest(global_model: torch.nn.Module, momentum: list[torch.Tensor]) -> str:
    """What the members of an all-reduce compare: Θ and the outer momentum (the same Θ with another
    momentum would step to another model)."""
    names = [name for name, _ in global_model.named_parameters()]
    momenta = ((f"momentum.{n}", m) for n, m in zip(names, momentum, strict=True))
    return tensors_digest([*global_model.named_parameters(), *momenta])


class DilocoWorker(BaselineWorker):
    """One synchronous DiLoCo peer (module docstring); `run`, `loop` and the books are the base class's."""

    def __init__(
        self, options: BaselineOptions, *, stop: threading.Event | None = None, out: TextIO = sys.stdout
    ):
        super().__init__(options, stop=stop, out=out)
        if options.diloco is None:
            raise ValueError("DilocoWorker needs BaselineOptions.diloco")
        self.settings = options.diloco
        self.global_model: torch.nn.Module | None = None  # Θ
        self.momentum: list[torch.Tensor] = []
        self.epoch = 0  # outer steps Θ has taken
        self.round_steps = 0  # inner steps since θ was last set to Θ
        self.trainer: Any = None
        self.inner: torch.optim.Optimizer | None = None
        self.averager: OuterAverager | None = None
        self.tracker: RoundTracker | None = None
        self.me = b""
        self._lock = threading.Lock()  # Θ, momentum and epoch against hivemind's state-sharing thread
        self._next_reload = 0.0

    # ---- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        opts, manifest = self.options, self.manifest
        torch.set_num_threads(opts.threads)
        self.state = StateDir(opts.state_dir, manifest)
        self.dht_peer = create_dht(
            initial_peers=opts.initial_peers, identity_path=opts.identity, host_maddrs=opts.listen
        )
        peer_id, dht = self.dht_peer.peer_id, self.dht_peer.dht
        self.me = dht.peer_id.to_bytes()
        restored = self._build_models(peer_id)
        self._join_tracker(dht)
        self._join_averager(dht)
        self._announce_start(peer_id, restored)
        assert self.tracker is not None
        if self.tracker.global_epoch > self.epoch:
            self._reload()

    def _build_models(self, peer_id: str) -> int | None:
        """θ, Θ, momentum, AdamW (restored from ``baseline.pt`` if there is one), θ ← Θ, the data and the
        inner step; the restored epoch."""
        manifest = self.manifest
        corpus = load_corpus(manifest.data)
        self.model = build_model(manifest.model)
        self.global_model = build_model(manifest.model).requires_grad_(False)
        self.momentum = [torch.zeros_like(p) for p in self.global_model.parameters()]
        self.inner = make_inner_optimizer(
            self.model, manifest.diloco.inner_lr, manifest.diloco.inner_weight_decay
        )
        restored = self._restore()
        self._adopt_global()
        salt = int.from_bytes(hashlib.blake2b(f"{peer_id}:{time.time_ns()}".encode(), digest_size=7).digest())
        self.sampler = make_sampler(manifest, peer_id, corpus, salt=salt)
        self.trainer = make_trainer(manifest, self.model, self.inner, self.sampler)
        return restored

    def _join_tracker(self, dht: Any) -> None:
        """The progress records of this run's peers (`RoundTracker`), this peer's first one published."""
        elastic = self.options.elastic
        self.tracker = RoundTracker(
            dht=dht,
            prefix=elastic.run_id,
            target_batch_size=self._round_samples(),
            min_refresh_period=0.5,
            max_refresh_period=1.0,
            default_refresh_period=1.0,
            metadata_expiration=elastic.peer_expiration,
            private_key=signing_key(self.options.identity),
            start=True,
        )
        self.tracker.report_local_progress(self.epoch, samples_accumulated=0)

    def _join_averager(self, dht: Any) -> None:
        """The all-reduce of outer gradients and the state served to peers (`OuterAverager`)."""
        assert self.global_model is not None and self.model is not None
        elastic = self.options.elastic
        shapes = [p.shape for p in self.global_model.parameters()]
        dtype = EXACT_DTYPE if elastic.compression == "fp32" else torch.float32  # see outer_averager
        self.averager = OuterAverager(
            shapes,
            dht,
            state=self._shared_state,
            prefix=f"{elastic.run_id}_outer",
            target_group_size=self.settings.group_size,
            min_matchmaking_time=elastic.matchmaking_time,
            request_timeout=elastic.matchmaking_time / 2,
            allreduce_timeout=elastic.averaging_timeout,
            compression=COMPRESSIONS[elastic.compression][0](),
            state_compression=NoCompression(),
            dtype=dtype,
        )
        self.averager.state_sharing_priority = self.epoch
        n_params = sum(p.numel() for p in self.model.parameters())
        self._gradient_bytes = n_params * (dtype.itemsize if elastic.compression == "fp32" else 2)
        self._state_bytes = 2 * n_params * 4  # Θ and momentum, float32

    def _announce_start(self, peer_id: str, restored: int | None) -> None:
        """The ``start`` event and the lines a person reads."""
        assert self.model is not None and self.dht_peer is not None
        elastic, settings = self.options.elastic, self.settings
        n_params = sum(p.numel() for p in self.model.parameters())
        addresses = self.dht_peer.visible_addresses()
        self.event(
            "start",
            role=MODE,
            peer_id=peer_id,
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            hivemind_run_id=elastic.run_id,
            restored_epoch=restored,
            inner_steps=settings.inner_steps,
            parameters=n_params,
            addresses=addresses,
        )
        self.say(f"peer id: {peer_id}")
        for address in addresses:
            self.say(f"address: {address}")
        self.say(
            f"diloco worker joined {elastic.run_id}: {n_params} parameters, H = {settings.inner_steps}, "
            f"{'restored epoch ' + str(restored) if restored is not None else 'fresh state'}"
        )

    def _restore(self) -> int | None:
        """Θ, momentum, AdamW state and epoch from ``baseline.pt`` if it is one of this mode; its epoch."""
        assert self.global_model is not None and self.inner is not None
        checkpoint, why = load_checkpoint(
            self.options.state_dir / CHECKPOINT_FILE, self.manifest, self.global_model
        )
        state = checkpoint.optimizer if checkpoint is not None else None
        if checkpoint is None or not isinstance(state, dict) or state.get("mode") != MODE:
            if why != "no checkpoint":
                self.event("checkpoint_ignored", reason=why or "not a diloco checkpoint")
            return None
        with torch.no_grad():
            for name, p in self.global_model.named_parameters():
                p.copy_(checkpoint.parameters[name])
            for buf, saved in zip(self.momentum, state["momentum"], strict=True):
                buf.copy_(saved)
        self.inner.load_state_dict(state["inner"])
        self.epoch = checkpoint.epoch
        return checkpoint.epoch

    def _round_samples(self) -> int:
        return self.settings.inner_steps * self.manifest.diloco.batch_size

    @torch.no_grad()
    def _adopt_global(self) -> None:
        """θ ← Θ: a new round starts from the global model."""
        assert self.model is not None and self.global_model is not None
        for local, glob in zip(self.model.parameters(), self.global_model.parameters(), strict=True):
            local.copy_(diloco.adopt(local, glob, mode="overwrite"))
        self.round_steps = 0

    def _shared_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a peer downloads in `load_state_from_peers` (hivemind's state thread calls it)."""
        assert self.global_model is not None
        with self._lock:
            tensors = [p.detach().clone() for p in self.global_model.parameters()]
            tensors += [m.clone() for m in self.momentum]
            return {"run": self.options.elastic.run_id, "epoch": self.epoch}, tensors

    # ---- the loop ----------------------------------------------------------------------------------

    def train_step(self) -> None:
        """One inner step; after the H-th, the outer round (accounted: `ledger`, module docstring)."""
        assert self.tracker is not None and self.trainer is not None
        started = time.perf_counter()
        loss, tokens = self.trainer.step()
        self.ledger.local_step(time.perf_counter() - started, tokens=tokens)
        if loss is not None:
            self.last_loss = loss
        self.round_steps += 1
        self.tracker.report_local_progress(self.epoch, self.round_steps * self.manifest.diloco.batch_size)
        if self.tracker.global_epoch > self.epoch and time.monotonic() >= self._next_reload:
            self._reload()  # the others finished a round without this peer: its round is lost
        elif self.round_steps >= self.settings.inner_steps:
            self.outer_round()

    def outer_round(self) -> None:
        """Wait for the round's peers, all-reduce the outer gradients Θ − θ (or step alone), take the outer
        step and start the next round from Θ (θ ← Θ); blocked time throughout (`ledger`)."""
        assert self.global_model is not None and self.tracker is not None and self.averager is not None
        began = time.perf_counter()
        self.ledger.blocking_started(began)
        local = outer_gradients(list(self.global_model.parameters()), list(self.model.parameters()))
        stepped = 0.0
        try:
            settled = self._settle_round(local, began)
            if settled is None:
                return  # reloaded from a peer ahead, or stopped while waiting (the work stays pending)
            outcome, grads, group, attempts, peers_seen = settled
            names = [name for name, _ in self.global_model.named_parameters()]
            local_digest = self._alone_digest(names, local) if group > 1 else None
            t0 = time.perf_counter()
            self._step_global(grads)
            stepped = time.perf_counter() - t0
        finally:
            self.ledger.blocking_ended(time.perf_counter() - began - stepped)
        self.averager.state_sharing_priority = self.epoch
        self.tracker.report_local_progress(self.epoch, samples_accumulated=0)
        self.ledger.global_step(outcome, stepped)
        if group > 1:
            self.ledger.add_bytes(*allreduce_bytes(self._gradient_bytes, group))
        self.event(
            "global_step",
            epoch=self.epoch,
            outcome=outcome,
            group_size=group,
            peers_seen=peers_seen,
            attempts=attempts,
            digest=parameter_digest(self.global_model),
            local_digest=local_digest,
        )

    def _settle_round(
        self, local: list[torch.Tensor], began: float
    ) -> tuple[str, list[torch.Tensor], int, int, int] | None:
        """(outcome, outer gradients to step with, group size, all-reduce attempts, peers seen at this epoch)
        once the round is averaged or stepped alone (`rounds.decide_round`, `rounds.settle_round`); None if
        this peer reloaded a peer's state instead, or was stopped."""
        assert self.tracker is not None and self.averager is not None and self.global_model is not None
        digest = outer_state_digest(self.global_model, self.momentum)
        attempts = 0
        lost_at: float | None = None  # when this round's all-reduce showed this state is not canonical
        while not self.stop.is_set():
            view = decide_round(
                self.me,
                self.epoch,
                self.tracker.fetch_peers(),
                target_samples=self._round_samples(),
                now=get_dht_time(),
                grace=self._grace(),
                waited=time.perf_counter() - began,
                wait_limit=self.settings.wait_limit,
                expected_peers=self.settings.group_size,
                lost_for=None if lost_at is None else time.perf_counter() - lost_at,
            )
            if view.decision == Decision.WAIT:
                self.stop.wait(0.1)
            elif view.decision == Decision.RELOAD:
                if time.monotonic() >= self._next_reload and self._reload():
                    return None
                self.stop.wait(0.5)
            elif view.decision == Decision.ALONE:
                return ALONE, local, 1, attempts, view.peers_at_epoch
            else:
                attempts += 1
                timeout = self.options.elastic.averaging_timeout
                result = self.averager.average(local, epoch=self.epoch, digest=digest, timeout=timeout)
                gathered, averaged = (None, None) if isinstance(result, str) else result
                settle = settle_round(self.epoch, digest, gathered, lost=lost_at is not None)
                if settle == Settle.RETRY:
                    reason = result if isinstance(result, str) else f"gathered {gathered}"
                    self.event("round_failed", epoch=self.epoch, attempt=attempts, reason=reason[:300])
                elif settle == Settle.RELOAD:  # another member's state is the round's (rounds, rule 3)
                    self.event("global_models_differ", epoch=self.epoch, gathered=gathered, action="reload")
                    lost_at = time.perf_counter()  # wait a grace for a member that stepped
                    self._next_reload = time.monotonic()
                else:
                    return AVERAGED, averaged, len(gathered), attempts, view.peers_at_epoch
        return None  # stopped while waiting: the round's work stays pending (never merged)

    def _step_global(self, grads: list[torch.Tensor]) -> None:
        """The outer step on Θ and its momentum (`diloco.outer_step`), then θ ← Θ."""
        assert self.global_model is not None
        with self._lock:
            outer_step(
                list(self.global_model.parameters()),
                self.momentum,
                grads,
                lr=self.manifest.diloco.outer_lr,
                mu=self.manifest.diloco.outer_momentum,
            )
            self.epoch += 1
        self._adopt_global()

    def _grace(self) -> float:
        """Seconds past its expected finish a silent peer of this epoch is still waited for."""
        return max(GRACE_MIN, GRACE_WINDOWS * self.options.elastic.matchmaking_time)

    def _alone_digest(self, names: list[str], local: list[torch.Tensor]) -> str:
        """Digest of the Θ this peer would have stepped to with only its own outer gradient."""
        assert self.global_model is not None
        params = [p.detach().clone() for p in self.global_model.parameters()]
        momentum = [m.clone() for m in self.momentum]
        diloco = self.manifest.diloco
        outer_step(params, momentum, local, lr=diloco.outer_lr, mu=diloco.outer_momentum)
        return tensors_digest(zip(names, params, strict=True))

    def _reload(self) -> bool:
        """Load Θ, momentum and epoch from the most advanced peer; drop this round. False if none served."""
        assert self.averager is not None and self.global_model is not None and self.tracker is not None
        self._next_reload = time.monotonic() + RELOAD_BACKOFF
        loaded = self.averager.load(self.options.elastic.load_state_timeout)
        params = list(self.global_model.parameters())
        if loaded is None:
            self.event("reload_failed", epoch=self.epoch, reason="no peer served its state")
            return False
        metadata, tensors = loaded
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        shapes_ok = len(tensors) == 2 * len(params) and all(
            t.shape == p.shape for t, p in zip(tensors, params + params, strict=True)
        )
        if metadata.get("run") != self.options.elastic.run_id or not isinstance(epoch, int) or not shapes_ok:
            self.event("reload_failed", epoch=self.epoch, reason="foreign or malformed state")
            return False
        if epoch <= self.epoch:
            self.event("reload_failed", epoch=self.epoch, reason=f"the peer served epoch {epoch}")
            return False
        with self._lock, torch.no_grad():
            for p, t in zip(params, tensors, strict=False):
                p.copy_(t)
            for m, t in zip(self.momentum, tensors[len(params) :], strict=True):
                m.copy_(t)
            self.epoch = epoch
        self._adopt_global()
        self.averager.state_sharing_priority = self.epoch
        self.tracker.report_local_progress(self.epoch, samples_accumulated=0)
        self.ledger.reloaded()
        self.ledger.add_bytes(0.0, self._state_bytes)
        self.event("reloaded", epoch=self.epoch, digest=parameter_digest(self.global_model))
        return True

    # ---- hooks of the base class -------------------------------------------------------------------

    def epochs(self) -> tuple[int, int] | None:
        if self.tracker is None:
            return None
        return self.epoch, max(self.epoch, self.tracker.global_epoch)

    def checkpoint_state(self) -> tuple[torch.nn.Module, dict, int] | None:
        if self.global_model is None or self.inner is None:
            return None
        state = {
            "mode": MODE,
            "inner": self.inner.state_dict(),
            "momentum": [m.clone() for m in self.momentum],
        }
        return self.global_model, state, self.epoch

    def finish_rounds(self) -> None:
        pass  # rounds run in the training thread: none is left in the background

    def close_hivemind(self) -> None:
        if self.tracker is not None:
            self.tracker.shutdown(timeout=5)  # withdraws its record: nobody waits for this peer
        if self.averager is not None:
            self.averager.shutdown()
