"""Streamed snapshots (wire/snapshot_chunks.py, swarm/snapshots.py, Repair): a fragment downloaded in chunks
from two sources at once, one killed midway; a corrupted chunk refused and counted; a lying index never
reaches the replica; pins bounded and expiring; the index and chunk request decoders are strict."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from p2p_diloco.config import LimitsConfig, RunManifest
from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.memory import FakeClock, InMemoryKeyValueStore
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.swarm.snapshots import BAD_CHUNK_DIGEST, BAD_CHUNK_SIZE, SnapshotServer, UnknownSnapshot
from p2p_diloco.wire.snapshot_chunks import (
    CHUNK_REQUEST_BYTES,
    chunk_layout,
    decode_chunk_request,
    decode_index,
    encode_chunk_request,
)
from tests.support.manifests import TINY_DILOCO, TINY_MODEL
from tests.support.peers import PeerHarness, StubTransport, keys_for, settled

SHAPES = {"a": (64, 64), "b": (1000,), "c": (32, 32)}
PLAN = plan_fragments(list(SHAPES.items()), 2)
MANIFEST = RunManifest(
    run_id="chunks",
    model=TINY_MODEL,
    diloco=TINY_DILOCO,
    limits=LimitsConfig(snapshot_chunk_bytes=4096, snapshot_chunks_in_flight=1),
)


def initial() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def advanced(steps: int = 2) -> GlobalReplica:
    """A replica some updates ahead of the initial one (what the sources hold)."""
    replica = GlobalReplica(PLAN, initial())
    gen = torch.Generator().manual_seed(5)
    for p in range(PLAN.num_fragments):
        for v in range(steps):
            grad = {n: torch.randn(s, generator=gen) * 0.01 for n, s in replica.shapes(p).items()}
            assert replica.apply(p, v, grad, lr=0.7, momentum=0.9, expected_checksum=None).action == "apply"
    return replica


def harness(peer_id: str, replica: GlobalReplica, transport=None, manifest=MANIFEST) -> PeerHarness:  # noqa: ANN001
    peer = Peer(peer_id, manifest, PLAN, replica, shapes=SHAPES, keys=keys_for(peer_id), has_learner=False)
    return PeerHarness(
        peer, kv=InMemoryKeyValueStore(), transport=transport or StubTransport(), clock=FakeClock(1.7e9)
    )


class Routing(StubTransport):
    """The newcomer's transport: index and chunk requests go to real source peers; faults on demand."""

    def __init__(self, sources: dict[str, PeerHarness]):
        super().__init__()
        self.sources = sources
        self.calls: list[tuple[str, int]] = []
        self.asked: list[tuple[str, int, int]] = []  # ("index" or "chunk", fragment, round), in order asked
        self.deferred = False  # answers wait for `next_round` (a network's round trip), not given at once
        self.pending: list[tuple[concurrent.futures.Future, object]] = []
        self.round = 0
        self.die_after: dict[str, int] = {}  # source -> chunks it serves before it dies
        self.dead: set[str] = set()
        self.corrupt: set[tuple[str, int]] = set()  # (source, chunk) answered with a flipped bit
        self.short: set[tuple[str, int]] = set()  # (source, chunk) answered one float short

    def answer(self, value: object) -> concurrent.futures.Future:
        if not self.deferred:
            return settled(value)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.pending.append((future, value))
        return future

    def next_round(self) -> bool:
        """Answer every request asked so far; False when none was waiting."""
        answers, self.pending = self.pending, []
        self.round += 1
        for future, value in answers:
            (future.set_exception if isinstance(value, BaseException) else future.set_result)(value)
        return bool(answers)

    def request_snapshot(self, from_peer, fragment):  # noqa: ANN001, ANN201
        self.asked.append(("index", fragment, self.round))
        if from_peer in self.dead:
            return self.answer(ConnectionError(f"{from_peer} is down"))
        return self.answer(self.sources[from_peer].serve_snapshot("me", fragment))

    def request_chunk(self, from_peer, fragment, chunk, checksum, nbytes):  # noqa: ANN001, ANN201
        self.asked.append(("chunk", fragment, self.round))
        served = sum(1 for who, _ in self.calls if who == from_peer)
        if from_peer in self.die_after and served >= self.die_after[from_peer]:
            self.dead.add(from_peer)
        if from_peer in self.dead:
            return self.answer(ConnectionError(f"{from_peer} is down"))
        self.calls.append((from_peer, chunk))
        try:
            data = self.sources[from_peer].serve_chunk("me", fragment, chunk, checksum)
        except LookupError as exc:
            return self.answer(ConnectionError(str(exc)))
        if (from_peer, chunk) in self.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:]
        if (from_peer, chunk) in self.short:
            data = data[:-4]
        return self.answer(data)


