"""A newcomer's catch-up ends at the holder's tip, not at a source's (#31): the peers it downloads a fragment
from may serve a state an update behind the holder's (their snapshot, or the tip their last heartbeat
reported). After its snapshots the newcomer replays what each fragment's lease holder applied since, every
record checked like any replayed update: a forged one is refused and counted, and the snapshot stays."""

from __future__ import annotations

from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.wire.keys import lease_key
from p2p_diloco.wire.records import encode_lease
from tests.support.peers import PeerHarness, StubTransport, make_peer, settled
from tests.unit.test_holder_catch_up import MANIFEST, old_update, report, ticks

FRAGMENT = 1


class FromSource(StubTransport):
    """Snapshots and chunks come from `source`'s replica; logs as `StubTransport` (`logs[peer]`)."""

    def __init__(self) -> None:
        super().__init__()
        self.source: PeerHarness | None = None

    def request_snapshot(self, from_peer, fragment):  # noqa: ANN001, ANN201
        return settled(self.source.serve_snapshot("me", fragment))

    def request_chunk(self, from_peer, fragment, chunk, checksum, nbytes):  # noqa: ANN001, ANN201
        return settled(self.source.serve_chunk("me", fragment, chunk, checksum))


def update(peer: PeerHarness, from_version: int) -> bytes:
    """The holder "old"'s signed update of FRAGMENT from `peer`'s state at `from_version`."""
    return old_update(peer.replica, FRAGMENT, from_version)[0]


def newcomer_and_a_source_one_update_behind_the_holder() -> tuple[PeerHarness, bytes]:
    """`me` (fresh, v0) and the source "a" = "b" at v1 of FRAGMENT; the holder "old" (term 1) is at v2.
    Returns `me` and the holder's v1 -> v2 frame."""
    source = make_peer(MANIFEST, peer_id="a", learner=False)
    kv, clock = source.kv, source.clock
    lease = LeaseRecord("old", 1, expires_at=clock.now() + MANIFEST.timing.lease_ttl)
    kv.store(lease_key(MANIFEST.run_id, MANIFEST.manifest_hash), "old", encode_lease(lease), 1e9)
    ticks(source, 1)  # it has read the holder's lease
    assert source.handle_update("old", update(source, 0)).startswith("applied")
    source.peer.serving.offer_snapshots()  # what it serves (refreshed every heartbeat period)
    next_update = update(source, 1)
    transport = FromSource()
    transport.source = source
    me = make_peer(MANIFEST, kv=kv, clock=clock, learner=False, transport=transport)
    tips = tuple((t.term, t.checksum) for t in source.peer.book.tips())
    for who in ("a", "b"):  # two peers report the source's state alike: vouched, and the tip to reach
        report(me, who, tuple(source.replica.versions()), tips, clock.now())
    return me, next_update


def test_after_its_snapshot_a_newcomer_replays_the_holders_newer_updates():
    me, next_update = newcomer_and_a_source_one_update_behind_the_holder()
    me.transport.logs["old"] = [next_update]
    stats = me.catch_up(me.clock.now(), replay=False)
    assert stats["snapshots"] == 1 and stats["replayed"] == 1, stats
    assert me.replica.version(FRAGMENT) == 2  # the holder's tip, past the source's v1
    assert ("old", FRAGMENT, 1) in me.transport.asked  # asked the holder from the snapshot's version on


def test_a_forged_update_in_the_holders_log_is_refused_and_the_snapshot_stays():
    me, next_update = newcomer_and_a_source_one_update_behind_the_holder()
    forged = bytearray(next_update)
    forged[-1] ^= 1  # the last byte of the payload: the signature no longer holds
    me.transport.logs["old"] = [bytes(forged)]
    stats = me.catch_up(me.clock.now(), replay=False)
    assert stats["snapshots"] == 1 and stats["replayed"] == 0, stats
    assert me.replica.version(FRAGMENT) == 1
    assert sum(me.peer.rejections.values()) >= 1, me.peer.rejections
