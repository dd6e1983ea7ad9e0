"""The in-process swarm: N peers in one process on a fake clock, training the tiny GPT for real.

Every peer is a `Peer` (the class the real network drives) under an `InlineDriver` (the driver code
the real node runs too) on an `InMemoryKeyValueStore` and a `SimNetwork`. Inner steps take a configurable
amount of fake time per learner (heterogeneous speeds), so the run is deterministic for a seed whatever the
machine, and faults happen at exact fake times: crashes with restarts (`Crash`), dropped or delayed links
(`LinkRule`), network partitions that also split the key-value store (`Partition`, see docs/partitions.md),
reads that return only a peer's own records (`Starvation`). The scenario and report dataclasses
live in `swarm.scenario` and are re-exported here.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import BatchSampler, Corpus, evaluate, load_corpus
from p2p_diloco.model.gpt import build_model, embedding_parameter_names, make_inner_optimizer
from p2p_diloco.model.probe import loss_probe_for
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.driver import InlineDriver
from p2p_diloco.swarm.hostile import GENERIC, generic_transport, hostile_transport
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.memory import (
    EventLoop,
    FakeClock,
    InMemoryKeyValueStore,
    InMemoryTransport,
    LinkRule,
    PartitionedKeyValueStore,
    SimNetwork,
    StarvedReads,
)
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.swarm.scenario import Crash, LearnerStats, Partition, Starvation, SwarmReport, SwarmSpec
from p2p_diloco.wire.signing import InMemoryKeys

__all__ = [
    "Crash",
    "InProcessSwarm",
    "LearnerStats",
    "Partition",
    "Starvation",
    "SwarmReport",
    "SwarmSpec",
    "cli_swarm",
]


class InProcessSwarm:
    def __init__(
        self, spec: SwarmSpec, corpus: Corpus | None = None, log: Callable[[str], None] | None = None
    ):
        self.spec = spec
        self.manifest = spec.manifest
        self.corpus = corpus if corpus is not None else load_corpus(self.manifest.data)
        self.log = log
        torch.manual_seed(spec.seed)
        template = build_model(self.manifest.model)
        self.shapes = {n: tuple(p.shape) for n, p in template.named_parameters()}
        self.embeddings = embedding_parameter_names(template)
        self.plan = plan_fragments(
            list(self.shapes.items()), self.manifest.diloco.fragments, self.manifest.diloco.fragment_pattern
        )
        self.initial = {n: p.detach().clone() for n, p in template.named_parameters()}
        self.eval_model = template
        self.clock = FakeClock()
        self.loop = EventLoop(self.clock)
        self.network = SimNetwork(self.loop, base_delay=spec.base_delay, rules=list(spec.link_rules))
        self.kv = PartitionedKeyValueStore() if spec.partitions else InMemoryKeyValueStore()
        self.keys = InMemoryKeys()  # each peer signs its updates with its own secret
        self.peers: dict[int, Peer] = {}
        self.drivers: dict[int, InlineDriver] = {}
        self.learners: dict[int, Learner] = {}
        self.generation: dict[int, int] = {}
        self.persisted: dict[int, GlobalReplica] = {}
        self.stats = [LearnerStats(spec.peer_id(i), spec.step_time(i)) for i in range(spec.learners)]
        self.eval_curve: list[tuple[float, int, float]] = []
        self.version_curve: list[tuple[float, int]] = []
        self.terms: list[tuple[float, str, int]] = []
        self.shard_terms: list[tuple[float, str, int, int]] = []  # (time, holder, shard, term) per claim
        self.published: list[tuple[float, str, int, int]] = []  # (time, leader, fragment, version)
        self.tokens_done = 0
        self.retired_rejections: dict[str, int] = {}
        self.polling: set[tuple[int, int]] = set()
        self.training = True
        self.crash_log: list[tuple[float, int]] = []
        self.crashed_at: dict[int, float] = {}
        self.catch_ups: list[tuple[float, int, dict[str, int]]] = []
        self.partition_log: list[tuple[float, str]] = []

    # ---- peers ----------------------------------------------------------------------------------

    def _start_peer(self, i: int, replica: GlobalReplica, incarnation: int) -> Peer:
        cfg = self.manifest
        model = build_model(cfg.model)
        optimizer = make_inner_optimizer(model, cfg.diloco.inner_lr, cfg.diloco.inner_weight_decay)
        sampler = BatchSampler(
            self.corpus.train,
            block_size=cfg.model.block_size,
            batch_size=cfg.diloco.batch_size,
            shard=i,
            num_shards=self.spec.learners,
            seed=self.spec.seed * 1000 + incarnation,
        )
        peer_id = self.stats[i].peer_id
        first_seq = int(self.clock.now() * 1000)  # above every seq of this learner's earlier lives
        learner = Learner(peer_id, cfg, self.plan, replica, model, optimizer, sampler, first_seq=first_seq)
        attack = self.spec.hostile.get(i)
        transport = self._transport(i, peer_id, replica)
        peer = Peer(
            peer_id,
            cfg,
            self.plan,
            replica,
            shapes=self.shapes,
            keys=self.keys.for_peer(peer_id),
            embedding_names=self.embeddings,
            may_sync=attack is None,
            loss_probe=loss_probe_for(cfg, replica, self.corpus.eval),
        )
        kv = self.kv.view(peer_id) if isinstance(self.kv, PartitionedKeyValueStore) else self.kv
        windows = [(s.start, s.end) for s in self.spec.starved if i in s.learners]
        if windows:
            kv = StarvedReads(kv, peer_id, lambda now: any(a <= now < b for a, b in windows))
        self.drivers[i] = InlineDriver(
            peer,
            kv=kv,
            transport=transport,
            clock=self.clock,
            learner=learner,
            observer=lambda intent: self._observe(i, intent),
        )
        self.peers[i] = peer
        self.learners[i] = learner
        gen = self.generation.get(i, 0) + 1
        self.generation[i] = gen
        now = self.clock.now()
        period = cfg.timing.heartbeat_period
        self.loop.call_at(now + self.spec.step_time(i), lambda: self._step(i, gen))
        self.loop.call_at(now + period * (i + 1) / (self.spec.learners + 1), lambda: self._tick(i, gen))
        return peer

    def _transport(self, i: int, peer_id: str, replica: GlobalReplica):
        """Learner `i`'s transport: honest, or rewriting its deltas as its `SwarmSpec.hostile` attack says."""
        cfg = self.manifest
        transport = InMemoryTransport(self.network, peer_id)
        attack = self.spec.hostile.get(i)
        if attack is None:
            return transport
        wire = cfg.wire

        def toward(p: int):
            return replica.params_view(p), {n: self.initial[n] for n in self.plan.names(p)}

        if attack == GENERIC:  # a fresh key per delta (issue #41)
            return generic_transport(
                transport,
                inner_steps=cfg.diloco.inner_steps,
                seed=self.spec.seed * 1000 + i,
                codec=wire.codec,
                block_size=wire.block_size,
                toward=toward,
            )
        return hostile_transport(
            transport,
            attack,
            seed=self.spec.seed * 1000 + i,
            codec=wire.codec,
            block_size=wire.block_size,
            toward=toward,
        )

    def _alive(self, i: int, gen: int) -> bool:
        return i in self.peers and self.generation[i] == gen

    def _step(self, i: int, gen: int) -> None:
        if not self._alive(i, gen) or not self.training:
            return
        stats = self.stats[i]
        self.drivers[i].train_step(compute_seconds=stats.step_time)
        stats.steps += 1
        tokens = self.manifest.diloco.batch_size * self.manifest.model.block_size
        stats.tokens += tokens
        self.tokens_done += tokens
        self.loop.call_later(stats.step_time, lambda: self._step(i, gen))

    def _tick(self, i: int, gen: int) -> None:
        if not self._alive(i, gen):
            return
        peer = self.peers[i]
        learner = self.learners[i]
        loss = learner.last_loss if learner.last_loss == learner.last_loss else 0.0
        self.drivers[i].tick(
            self.clock.now(), step_time=self.stats[i].step_time, step=learner.step, loss=loss
        )
        if peer.sync is not None and (i, gen) not in self.polling:
            self.polling.add((i, gen))
            self._sync_poll(i, gen)
        self.loop.call_later(self.manifest.timing.heartbeat_period, lambda: self._tick(i, gen))

    def _sync_poll(self, i: int, gen: int) -> None:
        """One poll chain per synchronizer incarnation; it ends when the peer loses the role or dies."""
        if not self._alive(i, gen) or self.peers[i].sync is None:
            self.polling.discard((i, gen))
            return
        self.drivers[i].sync_tick(self.clock.now(), sync_seconds=self.spec.base_delay)
        interval = min(self.spec.step_time(j) for j in range(self.spec.learners)) / 2
        self.loop.call_later(interval, lambda: self._sync_poll(i, gen))

    def _observe(self, i: int, intent: fx.Intent) -> None:
        """Telemetry intents of learner `i`'s peer: claims and published updates."""
        peer = self.peers.get(i)
        if isinstance(intent, fx.Claimed) and peer is not None:
            self.terms.append((self.clock.now(), peer.peer_id, intent.term))
            self.shard_terms.append((self.clock.now(), peer.peer_id, intent.shard, intent.term))
        elif isinstance(intent, fx.Published) and peer is not None:
            self.version_curve.append((self.clock.now(), sum(peer.replica.versions())))
            record = intent.record
            self.published.append((self.clock.now(), peer.peer_id, record.fragment, record.to_version))
        elif isinstance(intent, fx.Note) and self.log is not None and peer is not None:
            self.log(f"[{peer.peer_id}] {intent.line}")

    def _crash_event(self, crash: Crash) -> None:
        i = crash.learner
        if i == -1:
            i = next((j for j, p in self.peers.items() if p.sync is not None), -1)
        if i not in self.peers:
            return
        self.crash(i)
        self.crash_log.append((self.clock.now(), i))
        if crash.down >= 0:
            self.stats[i].down_seconds += crash.down
            self.loop.call_later(crash.down, lambda: self.restart(i))

    def _split(self, part: Partition) -> None:
        assert isinstance(self.kv, PartitionedKeyValueStore)
        names = [[self.stats[i].peer_id for i in group] for group in part.groups]
        self.kv.split([set(g) for g in names])
        everyone = [s.peer_id for s in self.stats]
        for a in everyone:
            for b in everyone:
                if a != b and not self.kv.reachable(a, b):
                    self.network.rules.append(LinkRule(src=a, dst=b, drop=True, until=part.end))
        self.partition_log.append((self.clock.now(), "split"))

    def _heal(self) -> None:
        assert isinstance(self.kv, PartitionedKeyValueStore)
        self.kv.heal()
        self.partition_log.append((self.clock.now(), "heal"))

    def crash(self, i: int) -> None:
        peer = self.peers.pop(i, None)
        driver = self.drivers.pop(i, None)
        learner = self.learners.pop(i, None)
        if peer is None or driver is None or learner is None:
            return
        self.persisted[i] = copy.deepcopy(peer.replica)
        self.crashed_at[i] = self.clock.now()
        for tag, n in peer.rejections.items():
            self.retired_rejections[tag] = self.retired_rejections.get(tag, 0) + n
        driver.transport.close()
        self.stats[i].crashes += 1
        self.stats[i].steps_merged += learner.steps_merged
        self.stats[i].deltas_sent += learner.deltas_sent
        self.stats[i].deltas_rejected += learner.deltas_rejected

    def restart(self, i: int) -> Peer:
        """Back from its persisted replica: replays the log within `rejoin_grace`, else downloads
        snapshots."""
        replica = self.persisted.pop(i)
        away = self.clock.now() - self.crashed_at.pop(i)
        peer = self._start_peer(i, replica, incarnation=self.stats[i].crashes)
        stats = self.drivers[i].catch_up(self.clock.now(), replay=away <= self.manifest.timing.rejoin_grace)
        self.catch_ups.append((self.clock.now(), i, stats))
        return peer

    # ---- evaluation and the run -----------------------------------------------------------------

    def best_replica(self) -> GlobalReplica:
        return max((p.replica for p in self.peers.values()), key=lambda r: sum(r.versions()))

    def evaluate_global(self) -> float:
        params = self.best_replica().export_params()
        with torch.no_grad():
            for name, p in self.eval_model.named_parameters():
                p.copy_(params[name])
        return evaluate(
            self.eval_model,
            self.corpus.eval,
            block_size=self.manifest.model.block_size,
            max_batches=self.spec.eval_batches,
        )

    def _eval_tick(self) -> None:
        self.eval_curve.append((self.clock.now(), self.tokens_done, self.evaluate_global()))
        self.loop.call_later(self.spec.eval_every, self._eval_tick)

    def run(self) -> SwarmReport:
        spec = self.spec
        for i in range(spec.learners):
            self._start_peer(i, GlobalReplica(self.plan, self.initial), incarnation=0)
        for c in spec.crashes:
            self.loop.call_at(c.at, lambda c=c: self._crash_event(c))
        for part in spec.partitions:
            self.loop.call_at(part.start, lambda part=part: self._split(part))
            self.loop.call_at(part.end, self._heal)
        self.loop.call_at(0.0, self._eval_tick)
        end = spec.duration if spec.duration is not None else float("inf")
        budget = spec.total_tokens if spec.total_tokens is not None else float("inf")
        self.loop.run_until(end, stop=lambda: self.tokens_done >= budget)
        # Stop training, then let in-flight rounds close and lagging replicas repair before measuring.
        self.training = False
        self.loop.run_until(self.clock.now() + 3 * self.manifest.timing.heartbeat_period)
        return self._report()

    def _report(self) -> SwarmReport:
        final = self.evaluate_global()
        self.eval_curve.append((self.clock.now(), self.tokens_done, final))
        rejections = dict(self.retired_rejections)
        for i, peer in self.peers.items():
            s = self.stats[i]
            learner = self.learners[i]
            s.steps_merged += learner.steps_merged
            s.deltas_sent += learner.deltas_sent
            s.deltas_rejected += learner.deltas_rejected
            for tag, n in peer.rejections.items():
                rejections[tag] = rejections.get(tag, 0) + n
            if peer.sync is not None:
                for tag, n in peer.sync.rejections.items():
                    rejections[tag] = rejections.get(tag, 0) + n
        wall = self.clock.now()
        merged_time = sum(s.steps_merged * s.step_time for s in self.stats)
        digests = {p.replica.digest() for p in self.peers.values()}
        return SwarmReport(
            fake_seconds=wall,
            tokens=self.tokens_done,
            final_eval_loss=final,
            eval_curve=self.eval_curve,
            versions=self.best_replica().versions(),
            version_curve=self.version_curve,
            digests_equal=len(digests) == 1,
            bytes_sent=sum(self.network.bytes_sent.values()),
            goodput=merged_time / (len(self.stats) * wall) if wall > 0 else 0.0,
            terms=self.terms,
            crashes=self.crash_log,
            rejections=rejections,
            learners=self.stats,
        )


def cli_swarm(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    manifest = RunManifest.load(args.manifest) if args.manifest else RunManifest(run_id="inprocess")
    tokens_per_step = manifest.diloco.batch_size * manifest.model.block_size
    spec = SwarmSpec(
        manifest=manifest,
        learners=args.learners,
        total_tokens=args.tokens or 200 * args.learners * tokens_per_step,
        crashes=tuple(Crash.parse(c) for c in args.crash),
        seed=args.seed,
    )
    report = InProcessSwarm(spec).run()
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(
            f"{spec.learners} learners, {report.tokens} tokens in {report.fake_seconds:.0f} fake s: "
            f"eval loss {report.final_eval_loss:.3f}, versions {report.versions}, "
            f"goodput {report.goodput:.2f}, "
            f"replicas identical: {report.digests_equal}"
        )
    return 0