def setup(*names: str, manifest: RunManifest = MANIFEST) -> tuple[GlobalReplica, Routing, PeerHarness]:
    state = advanced()
    sources = {name: harness(name, state.frozen()) for name in names}
    routing = Routing(sources)
    me = harness("me", GlobalReplica(PLAN, initial()), routing, manifest)
    for p in range(PLAN.num_fragments):  # the newcomer has checked the update records of these states
        v = state.version(p)
        record = UpdateRecord(
            "chunks", MANIFEST.manifest_hash, p, v - 1, 1, "A", (("A", 1.0),), state.checksum(p), b""
        )
        me.peer.book.vouchers.vouch(record)
    return state, routing, me


def test_a_fragment_comes_in_chunks_from_two_sources_and_survives_one_dying_midway() -> None:
    state, routing, me = setup("A", "B")
    count = len(chunk_layout(me.replica.shapes(0), 4096))
    assert count >= 8  # enough chunks to spread
    routing.die_after["B"] = 2  # B serves two chunks, then its process is killed
    assert me.fetch_fragment(0, ["A", "B"])
    assert me.replica.checksum(0) == state.checksum(0) and me.replica.version(0) == 2
    who = [source for source, _ in routing.calls]
    assert who.count("B") == 2 and who.count("A") == count - 2  # B's share went to A
    assert set(me.peer.repair.downloaded) == {"A", "B"}
    assert sum(me.peer.repair.downloaded.values()) == sum(c.nbytes for c in chunk_layout(SHAPES_OF(0), 4096))
    assert me.peer.rejections == {}  # a dead source is a failure, not a hostile one


def SHAPES_OF(fragment: int) -> dict[str, tuple[int, ...]]:  # noqa: N802
    return {n: SHAPES[n] for n in PLAN.names(fragment)}


def test_both_sources_share_the_work_when_all_is_well() -> None:
    state, routing, me = setup("A", "B")
    assert me.run_task(me.peer.repair.fetch_fragments({0: ["A", "B"], 1: ["B", "A"]})) == 2
    assert me.replica.digest() == state.digest()
    per = {s: sum(1 for who, _ in routing.calls if who == s) for s in ("A", "B")}
    assert abs(per["A"] - per["B"]) <= 2 and min(per.values()) > 0


@pytest.mark.parametrize("budget, side_by_side", [(256 * 1024 * 1024, True), (0, False)])
def test_fragments_download_side_by_side_within_the_byte_budget(budget, side_by_side) -> None:
    manifest = RunManifest(
        run_id="chunks",
        model=TINY_MODEL,
        diloco=TINY_DILOCO,
        limits=LimitsConfig(
            snapshot_chunk_bytes=4096, snapshot_chunks_in_flight=1, snapshot_download_bytes=budget
        ),
    )
    state, routing, me = setup("A", "B", manifest=manifest)
    routing.deferred = True
    done: concurrent.futures.Future = concurrent.futures.Future()
    me.peer.spawn(me.peer.repair.fetch_fragments({0: ["A", "B"], 1: ["B", "A"]}), done.set_result)
    for intent in me.peer.flush():
        me.perform(intent)
    while routing.next_round():
        pass
    assert done.result(timeout=0) == 2 and me.replica.digest() == state.digest()
    rounds = {p: {r for kind, q, r in routing.asked if q == p} for p in (0, 1)}
    # side by side: both fragments' downloads start in the first round; else fragment 1 starts after 0 ends
    assert (min(rounds[0]) == min(rounds[1]) == 0) == side_by_side
    assert (min(rounds[1]) > max(rounds[0])) == (not side_by_side)


