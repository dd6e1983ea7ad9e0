"""A `Peer` under an `InlineDriver`, with the calls unit tests make, and a transport stub.

`make_peer(manifest)` is the tiny-model peer of a unit test (`tests.support.manifests`), with or without
its learner, on an in-memory store and a fake clock.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import replace
from types import SimpleNamespace

from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.driver import InlineDriver
from p2p_diloco.swarm.effects import Published
from p2p_diloco.swarm.election.seats import accepted, seat_of_delta
from p2p_diloco.swarm.learner import Learner
from p2p_diloco.swarm.memory import FakeClock, InMemoryKeyValueStore
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.wire.frames import InboundDelta, update_signing_bytes
from p2p_diloco.wire.interfaces import Liveness
from p2p_diloco.wire.replies import Reply, ReplyStatus
from p2p_diloco.wire.signing import InMemoryKeys, PeerKeys
from tests.support.manifests import tiny_training


class AnsweringPeer:
    """What a `ThreadedDriver` needs of a peer, of one synchronizer shard: it answers each arriving delta with
    the next of `replies` (as `Peer.handle` does; "accepted" when none is queued). `sync` is the seat's
    `Synchronizer` stand-in (None: holds no lease; `term_seen` is then counted)."""

    def __init__(self, sync_term: int | None = None, term_seen: int = 9):
        sync = None if sync_term is None else SimpleNamespace(term=sync_term)
        self.seats = [SimpleNamespace(shard=0, sync=sync, membership=SimpleNamespace(term_seen=term_seen))]
        self.manifest = SimpleNamespace(wire=SimpleNamespace(max_message_bytes=1 << 20))
        self.replies: list[Reply] = []

    @property
    def sync(self) -> SimpleNamespace | None:
        return self.seats[0].sync

    @sync.setter
    def sync(self, value: SimpleNamespace | None) -> None:
        self.seats[0].sync = value

    def handle(self, event: fx.Event) -> list[fx.Intent]:
        """The reply queued next; an accepted one counted as `Peer` counts it (the seat of the frame's
        fragment, `seats.accepted`)."""
        reply = self.replies.pop(0) if self.replies else Reply(ReplyStatus.ACCEPTED, "accepted")
        intents: list[fx.Intent] = [fx.Respond(event.answer, reply)]
        if reply.ok:
            delta = InboundDelta.decode(event.frame, max_bytes=self.manifest.wire.max_message_bytes)
            intents.append(accepted(seat_of_delta(self.seats, delta)))
        return intents


def settled(value) -> concurrent.futures.Future:  # noqa: ANN001
    future: concurrent.futures.Future = concurrent.futures.Future()
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
    return future


class StubTransport:
    """Answers fetches with whatever the test puts in; records sends (never answered: lost in flight)."""

    def __init__(self) -> None:
        self.snapshot = b""
        self.chunks: dict[int, bytes] = {}  # chunk number -> answer; others fail
        self.updates: list[bytes] = []  # every log asked for, unless `logs` names the source
        self.logs: dict[str, list[bytes] | BaseException] = {}  # source -> its log (or its fetch's error)
        self.frozen: set[str] = set()  # sources that never answer: their fetches stay in `pending`
        self.pending: list[concurrent.futures.Future] = []
        self.asked: list[tuple[str, int, int]] = []  # (source, fragment, after_version) of each log fetch
        self.sent: list[str] = []
        self.liveness = Liveness.ALIVE  # what a probe of any peer shows

    def probe(self, peer, addresses=()) -> concurrent.futures.Future:  # noqa: ANN001
        return settled(self.liveness)

    def bind(self, handlers) -> None:  # noqa: ANN001
        pass

    def send_delta(self, to_peer, frame, on_reply=None) -> None:  # noqa: ANN001
        self.sent.append(to_peer)

    def push_update(self, to_peer, frame, on_reply=None) -> None:  # noqa: ANN001
        pass

    def relay(self, to_peer, frame) -> concurrent.futures.Future:  # noqa: ANN001
        return concurrent.futures.Future()  # lost in flight: never answered

    def request_updates(self, from_peer, fragment, after_version) -> concurrent.futures.Future:  # noqa: ANN001
        self.asked.append((from_peer, fragment, after_version))
        if from_peer in self.frozen:
            self.pending.append(concurrent.futures.Future())
            return self.pending[-1]
        log = self.logs.get(from_peer, self.updates)
        return settled(log if isinstance(log, BaseException) else list(log))

    def request_snapshot(self, from_peer, fragment) -> concurrent.futures.Future:  # noqa: ANN001
        return settled(self.snapshot)

    def request_chunk(self, from_peer, fragment, chunk, checksum, nbytes) -> concurrent.futures.Future:  # noqa: ANN001
        if chunk not in self.chunks:
            return settled(ConnectionError(f"no chunk {chunk}"))
        return settled(self.chunks[chunk])


class PeerHarness(InlineDriver):
    """Unit-test access to one peer: handlers answer reason strings, tasks run to their end."""

    @property
    def replica(self):  # noqa: ANN201
        return self.peer.replica

    def handle_delta(self, sender: str, frame: bytes) -> str:
        reply = super().handle_delta(sender, frame)
        assert isinstance(reply, Reply)
        return str(reply)

    def handle_update(self, sender: str, frame: bytes) -> str:
        reply = super().handle_update(sender, frame)
        assert isinstance(reply, Reply)
        return str(reply)

    def read_view(self, now: float):  # noqa: ANN201
        return self.peer.membership.ingest(self.read_all())

    def read_all(self):  # noqa: ANN201
        """What an election round reads (`Membership.read_swarm`), read now."""
        return self.read_swarm(self.peer.membership.read_swarm())

    def election_tick(self, now: float):  # noqa: ANN201
        """Read the swarm and run the election once (what a swarm tick does, without the heartbeat)."""
        decision = self.peer.elect(self.read_view(now), now)
        for intent in self.peer.flush():
            self.perform(intent)
        return decision

    def fetch_fragment(self, fragment: int, sources: list[str]) -> bool:
        return self.run_task(self.peer.repair.fetch_fragment(fragment, sources))

    def catch_up_fragment(self, fragment: int, sources: list[str], *, target: int) -> bool:
        task = self.peer.repair.catch_up_fragment(fragment, sources, target=target, now=self.clock.now())
        return self.run_task(task)

    def heartbeat(self, now: float, **fields) -> None:  # noqa: ANN003
        self.perform(self.peer.membership.heartbeat_record(self.peer.heartbeat_info(**fields), now))

    def sync_now(self, now: float):  # noqa: ANN201
        """Close the rounds that are ready now (as a sync tick does); the published records."""
        published = self.peer.sync_tick(now)
        for intent in self.peer.flush():
            self.perform(intent)
        return published


# One keyring for the in-process peers of a test session: a peer signs with its own secret only.
KEYS = InMemoryKeys()


def keys_for(peer_id: str) -> PeerKeys:
    return KEYS.for_peer(peer_id)


def signed(record: UpdateRecord) -> UpdateRecord:
    """`record` signed by the leader it names (as that leader's own peer would)."""
    return replace(record, signature=KEYS.signer(record.leader).sign(update_signing_bytes(record)))


def make_peer(
    manifest: RunManifest,
    *,
    peer_id: str = "me",
    kv: InMemoryKeyValueStore | None = None,
    clock: FakeClock | None = None,
    may_sync: bool = False,
    learner: bool = True,
    published: list | None = None,
    transport: StubTransport | None = None,
) -> PeerHarness:
    """A peer of `manifest` (freshly built model, 2 fragments) under a `PeerHarness`: a stub transport, a
    new store and a clock at 100.0 unless given. `learner=False`: no learner (built without a sampler
    or optimizer); `published`: collects the update records the peer publishes."""
    if learner:
        t = tiny_training(manifest)
        plan, replica, shapes = t.plan, t.replica, t.shapes
        trainer = Learner(peer_id, manifest, t.plan, t.replica, t.model, t.optimizer, t.sampler)
    else:
        model = build_model(manifest.model)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        plan = plan_fragments(list(shapes.items()), 2)
        replica, trainer = GlobalReplica(plan, dict(model.named_parameters())), None
    peer = Peer(
        peer_id,
        manifest,
        plan,
        replica,
        shapes=shapes,
        keys=keys_for(peer_id),
        may_sync=may_sync,
        has_learner=learner,
    )

    def observe(intent) -> None:  # noqa: ANN001
        if isinstance(intent, Published) and published is not None:
            published.append(intent.record)

    kv, clock = kv or InMemoryKeyValueStore(), clock or FakeClock(100.0)
    transport = transport or StubTransport()
    return PeerHarness(peer, kv=kv, transport=transport, clock=clock, learner=trainer, observer=observe)
