"""Fuzzing every handler input end to end: garbage and mutated valid frames into the peer and synchronizer.

wire/frames.py, wire/codecs/codec.py and swarm/records.py decoders have their own fuzz tests; these drive what
reaches the handlers behind them (`Peer.handle_delta`, `handle_update`, `serve_updates`,
`serve_snapshot`, snapshot and replay responses, DHT records through `read_swarm`, and
`Synchronizer.offer_delta` then `poll`), including valid frames with one header field replaced by
arbitrary JSON or a few bytes changed. Every answer must be a reason string starting with a tag, never an
exception, and garbage must leave the replica's digest unchanged.
"""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.net import streams
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.memory import FakeClock
from p2p_diloco.swarm.synchronizer import Synchronizer
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import encode_delta, encode_update
from p2p_diloco.wire.keys import heartbeat_key, lease_key
from p2p_diloco.wire.records import HeartbeatInfo, encode_lease
from p2p_diloco.wire.replies import Reply
from tests.support.manifests import TINY_MODEL, tiny_manifest
from tests.support.peers import PeerHarness, make_peer, signed

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REASON = re.compile(r"^[a-z][a-z0-9 -]*(:|$)")  # "<tag>: <details>"

MODEL = TINY_MODEL
MANIFEST = tiny_manifest("fz")
_template = build_model(MODEL)
SHAPES = {n: tuple(p.shape) for n, p in _template.named_parameters()}
PLAN = plan_fragments(list(SHAPES.items()), 2)
INITIAL = {n: p.detach().clone() for n, p in _template.named_parameters()}
BASE = GlobalReplica(PLAN, INITIAL)
PEERS = st.sampled_from(["leader", "mallory", "me", "x" * 300, ""])


def fuzz_peer(manifest: RunManifest = MANIFEST) -> PeerHarness:
    """A peer without a learner at time 10.0 that follows "leader"'s lease (term 1)."""
    peer = make_peer(manifest, learner=False, clock=FakeClock(10.0))
    lease = LeaseRecord("leader", 1, expires_at=10.0 + manifest.timing.lease_ttl)  # written at 10.0
    peer.kv.store(lease_key(manifest.run_id, manifest.manifest_hash), "leader", encode_lease(lease), 1e9)
    return peer


def valid_update(fragment: int = 0) -> bytes:
    replica = GlobalReplica(PLAN, INITIAL)
    raw = {n: torch.full(s, 0.01) for n, s in replica.shapes(fragment).items()}
    payload = encode_tensors(raw)
    grad = decode_tensors(payload)
    pending = replica.compute_update(fragment, grad, lr=0.7, momentum=0.9)
    record = UpdateRecord(
        "fz", MANIFEST.manifest_hash, fragment, 0, 1, "leader", (("a", 1.0),), pending.checksum, payload
    )
    return encode_update(signed(record))


def valid_delta(fragment: int = 0) -> bytes:
    tensors = {n: torch.full(s, 1e-3) for n, s in BASE.shapes(fragment).items()}
    tps = MANIFEST.diloco.batch_size * MODEL.block_size
    header = DeltaHeader("fz", MANIFEST.manifest_hash, fragment, 0, tokens=4 * tps, steps=4, seq=1)
    return encode_delta(header, encode_tensors(tensors))


UPDATE, DELTA, SNAPSHOT = valid_update(), valid_delta(), fuzz_peer().serve_snapshot("me", 0)
_PREFIX = struct.Struct("<BIQ")

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(["leader", "me", "fz", MANIFEST.manifest_hash]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=5,
)


def with_field(frame: bytes, key: str, value) -> bytes:
    """`frame` with one header field set to `value` (any JSON), framed again without schema checks."""
    _, header_len, payload_len = _PREFIX.unpack_from(frame, 4)
    start = 4 + _PREFIX.size
    header = json.loads(frame[start : start + header_len])
    header[key] = value
    raw = json.dumps(header).encode()
    payload = frame[start + header_len :]
    return frame[:4] + _PREFIX.pack(1, len(raw), len(payload)) + raw + payload