@pytest.mark.parametrize("fault, tag", [("corrupt", BAD_CHUNK_DIGEST), ("short", BAD_CHUNK_SIZE)])
def test_a_corrupted_chunk_is_refused_counted_and_fetched_from_the_other_source(fault, tag) -> None:
    state, routing, me = setup("A", "B")
    getattr(routing, fault).add(("B", 1))
    assert me.fetch_fragment(0, ["A", "B"])
    assert me.replica.checksum(0) == state.checksum(0)
    assert me.peer.rejections[tag] == 1 and me.peer.rejections_by_sender[("B", tag)] == 1
    later = [chunk for who, chunk in routing.calls if who == "B"]
    assert later == [1]  # B was not asked again after its bad chunk


def test_a_lying_source_never_reaches_the_replica() -> None:
    _, routing, me = setup("A")
    routing.corrupt.update(("A", n) for n in range(64))  # every chunk bad: refused at the first
    before = me.replica.digest()
    assert not me.fetch_fragment(0, ["A"])
    assert me.replica.digest() == before


def test_a_source_that_moved_on_still_serves_its_pinned_state_and_pins_are_bounded() -> None:
    replica = advanced(1)
    server = SnapshotServer("chunks", MANIFEST.manifest_hash, chunk_bytes=4096, max_pins=2, pin_seconds=60.0)
    version, params, momentum = replica.fragment_state(0)
    index = decode_index(server.index(0, version, replica.checksum(0), params, momentum, now=0.0))
    first = server.chunk(0, 0, index.checksum, now=1.0)
    gen = torch.Generator().manual_seed(9)
    grad = {n: torch.randn(s, generator=gen) for n, s in replica.shapes(0).items()}
    replica.apply(0, 1, grad, lr=0.7, momentum=0.9, expected_checksum=None)  # the replica moves on
    assert server.chunk(0, 0, index.checksum, now=2.0) == first  # the pinned state is still served
    for p, t in ((1, 3.0), (0, 4.0)):  # two newer states: the oldest pin drops out
        v, pa, mo = replica.fragment_state(p)
        server.index(p, v, replica.checksum(p), pa, mo, now=t)
    assert server.pinned() == 2
    with pytest.raises(UnknownSnapshot):
        server.chunk(0, 0, index.checksum, now=5.0)
    with pytest.raises(UnknownSnapshot):  # idle longer than pin_seconds
        server.chunk(1, 0, replica.checksum(1), now=100.0)


def test_index_and_chunk_request_decoders_are_strict() -> None:
    _, _, me = setup()
    frame = me.serve_snapshot("peer", 0)
    index = decode_index(frame)
    assert index.count == len(chunk_layout(me.replica.shapes(0), 4096)) and index.fragment == 0
    for bad in (frame[:-1], frame + b"\0", frame[:4] + b"\x09" + frame[5:], b"PDsn" + frame[4:]):
        with pytest.raises(DecodeError):
            decode_index(bad)
    body = encode_chunk_request(1, 7, index.checksum)
    assert len(body) == CHUNK_REQUEST_BYTES and decode_chunk_request(body) == (1, 7, index.checksum)
    for bad in (body[:-1], body + b"\0", b""):
        with pytest.raises(DecodeError):
            decode_chunk_request(bad)
    with pytest.raises(LookupError):  # a chunk of a state never announced
        me.serve_chunk("peer", 0, 0, "00" * 32)
