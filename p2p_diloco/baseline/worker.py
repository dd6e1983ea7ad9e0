"""`p2p-diloco baseline-worker`: one elastic data-parallel peer on `hivemind.Optimizer`, the lock-step
baseline.

It trains exactly what a DiLoCo learner trains (the manifest's model, initial weights, corpus, batch size
and AdamW hyper-parameters), but every global step averages gradients across the live peers through
hivemind (settings in `elastic`). Lifecycle (`BaselineWorker.run`):

1. start: open the state directory (lock, ``events.jsonl``), join the DHT with the peer's identity,
   build model and corpus, restore ``baseline.pt`` if usable (`checkpoint`), build the optimizer; hivemind
   then downloads the newest state from a peer on the first step if this one is behind the swarm.
2. loop: forward/backward on this peer's batch, `opt.step()`, account (`ledger`), checkpoint every
   `checkpoint_every` s; a reporter thread writes a ``progress`` event every `progress_every` s.
3. stop (SIGINT/SIGTERM, or `--max-steps` reached: the worker leaves the swarm then, since an idle
   peer would keep counting as a member in hivemind's progress records): final checkpoint, ``stopped``
   event with the parameter digest, leave the swarm, exit 0.

`start`, `train_step` and the hooks `epochs`, `checkpoint_state`, `finish_rounds` and `close_hivemind`
are what `diloco.DilocoWorker` (``--mode diloco``) replaces; it keeps the loop, books, events, checkpoint
file and shutdown.

Events (``{"t": DHT time, "event": kind, ...}``): ``start``; ``progress`` with the cumulative counters of
`ledger.LedgerCounters` plus ``epoch`` (the global step this peer's model is at), ``global_epoch`` (the
highest epoch in hivemind's progress records), ``loss`` and ``compute_pending``; ``global_step`` (epoch,
outcome, group size, peers seen, parameter digest) after each global optimizer step; ``reloaded`` when
hivemind replaced the state with a peer's; ``checkpoint_ignored``; ``stopped`` (epoch, parameter digest);
``final_averaging_timeout`` / ``teardown_timeout`` when hivemind did not stop in time.
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from hivemind.utils import get_dht_time
from torch import nn

from p2p_diloco.baseline.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from p2p_diloco.baseline.elastic import (
    ElasticSettings,
    ObservedOptimizer,
    OptimizerTimer,
    make_optimizer,
    offloaded_parameters,
    state_bytes,
)
from p2p_diloco.baseline.ledger import AVERAGED, StepLedger, allreduce_bytes, step_outcome
from p2p_diloco.baseline.rounds import DilocoSettings
from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import BatchSampler, load_corpus
from p2p_diloco.model.gpt import build_model
from p2p_diloco.net.dht_store import DhtPeer, create_dht
from p2p_diloco.net.identity import signing_key
from p2p_diloco.node.state import StateDir

log = logging.getLogger(__name__)

SHUTDOWN_STEP_TIMEOUT = 15.0  # waiting for a background averaging round at stop
SHUTDOWN_TEARDOWN_TIMEOUT = 20.0  # hivemind optimizer and DHT shutdown


@dataclass(frozen=True)
class BaselineOptions:
    manifest: RunManifest
    identity: Path
    state_dir: Path
    elastic: ElasticSettings
    initial_peers: tuple[str, ...] = ()
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    max_steps: int | None = None
    threads: int = 1
    min_step_time: float = 0.0
    progress_every: float = 1.0
    checkpoint_every: float = 10.0
    diloco: DilocoSettings | None = None  # `--mode diloco`: synchronous DiLoCo (`baseline.diloco`)


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """blake2b over names and float32 bytes, in the order given."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in named:
        h.update(name.encode())
        h.update(p.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def parameter_digest(model: nn.Module) -> str:
    """`tensors_digest` of the parameters in `named_parameters()` order."""
    return tensors_digest(model.named_parameters())


class BaselineWorker:
    """One baseline peer in this process (module docstring). `stop` ends `run` after the current step."""

    def __init__(
        self, options: BaselineOptions, *, stop: threading.Event | None = None, out: TextIO = sys.stdout
    ):
        self.options = options
        self.manifest = options.manifest
        self.stop = stop or threading.Event()
        self.out = out
        self.ledger = StepLedger()
        self.timer = OptimizerTimer()
        self.state: StateDir | None = None
        self.dht_peer: DhtPeer | None = None
        self.model: nn.Module | None = None
        self.opt: ObservedOptimizer | None = None
        self.sampler: BatchSampler | None = None
        self.last_loss = float("nan")
        self._gradient_bytes = 0
        self._state_bytes = 0
        self._state_rounds_counted = 0
        self._reporter: threading.Thread | None = None
        self._reporter_stop = threading.Event()
        self.teardown_complete = True

    # ---- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        opts, manifest = self.options, self.manifest
        torch.set_num_threads(opts.threads)
        self.state = StateDir(opts.state_dir, manifest)
        # the DHT process forks here, before model and corpus exist (smaller child)
        self.dht_peer = create_dht(
            initial_peers=opts.initial_peers, identity_path=opts.identity, host_maddrs=opts.listen
        )
        peer_id = self.dht_peer.peer_id
        corpus = load_corpus(manifest.data)
        model = build_model(manifest.model)
        checkpoint, why = load_checkpoint(opts.state_dir / CHECKPOINT_FILE, manifest, model)
        if checkpoint is not None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(checkpoint.parameters[name])
        elif why != "no checkpoint":
            self.event("checkpoint_ignored", reason=why)
        opt = make_optimizer(
            opts.elastic, self.dht_peer.dht, model, manifest.diloco, signing_key(opts.identity), self.timer
        )
        if checkpoint is not None:
            self._restore_optimizer(opt, checkpoint.optimizer)
        self.model, self.opt = model, opt
        n_params = sum(p.numel() for p in model.parameters())
        self._gradient_bytes = n_params * opts.elastic.bytes_per_value
        self._state_bytes = state_bytes(opt)
        seed = int.from_bytes(hashlib.blake2b(f"{peer_id}:{time.time_ns()}".encode(), digest_size=7).digest())
        self.sampler = BatchSampler(
            corpus.train,
            block_size=manifest.model.block_size,
            batch_size=manifest.diloco.batch_size,
            shard=0,
            num_shards=1,
            seed=seed,
        )
        addresses = self.dht_peer.visible_addresses()
        self.event(
            "start",
            role="baseline",
            peer_id=peer_id,
            run_id=manifest.run_id,
            manifest_hash=manifest.manifest_hash,
            hivemind_run_id=opts.elastic.run_id,
            restored_epoch=checkpoint.epoch if checkpoint is not None else None,
            target_batch_size=opts.elastic.target_batch_size,
            parameters=n_params,
            addresses=addresses,
        )
        self.say(f"peer id: {peer_id}")
        for address in addresses:
            self.say(f"address: {address}")
        restored = f"restored epoch {checkpoint.epoch}" if checkpoint is not None else "fresh state"
        self.say(
            f"baseline worker joined {opts.elastic.run_id}: {n_params} parameters, "
            f"target batch {opts.elastic.target_batch_size}, {restored}"
        )

    @staticmethod
    def _restore_optimizer(opt: ObservedOptimizer, optimizer_state: dict) -> None:
        opt.load_state_dict(optimizer_state)
        with torch.no_grad():  # hivemind's optimizer init ran one zero-gradient step on its copies: undo it
            for offloaded, main in zip(
                offloaded_parameters(opt), opt.state_averager.main_parameters, strict=True
            ):
                offloaded.copy_(main)
        opt.tracker.report_local_progress(opt.local_epoch, samples_accumulated=0)
        opt.state_averager.state_sharing_priority = opt.local_epoch
        if opt.grad_averager is not None:
            opt.grad_averager.state_sharing_priority = opt.local_epoch

    # ---- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        """start, train until stopped or `max_steps`, shut down; returns the exit status (0)."""
        try:
            self.start()
            self._reporter = threading.Thread(target=self._report_loop, name="baseline-progress", daemon=True)
            self._reporter.start()
            self.loop()
        finally:
            self.shutdown()
        return 0

    def loop(self) -> None:
        opts = self.options
        next_checkpoint = time.monotonic() + opts.checkpoint_every
        while not self.stop.is_set():
            if opts.max_steps is not None and self.ledger.snapshot()["steps"] >= opts.max_steps:
                self.say(f"reached --max-steps {opts.max_steps}: leaving the swarm")
                return
            started = time.perf_counter()
            self.train_step()
            if opts.min_step_time > 0:
                left = opts.min_step_time - (time.perf_counter() - started)
                if left > 0:
                    self.stop.wait(left)
                    self.ledger.paced(left)
            if time.monotonic() >= next_checkpoint:
                next_checkpoint = time.monotonic() + opts.checkpoint_every
                self.checkpoint()

    def train_step(self) -> None:
        """One local batch and `opt.step()`, accounted (see `ledger` for what counts as merged)."""
        model, opt, sampler = self.model, self.opt, self.sampler
        assert model is not None and opt is not None and sampler is not None
        started = time.perf_counter()
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        computed = time.perf_counter()
        self.last_loss = loss.item()
        self.ledger.local_step(computed - started, tokens=x.numel())

        optimizer_before, reloads_before = self.timer.seconds, opt.reloads
        opt.last_global_step = None
        self.ledger.blocking_started(computed)
        try:
            opt.step()
            opt.zero_grad()
        finally:
            optimizer_seconds = self.timer.seconds - optimizer_before
            self.ledger.blocking_ended(time.perf_counter() - computed - optimizer_seconds)
        record = opt.last_global_step
        if opt.reloads > reloads_before:
            self.ledger.reloaded()
            self.ledger.add_bytes(0.0, self._state_bytes)
            self.event("reloaded", epoch=opt.local_epoch, digest=parameter_digest(model))
        if record is not None:
            outcome = step_outcome(record.group_size, record.peers_seen)
            self.ledger.global_step(outcome, optimizer_seconds)
            if outcome == AVERAGED:
                self.ledger.add_bytes(*allreduce_bytes(self._gradient_bytes, record.group_size))
            self._count_state_rounds(record.group_size)
            self.event(
                "global_step",
                epoch=record.epoch,
                outcome=outcome,
                group_size=record.group_size,
                peers_seen=record.peers_seen,
                digest=parameter_digest(model),
            )

    def _count_state_rounds(self, group_size: int) -> None:
        """Parameter-averaging rounds run in the background; estimated with this step's group size."""
        assert self.opt is not None
        new = self.opt.state_rounds_requested - self._state_rounds_counted
        self._state_rounds_counted = self.opt.state_rounds_requested
        if new > 0 and group_size >= 2:
            sent, received = allreduce_bytes(self._gradient_bytes, group_size)
            self.ledger.add_bytes(new * sent, new * received)

    # ---- events, progress, checkpoints -------------------------------------------------------------

    def event(self, kind: str, **fields) -> None:
        if self.state is not None:
            self.state.event(kind, t=get_dht_time(), **fields)

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def epochs(self) -> tuple[int, int] | None:
        """(this peer's global step, the highest one in the swarm's progress records); None before start."""
        opt = self.opt
        return None if opt is None else (opt.local_epoch, opt.tracker.global_epoch)

    def progress(self) -> None:
        epochs = self.epochs()
        if epochs is None:
            return
        self.event(
            "progress",
            **self.ledger.snapshot(time.perf_counter()),
            epoch=epochs[0],
            global_epoch=epochs[1],
            loss=self.last_loss if math.isfinite(self.last_loss) else None,
        )

    def _report_loop(self) -> None:
        while not self._reporter_stop.wait(self.options.progress_every):
            self.progress()

    def checkpoint_state(self) -> tuple[nn.Module, dict, int] | None:
        """(the module holding the global model, optimizer state, epoch) to save; None before start."""
        if self.model is None or self.opt is None:
            return None
        return self.model, self.opt.state_dict(), self.opt.local_epoch

    def checkpoint(self) -> None:
        """Save `baseline.pt` (call between steps: no optimizer step runs then)."""
        saved = self.checkpoint_state()
        if saved is None or self.state is None:
            return
        try:
            save_checkpoint(self.state.path / CHECKPOINT_FILE, self.manifest, *saved)
        except OSError as exc:
            self.event("checkpoint_failed", error=str(exc))

    # ---- shutdown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Final progress and checkpoint, `stopped` event, leave the swarm; safe after a failed start.

        hivemind's teardown can hang (e.g. when its averager processes died first, as with a signal to
        the whole process group): every hivemind call here is bounded, and `teardown_complete` tells
        the caller whether the process may exit normally or must leave without waiting for them.
        """
        self._reporter_stop.set()
        if self._reporter is not None:
            self._reporter.join(timeout=5)
        self.finish_rounds()
        saved = self.checkpoint_state()
        if saved is not None:
            self.progress()
            self.checkpoint()
            model, _, epoch = saved
            digest = parameter_digest(model)
            counters = self.ledger.snapshot()
            self.event(
                "stopped",
                steps=counters["steps"],
                epoch=epoch,
                digest=digest,
                compute_merged=counters["compute_merged"],
            )
            self.say(f"stopped: epoch {epoch}, steps {counters['steps']}, digest {digest[:16]}")
        dht_peer = self.dht_peer

        def teardown() -> None:
            self.close_hivemind()
            if dht_peer is not None:
                dht_peer.shutdown()

        self.teardown_complete = _bounded(teardown, SHUTDOWN_TEARDOWN_TIMEOUT)
        if not self.teardown_complete:
            self.event("teardown_timeout", seconds=SHUTDOWN_TEARDOWN_TIMEOUT)
        if self.state is not None:
            self.state.close()

    def finish_rounds(self) -> None:
        """Apply a parameter-averaging round that finished in the background (bounded)."""
        opt = self.opt
        if opt is not None and not _bounded(
            lambda: opt.state_averager.step(wait_for_delayed_updates=True), SHUTDOWN_STEP_TIMEOUT
        ):
            self.event("final_averaging_timeout", seconds=SHUTDOWN_STEP_TIMEOUT)

    def close_hivemind(self) -> None:
        """Stop the hivemind parts other than the DHT (called in a bounded teardown thread)."""
        if self.opt is not None:
            self.opt.shutdown()


def _bounded(fn: Callable[[], object], timeout: float) -> bool:
    """Run `fn` in a daemon thread; True if it returned (or raised) within `timeout` seconds."""
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - teardown errors must not keep the process from stopping
            log.exception("shutdown step failed")
        finally:
            done.set()

    threading.Thread(target=target, name="baseline-shutdown", daemon=True).start()
    return done.wait(timeout)
