"""A peer receiving relayed updates: relaying extends no trust. A tampered update is refused with its
reason, counted and its relayer dropped, and the replica does not change; an honest relay applies."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.protocol.messages import UpdateRecord, UpdateTag
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.memory import FakeClock
from p2p_diloco.swarm.relay import relay_order
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import _PREFIX, UPDATE_MAGIC, decode_update, encode_update
from p2p_diloco.wire.keys import heartbeat_key, lease_key
from p2p_diloco.wire.records import HeartbeatInfo, encode_lease
from p2p_diloco.wire.relay_frames import (
    Offer,
    Relayed,
    RelayTag,
    UpdateId,
    decode_relay,
    encode_offer,
    encode_relayed,
)
from p2p_diloco.wire.replies import Reply, ReplyStatus
from tests.support.manifests import tiny_manifest
from tests.support.peers import PeerHarness, StubTransport, make_peer, settled, signed

MANIFEST = tiny_manifest("rl")


def follower() -> PeerHarness:
    """A peer without a learner at time 10.0; "leader" holds the lease of term 1."""
    peer = make_peer(MANIFEST, learner=False, clock=FakeClock(10.0))
    lease = LeaseRecord("leader", 1, expires_at=10.0 + MANIFEST.timing.lease_ttl)
    peer.kv.store(lease_key(MANIFEST.run_id, MANIFEST.manifest_hash), "leader", encode_lease(lease), 1e9)
    return peer


def leader_update(peer: PeerHarness) -> UpdateRecord:
    """The leader's signed update of fragment 0, v0 -> v1, that `peer`'s replica can apply."""
    plan = peer.peer.plan
    params = {n: t.clone() for p in range(plan.num_fragments) for n, t in peer.replica.params_view(p).items()}
    replica = GlobalReplica(plan, params)
    payload = encode_tensors({n: torch.full(s, 0.01) for n, s in replica.shapes(0).items()})
    pending = replica.compute_update(0, decode_tensors(payload), lr=0.7, momentum=0.9)
    record = UpdateRecord(
        "rl", MANIFEST.manifest_hash, 0, 0, 1, "leader", (("a", 1.0),), pending.checksum, payload
    )
    return signed(record)


FUZZED = follower()


def offer(peer: PeerHarness, sender: str, record: UpdateRecord, hop: int = 2):
    return peer.handle_relay(sender, encode_offer(Offer(UpdateId.of(record), hop)))


def test_a_tampered_relay_is_refused_counted_and_its_relayer_dropped():
    peer = follower()
    record = leader_update(peer)
    before = peer.replica.digest()
    assert offer(peer, "mallory", record).tag == RelayTag.SEND
    frame = bytearray(encode_update(record))
    frame[-1] ^= 0xFF  # one payload byte changed: the leader's signature no longer matches
    reply = peer.handle_relay("mallory", encode_relayed(2, bytes(frame)))
    assert (reply.status, reply.tag) == (ReplyStatus.REFUSED, UpdateTag.BAD_SIGNATURE)
    assert peer.replica.digest() == before and peer.replica.version(0) == 0
    assert peer.peer.journal.rejections_by_sender[("mallory", UpdateTag.BAD_SIGNATURE)] == 1
    assert "mallory" in peer.peer.relay.dropped and peer.peer.relay.stats.offences == 1
    assert offer(peer, "mallory", record).tag == RelayTag.DROPPED
    # an honest relayer of the genuine update is asked and its update applied
    assert offer(peer, "relayer", record, hop=3).tag == RelayTag.SEND
    applied = peer.handle_relay("relayer", encode_relayed(3, encode_update(record)))
    assert applied.status == ReplyStatus.APPLIED and peer.replica.version(0) == 1
    stats = peer.peer.relay.stats
    assert (stats.applied_relayed, stats.hops, stats.applied_at) == (1, {0: 3}, {0: (1, 10.0)})
    assert offer(peer, "relayer", record).tag == RelayTag.HAVE


def test_an_update_no_one_asked_for_is_refused_and_another_than_offered_drops_its_relayer():
    peer = follower()
    record = leader_update(peer)
    unasked = peer.handle_relay("stranger", encode_relayed(2, encode_update(record)))
    assert (unasked.status, unasked.tag) == (ReplyStatus.REFUSED, RelayTag.UNASKED)
    assert "stranger" not in peer.peer.relay.dropped  # maybe late after a re-ask: counted, not dropped
    decoy = signed(dataclasses.replace(record, checksum="0" * 16))
    assert offer(peer, "mallory", decoy).tag == RelayTag.SEND
    swapped = peer.handle_relay("mallory", encode_relayed(2, encode_update(record)))
    assert swapped.tag == RelayTag.MISMATCH and "mallory" in peer.peer.relay.dropped
    assert peer.replica.version(0) == 0
    assert peer.handle_relay("mallory", b"\x07junk").status == ReplyStatus.REFUSED


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=400), sender=st.sampled_from(["relayer", "mallory", ""]))
def test_garbage_relay_frames_get_a_refusal_and_never_change_the_replica(data, sender):
    peer = FUZZED
    before = peer.replica.digest()
    reply = peer.handle_relay(sender, data)
    assert isinstance(reply, Reply) and reply.tag
    assert reply.status in (ReplyStatus.REFUSED, ReplyStatus.ACCEPTED)  # an offer may be asked for
    assert peer.replica.digest() == before


class AskingTransport(StubTransport):
    """Every offer is asked for (`SEND`); the update payloads relayed on are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.relayed: list[tuple[str, bytes]] = []

    def relay(self, to_peer, frame):  # noqa: ANN001, ANN201
        message = decode_relay(frame)
        if isinstance(message, Relayed):
            self.relayed.append((to_peer, message.frame))
            return settled(Reply(ReplyStatus.APPLIED, "applied"))
        return settled(Reply(ReplyStatus.ACCEPTED, RelayTag.SEND, "send"))