def header_keys(frame: bytes) -> list[str]:
    _, header_len, _ = _PREFIX.unpack_from(frame, 4)
    return sorted(json.loads(frame[4 + _PREFIX.size : 4 + _PREFIX.size + header_len]))


def byte_edits(frame: bytes, edits: list[tuple[int, int]], start: int = 0) -> bytes:
    out = bytearray(frame)
    for position, value in edits:
        out[start + position % (len(out) - start)] = value
    return bytes(out)


def payload_start(frame: bytes) -> int:
    _, header_len, _ = _PREFIX.unpack_from(frame, 4)
    return 4 + _PREFIX.size + header_len


edits = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4)
plausible = st.integers(-2, 5) | st.sampled_from(
    ["leader", "me", "mallory", "fz", MANIFEST.manifest_hash, 0.5, 64]
)


@st.composite
def mutated(draw, frame: bytes) -> bytes:
    """A valid frame with a header field replaced, bytes of its payload or anywhere changed, or garbage."""
    how = draw(st.sampled_from(["field", "field", "payload", "bytes", "garbage"]))
    if how == "field":
        key = draw(st.sampled_from(header_keys(frame)))
        return with_field(frame, key, draw(plausible | json_values))
    if how == "payload":
        return byte_edits(frame, draw(edits), payload_start(frame))
    if how == "bytes":
        cut = draw(st.none() | st.integers(0, len(frame)))
        return byte_edits(frame, draw(edits))[:cut] + draw(st.binary(max_size=8))
    return draw(st.binary(max_size=300))


def clean(reply) -> bool:
    reply = str(reply) if isinstance(reply, Reply) else reply
    return isinstance(reply, str) and bool(REASON.match(reply))


@FUZZ
@given(frame=mutated(UPDATE), sender=PEERS)
def test_handle_update_answers_a_reason_and_garbage_never_changes_the_replica(frame, sender):
    peer = fuzz_peer()
    before = peer.replica.digest()
    reply = peer.handle_update(sender, frame)
    assert clean(reply), reply
    if not reply.startswith("applied"):
        assert peer.replica.digest() == before
        assert peer.peer.updates_applied == 0


def test_the_unmutated_update_is_applied_only_from_its_leader():
    assert fuzz_peer().handle_update("leader", UPDATE).startswith("applied")
    assert fuzz_peer().handle_update("mallory", UPDATE).startswith("not the leader")


@FUZZ
@given(frame=mutated(DELTA), sender=PEERS)
def test_peer_handle_delta_without_the_role_refuses_cleanly(frame, sender):
    peer = fuzz_peer()
    before = peer.replica.digest()
    assert clean(reply := peer.handle_delta(sender, frame)), reply
    assert not reply.startswith(("accepted", "opened round"))
    assert peer.replica.digest() == before


@FUZZ
@given(frames=st.lists(mutated(DELTA), min_size=1, max_size=4), sender=PEERS)
def test_synchronizer_handles_mutated_deltas_and_still_merges_cleanly(frames, sender):
    peer = fuzz_peer()
    sync = Synchronizer("me", MANIFEST, PLAN, peer.replica, term=1, shapes=SHAPES)
    before = peer.replica.digest()
    for i, frame in enumerate(frames):
        assert clean(reply := sync.offer_delta(sender, frame, float(i))), reply
    for outcome in sync.poll(10.0, frozenset({sender}), cap=0.0):  # whatever got in must merge cleanly
        decode_tensors(outcome.record.payload, expected_shapes=peer.replica.shapes(outcome.record.fragment))
    assert peer.replica.digest() == before  # the synchronizer never touches the replica itself


