"""Building a real peer's parts: its DHT process, the model with its replica and optimizer, the learner.

`node.runtime.PeerNode.start` calls these in order (the DHT fork first, so the model build overlaps
p2pd's start), on the main thread before the peer's owner thread starts (the catch-up after, through
it); they hold no state of their own.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.contract import check_model_contract
from p2p_diloco.model.data import Corpus, load_corpus, make_sampler
from p2p_diloco.model.gpt import build_model, embedding_parameter_names, make_inner_optimizer
from p2p_diloco.model.probe import loss_probe_for
from p2p_diloco.model.trainer import make_trainer
from p2p_diloco.net.addresses import parse_peer_address, peer_id_in
from p2p_diloco.net.dht_store import PendingDht, identity_check_needed, start_dht
from p2p_diloco.net.identity import peer_id_of
from p2p_diloco.net.record_signing import RsaRecordSigner, RsaSignatureCheck
from p2p_diloco.node.island import Island, island_sampler
from p2p_diloco.node.island_learner import IslandLearner
from p2p_diloco.node.options import NodeOptions
from p2p_diloco.node.state import StateDir
from p2p_diloco.node.threads import ThreadedDriver
from p2p_diloco.protocol.fragments import FragmentPlan, plan_fragments
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.swarm.snapshot_download import SNAPSHOT_BYTES_PER_PARAM
from p2p_diloco.wire.signing import PeerKeys


@dataclass
class BuiltModel:
    corpus: Corpus
    model: torch.nn.Module
    shapes: dict[str, tuple[int, ...]]
    plan: FragmentPlan
    replica: GlobalReplica
    restored: bool  # the replica came from the state directory
    optimizer: torch.optim.Optimizer


def first_delta_seq() -> int:
    """Delta seqs of this start of the peer begin at the wall clock in ms, above every seq of its earlier
    lives (`Learner.seq`)."""
    return time.time_ns() // 1_000_000


def with_known_peers(initial: Sequence[str], known: Sequence[str], own_peer_id: str) -> tuple[str, ...]:
    """The configured initial peers, then the valid saved addresses of other peers not among them."""
    out = list(initial)
    for address in known:
        try:
            parsed = parse_peer_address(address, what="saved peer address")
        except ConfigError:
            continue
        if peer_id_in(parsed) != own_peer_id and address not in out:
            out.append(address)
    return tuple(out)


def start_node_dht(
    opts: NodeOptions, previous_peer_id: str | None, known_peers: Sequence[str] = ()
) -> PendingDht:
    """Fork the DHT node (`start_dht`); hivemind's identity check only where it is needed.

    `known_peers` (the live peers' addresses this peer saved last, `node.state`) are dialed besides the
    configured initial peers: a restart while the bootstrap node is down still joins the swarm, and a
    restarted bootstrap with an empty routing table does not leave the restarted peers on a DHT island
    of their own. Unparsable ones and this peer's own are skipped.

    A restart of this peer (the state directory whose lock we hold says this key ran here before)
    skips the check: it would spend seconds dialing our own dead predecessor (`identity_check_needed`).
    A key new to this state directory is still checked.
    """
    check = identity_check_needed(
        peer_id_of(opts.identity), previous_peer_id=previous_peer_id, holds_state_dir=True
    )
    nat = (
        # Nobody can dial this peer: serve no DHT requests, reserve relay slots on the initial peers.
        dict(
            client_mode=True,
            use_auto_relay=True,
            force_reachability="private",
            trusted_relays=opts.initial_peers,
        )
        if opts.behind_nat
        else {}
    )
    return start_dht(
        initial_peers=with_known_peers(opts.initial_peers, known_peers, peer_id_of(opts.identity)),
        identity_path=opts.identity,
        host_maddrs=opts.listen,
        announce_maddrs=opts.announce,
        check_identity=check,
        **nat,
    )


@dataclass
class PreparedModel:
    """What a peer builds before it needs its state directory (a hot spare builds it while it waits)."""

    corpus: Corpus
    model: torch.nn.Module
    shapes: dict[str, tuple[int, ...]]
    plan: FragmentPlan
    optimizer: torch.optim.Optimizer


def prepare_training(manifest: RunManifest, device: str) -> PreparedModel:
    """Corpus, model on `device`, fragment plan and the inner optimizer: no state directory needed."""
    corpus = load_corpus(manifest.data)
    model = build_model(manifest.model)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    plan = plan_fragments(list(shapes.items()), manifest.diloco.fragments, manifest.diloco.fragment_pattern)
    model.to(device)
    check_model_contract(manifest, model, corpus.vocab_size)  # a custom model's forward, before joining
    optimizer = make_inner_optimizer(model, manifest.diloco.inner_lr, manifest.diloco.inner_weight_decay)
    return PreparedModel(corpus, model, shapes, plan, optimizer)


def build_training(
    manifest: RunManifest, device: str, state: StateDir, prepared: PreparedModel | None = None
) -> BuiltModel:
    """`prepare_training` (or what a hot spare prepared) plus the replica: the persisted one if any."""
    ready = prepared if prepared is not None else prepare_training(manifest, device)
    replica = state.load_replica(ready.plan)
    restored = replica is not None
    if replica is None:  # a fresh replica starts from the freshly initialised (still untrained) model
        initial = {name: p.detach().to("cpu", copy=True) for name, p in ready.model.named_parameters()}
        replica = GlobalReplica(ready.plan, initial)
    return BuiltModel(ready.corpus, ready.model, ready.shapes, ready.plan, replica, restored, ready.optimizer)


def make_peer(manifest: RunManifest, opts: NodeOptions, built: BuiltModel, peer_id: str) -> Peer:
    """The peer state machine: it signs updates with the node's identity and, in public runs, scores each
    delta by loss on held-out windows drawn with this process's secret salt before merging (`model.probe`)."""
    return Peer(
        peer_id,
        manifest,
        built.plan,
        built.replica,
        shapes=built.shapes,
        keys=PeerKeys(RsaRecordSigner(opts.identity), RsaSignatureCheck()),
        embedding_names=embedding_parameter_names(built.model),
        may_sync=opts.may_sync,
        reachable=not opts.behind_nat,
        loss_probe=loss_probe_for(manifest, built.replica, built.corpus.eval, salt=os.urandom(16)),
    )


def make_learner(
    manifest: RunManifest, opts: NodeOptions, built: BuiltModel, peer_id: str, island: Island | None
) -> Learner:
    """The learner on its own data stream (a seed fresh for every start of this peer); an island's
    ranks sample shards of one seed and step together."""
    seed = int.from_bytes(hashlib.blake2b(f"{peer_id}:{time.time_ns()}".encode(), digest_size=7).digest())
    args = (peer_id, manifest, built.plan, built.replica, built.model, built.optimizer)
    if island is None:
        # this peer's own stream of the run's data, fresh for every start (salt): a restarted peer does
        # not repeat the batches of its previous life
        sampler = make_sampler(manifest, peer_id, built.corpus, salt=seed)
        learner = Learner(*args, sampler, device=opts.device, first_seq=first_delta_seq())
        learner.trainer = make_trainer(
            manifest,
            built.model,
            built.optimizer,
            learner.sampler,
            micro_batch=opts.micro_batch,
            device=opts.device,
        )
        return learner
    sampler = island_sampler(built.corpus.train, opts, island, island.share_seed(seed))
    learner = IslandLearner(island, *args, sampler, device=opts.device, state_dir=opts.state_dir)
    learner.seq = first_delta_seq()
    learner.trainer = make_trainer(
        manifest, learner.ddp, built.optimizer, sampler, micro_batch=opts.micro_batch, device=opts.device
    )
    return learner


def catch_up_at_start(
    driver: ThreadedDriver, peer: Peer, now: float, away: float, timeout: float
) -> dict | None:
    """Bring a starting peer's replica to the swarm's versions (`Repair.catch_up` on the owner thread):
    a peer away less than `timing.rejoin_grace` replays, any other downloads snapshots. The `catch_up`
    event's fields, or None if it did not finish within `timeout` seconds. Called on the training
    thread: the replica's versions are read on the owner thread."""
    replay = away < peer.manifest.timing.rejoin_grace
    before = driver.call(peer.replica.versions, timeout=timeout)
    started = time.monotonic()
    done: concurrent.futures.Future = concurrent.futures.Future()
    driver.post(fx.CatchUpRequested(now, replay, done))
    try:
        stats = done.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return None
    if stats is None:  # the catch-up task failed (its note says why)
        return None
    after = driver.call(peer.replica.versions, timeout=timeout)
    sizes = peer.plan.sizes()
    if not replay:  # params and momentum, fp32
        stats["bytes"] = sum(
            SNAPSHOT_BYTES_PER_PARAM * sizes[p] for p in range(len(sizes)) if after[p] != before[p]
        )
    return dict(
        mode="replay" if replay else "snapshot",
        away=None if math.isinf(away) else away,
        seconds=time.monotonic() - started,
        before=list(before),
        after=list(after),
        **stats,
    )