def test_a_relayer_passes_on_the_record_encoded_anew_not_a_padded_frame_it_received():
    """A relayer sends on the record as its own encoder writes it: a header a hostile relayer padded
    (whitespace, which every check accepts: the signature covers the fields, not the frame's bytes) costs
    only that relayer's own upload, and goes no further than the peers it sent it to."""
    manifest = dataclasses.replace(MANIFEST, diloco=dataclasses.replace(MANIFEST.diloco, fanout=1))
    transport = AskingTransport()
    peer = make_peer(manifest, learner=False, clock=FakeClock(10.0), transport=transport)
    lease = LeaseRecord("leader", 1, expires_at=10.0 + manifest.timing.lease_ttl)
    peer.kv.store(lease_key(manifest.run_id, manifest.manifest_hash), "leader", encode_lease(lease), 1e9)
    record = signed(dataclasses.replace(leader_update(peer), manifest_hash=manifest.manifest_hash))
    update = UpdateId.of(record)
    child = next(  # a peer right after me in this update's tree (fanout 1: a chain leader -> me -> child)
        c
        for c in (f"child{i}" for i in range(1000))
        if relay_order(update, ["leader", "me", c])[1:] == ["me", c]
    )
    beat = HeartbeatInfo(role="learner", may_sync=False, reachable=True, versions=(0, 0)).to_bytes()
    peer.kv.store(heartbeat_key(manifest.run_id, manifest.manifest_hash), child, beat, 1e9)
    peer.read_view(10.0)
    frame = padded_header(encode_update(record), 4096)
    assert len(frame) > len(encode_update(record)) + 4000
    assert decode_update(frame, max_bytes=10**7) == record
    assert offer(peer, "leader", record, hop=1).tag == RelayTag.SEND
    applied = peer.handle_relay("leader", encode_relayed(1, frame))
    assert applied.status == ReplyStatus.APPLIED, applied
    assert transport.relayed == [(child, encode_update(record))]


def padded_header(frame: bytes, spaces: int) -> bytes:
    """`frame` with `spaces` blanks after its JSON header's first comma (the same header, more bytes)."""
    at = len(UPDATE_MAGIC)
    version, header_len, payload_len = _PREFIX.unpack_from(frame, at)
    start = at + _PREFIX.size
    header = frame[start : start + header_len].replace(b",", b"," + b" " * spaces, 1)
    return b"".join(
        (frame[:at], _PREFIX.pack(version, len(header), payload_len), header, frame[start + header_len :])
    )