@FUZZ
@given(requester=PEERS, fragment=st.integers(-(2**70), 2**70), after=st.integers(-(2**70), 2**70))
def test_serve_requests_with_garbage_indexes_answer_cleanly(requester, fragment, after):
    peer = fuzz_peer()
    assert peer.handle_update("leader", UPDATE).startswith("applied")
    before = peer.replica.digest()
    frames = peer.serve_updates(requester, fragment, after)
    assert isinstance(frames, list) and all(isinstance(f, bytes) for f in frames)
    snapshot = peer.serve_snapshot(requester, fragment)
    assert isinstance(snapshot, bytes)
    assert (snapshot != b"") == (0 <= fragment < PLAN.num_fragments)
    assert peer.replica.digest() == before


def test_allowlist_is_enforced_at_every_handler_and_on_records():
    private = RunManifest(run_id="fz", model=MODEL, diloco=MANIFEST.diloco, allowlist=("leader", "me"))
    peer = fuzz_peer(private)
    assert peer.handle_delta("mallory", DELTA).startswith("not allowed")
    assert peer.handle_update("mallory", UPDATE).startswith("not allowed")
    assert peer.serve_updates("mallory", 0, 0) == [] and peer.serve_snapshot("mallory", 0) == b""
    assert peer.serve_snapshot("leader", 0) != b""
    now = 10.0
    hb = HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(0, 0)).to_bytes()
    for who in ("leader", "mallory"):
        peer.kv.store(peer.peer.membership.hb_key, who, hb, now + 5)
    peer.kv.store(
        peer.peer.membership.lease_key,
        "mallory",
        encode_lease(LeaseRecord("mallory", 7, expires_at=1e9)),
        1e9,
    )
    peer.read_view(now)
    assert set(peer.peer.live_peers) == {"leader"}
    assert 7 not in peer.peer.membership.lease_holders and peer.peer.membership.lease_holders[1] == {"leader"}


@FUZZ
@given(snapshot=mutated(SNAPSHOT), fragment=st.integers(0, 1))
def test_fetched_snapshot_garbage_is_refused_without_touching_the_replica(snapshot, fragment):
    peer = fuzz_peer()
    peer.transport.snapshot = snapshot
    before = peer.replica.digest()
    loaded = peer.fetch_fragment(fragment, ["src"])
    assert isinstance(loaded, bool)
    if not loaded:
        assert peer.replica.digest() == before


@FUZZ
@given(frames=st.lists(mutated(UPDATE), max_size=3))
def test_replayed_update_garbage_is_refused_without_touching_the_replica(frames):
    peer = fuzz_peer()
    peer.transport.updates = frames
    peer.transport.snapshot = b"garbage"
    before = peer.replica.digest()
    peer.catch_up_fragment(0, ["src"], target=1)
    if peer.replica.versions() == (0, 0):
        assert peer.replica.digest() == before


def test_a_replay_whose_prefetched_first_log_failed_goes_on_from_the_next_source():
    """A catch-up fetches every fragment's first log at once (`FetchUpdateLogs`); a failed one is noted
    and the fragment's next source is asked, as when the fetch was made one at a time."""
    peer = fuzz_peer()
    peer.transport.updates = [UPDATE]
    task = peer.peer.repair.catch_up_fragment(
        0, ["dead", "src"], target=1, now=peer.clock.now(), first_log=ConnectionError("connection refused")
    )
    assert peer.run_task(task) is True
    assert peer.replica.versions()[0] == 1
    assert any("replay of fragment 0 from dead failed" in line for line in peer.peer.decisions)

    fetched = fuzz_peer()  # a prefetched log is used as it is: no second fetch from that source
    fetched.transport.updates = []
    task = fetched.peer.repair.catch_up_fragment(
        0, ["src"], target=1, now=fetched.clock.now(), first_log=[UPDATE]
    )
    assert fetched.run_task(task) is True and fetched.replica.versions()[0] == 1


heartbeat_json = json.loads(
    HeartbeatInfo(role="learner", may_sync=True, reachable=True, versions=(0, 0)).to_bytes()
)


@st.composite
def record_values(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    d = (
        dict(heartbeat_json)
        if draw(st.booleans())
        else {"term": 1, "expires_at": 5.0, "rounds_done": 0, "released": False}
    )
    d[draw(st.sampled_from(sorted(d)))] = draw(json_values)
    return json.dumps(d).encode()


@FUZZ
@given(
    heartbeats=st.lists(st.tuples(PEERS, record_values()), max_size=3),
    leases=st.lists(st.tuples(PEERS, record_values()), max_size=3),
)
def test_garbage_dht_records_are_ignored_by_read_swarm_and_the_election(heartbeats, leases):
    peer = fuzz_peer()
    now = peer.clock.now()
    for who, value in heartbeats:
        peer.kv.store(heartbeat_key("fz", MANIFEST.manifest_hash), who, value, now + 5)
    for who, value in leases:
        peer.kv.store(lease_key("fz", MANIFEST.manifest_hash), who, value, now + 5)
    before = peer.replica.digest()
    decision = peer.election_tick(now)
    assert clean(decision.reason), decision.reason
    assert all(info.versions == () or len(info.versions) == 2 for info in peer.peer.live_peers.values())
    assert peer.replica.digest() == before


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=24))
def test_fetch_request_bodies_only_raise_bad_envelope(body):
    for decode in (streams.decode_fetch, streams.decode_fragment):
        try:
            decode(body)
        except streams.BadEnvelope:
            pass


@pytest.mark.parametrize("fragment", [-1, 2, 2**40])
def test_snapshot_of_an_unknown_fragment_is_an_empty_answer_and_a_counted_rejection(fragment):
    peer = fuzz_peer()
    assert peer.serve_snapshot("leader", fragment) == b""
    assert peer.peer.rejections["unknown fragment"] == 1


def test_a_heartbeat_claiming_the_synchronizer_role_does_not_admit_its_updates():
    peer = fuzz_peer()
    claim = HeartbeatInfo(role="synchronizer", may_sync=True, reachable=True, versions=(0, 0), term_seen=5)
    peer.kv.store(peer.peer.membership.hb_key, "mallory", claim.to_bytes(), 100.0)
    peer.read_view(10.0)
    replica = GlobalReplica(PLAN, INITIAL)
    payload = encode_tensors({n: torch.full(s, 50.0) for n, s in replica.shapes(0).items()})
    pending = replica.compute_update(0, decode_tensors(payload), lr=0.7, momentum=0.9)
    forged = UpdateRecord(
        "fz", MANIFEST.manifest_hash, 0, 0, 5, "mallory", (("mallory", 1.0),), pending.checksum, payload
    )
    before = peer.replica.digest()
    assert not peer.handle_update("mallory", encode_update(forged)).startswith("applied")
    assert peer.replica.digest() == before


def test_replay_stops_at_an_unverifiable_lease_instead_of_reading_the_dht_per_frame():
    peer = fuzz_peer()
    reads = []
    kv_get = peer.kv.get
    peer.kv.get = lambda key, now: reads.append(key) or kv_get(key, now)
    replica = GlobalReplica(PLAN, INITIAL)
    frames = []
    for version in range(20):  # a log of a term whose lease record expired long ago
        raw = {n: torch.full(s, 0.01) for n, s in replica.shapes(0).items()}
        pending = replica.compute_update(0, decode_tensors(encode_tensors(raw)), lr=0.7, momentum=0.9)
        payload = encode_tensors(raw)
        record = UpdateRecord(
            "fz",
            MANIFEST.manifest_hash,
            0,
            version,
            version + 1,
            "ghost",
            (("a", 1.0),),
            pending.checksum,
            payload,
        )
        frames.append(encode_update(signed(record)))
    peer.transport.updates = frames
    peer.transport.snapshot = b"garbage"
    assert not peer.catch_up_fragment(0, ["src"], target=20)
    assert peer.replica.versions() == (0, 0)
    swarm_reads = [key for key in reads if not key.endswith("_underway")]  # a fresh peer reads that key too
    assert len(swarm_reads) <= 2  # one re-read of heartbeats and leases, not one per frame
    assert len(reads) <= 3
    assert peer.peer.rejections["no lease"] == 1
