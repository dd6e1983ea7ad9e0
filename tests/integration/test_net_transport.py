"""P2PTransport between two real peers: large frames stream through, caps and failures answer a reason."""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading

import pytest

from p2p_diloco.net.transport import (
    REJECT_HANDLER_ERROR,
    REJECT_TOO_LARGE,
    P2PTransport,
    RemoteRejected,
)
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.wire.keys import OP_DELTA, OP_UPDATE
from p2p_diloco.wire.replies import Reply, ReplyStatus

pytestmark = pytest.mark.integration

RUN, MANIFEST = "transport-test", "0123456789abcdef"
MiB = 1 << 20
FRAME_CAP = 16 * MiB


class RecordingHandlers:
    """Inbound side for tests: records what arrived, serves fixed updates and a 10 MiB snapshot."""

    def __init__(self) -> None:
        self.deltas: list[tuple[str, str, int]] = []  # (sender, sha256, size)
        self.snapshot = bytes(range(256)) * (10 * MiB // 256)

    def handle_delta(self, sender: str, frame: bytes) -> Reply:
        self.deltas.append((sender, hashlib.sha256(frame).hexdigest(), len(frame)))
        return Reply(ReplyStatus.ACCEPTED, "accepted")

    def handle_update(self, sender: str, frame: bytes) -> Reply | concurrent.futures.Future:
        if frame == b"crash":
            raise RuntimeError("handler bug triggered by this frame")
        if frame == b"later":  # answered by another thread after a while, as a peer's owner thread does
            answer: concurrent.futures.Future = concurrent.futures.Future()
            threading.Timer(
                0.5, lambda: answer.set_result(Reply(ReplyStatus.APPLIED, "applied: later"))
            ).start()
            return answer
        if frame == b"never":
            return concurrent.futures.Future()
        if frame.startswith(b"update"):
            return Reply(ReplyStatus.ACCEPTED, "accepted")
        return Reply.refused("stale update", "not from this run")

    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
        return [f"update {fragment}:{v}".encode() for v in range(after_version + 1, after_version + 4)]

    def serve_snapshot(self, requester: str, fragment: int) -> bytes:
        return self.snapshot


@pytest.fixture(scope="module")
def pair_peers(module_dht_peers):
    server_peer = module_dht_peers()
    client_peer = module_dht_peers(initial_peers=server_peer.visible_addresses())
    return server_peer, client_peer


@pytest.fixture(scope="module")
def pair(pair_peers):
    """(server transport, its handlers, client transport); the server caps frames at 16 MiB."""
    server_peer, client_peer = pair_peers
    handlers = RecordingHandlers()
    common = dict(run_id=RUN, manifest_hash=MANIFEST, fetch_timeout=20, send_timeout=20)
    server = P2PTransport(
        server_peer.dht, handlers=handlers, max_frame_bytes=FRAME_CAP, answer_timeout=3.0, **common
    )
    client = P2PTransport(client_peer.dht, handlers=RecordingHandlers(), max_frame_bytes=64 * MiB, **common)
    yield server, handlers, client
    client.close()
    server.close()


def test_10_mib_delta_arrives_intact_with_the_sender_from_the_connection(pair, wait_for):
    server, handlers, client = pair
    frame = hashlib.sha256(b"seed").digest() * (10 * MiB // 32)
    sent, received = client.counts.bytes_sent, server.counts.bytes_received
    assert str(client.send_and_wait(OP_DELTA, server.peer_id, frame)) == "accepted"
    assert handlers.deltas[-1] == (client.peer_id, hashlib.sha256(frame).hexdigest(), 10 * MiB)
    # counted on each side's loop thread as the bytes moved; read here as immutable snapshots
    wait_for(lambda: client.counts.bytes_sent - sent == len(frame), 10, "the client to count the frame sent")
    wait_for(lambda: server.counts.bytes_received - received == len(frame), 10, "the server to count it")
    assert client.counts.bytes_received > 0 and server.counts.served[OP_DELTA] >= 1


@pytest.mark.soak
def test_fetches_round_trip(pair):
    server, handlers, client = pair
    assert client.fetch_updates(server.peer_id, 2, 7) == [b"update 2:8", b"update 2:9", b"update 2:10"]
    assert client.fetch_snapshot(server.peer_id, 0) == handlers.snapshot


@pytest.mark.soak
def test_oversized_frame_is_rejected_with_a_reason_and_the_peer_keeps_serving(pair):
    server, handlers, client = pair
    before = len(handlers.deltas)
    reason = str(client.send_and_wait(OP_DELTA, server.peer_id, bytes(FRAME_CAP + 1)))
    assert reason.startswith(REJECT_TOO_LARGE), reason
    assert str(FRAME_CAP + 1) in reason and str(FRAME_CAP) in reason
    assert len(handlers.deltas) == before  # the handler never saw it
    assert server.rejected[REJECT_TOO_LARGE] >= 1
    assert str(client.send_and_wait(OP_DELTA, server.peer_id, b"small")) == "accepted"


@pytest.mark.soak
def test_a_raising_handler_answers_handler_error_and_the_peer_keeps_serving(pair):
    server, _, client = pair
    reason = str(client.send_and_wait(OP_UPDATE, server.peer_id, b"crash"))
    assert reason.startswith(REJECT_HANDLER_ERROR) and "RuntimeError" in reason
    assert str(client.send_and_wait(OP_UPDATE, server.peer_id, b"junk")) == "stale update: not from this run"
    assert client.fetch_updates(server.peer_id, 0, 0)  # still serving


@pytest.mark.soak
def test_background_send_reports_the_reply_through_on_reply(pair):
    server, handlers, client = pair
    replies: list[Reply] = []
    arrived = threading.Event()

    def on_reply(reply: Reply) -> None:
        replies.append(reply)
        arrived.set()

    client.send_delta(server.peer_id, b"background delta", on_reply=on_reply)
    assert arrived.wait(timeout=20), "no on_reply within 20 s"
    assert replies == [Reply(ReplyStatus.ACCEPTED, "accepted")]
    assert client.flush(timeout=5)
    assert handlers.deltas[-1][2] == len(b"background delta")


@pytest.mark.soak
def test_a_handler_may_answer_later_through_a_future_and_a_silent_one_is_answered_busy(pair):
    server, _, client = pair
    later = client.send_and_wait(OP_UPDATE, server.peer_id, b"later")
    assert later == Reply(ReplyStatus.APPLIED, "applied: later")
    silent = client.send_and_wait(OP_UPDATE, server.peer_id, b"never")
    assert silent.status is ReplyStatus.TRANSIENT and silent.tag == "busy", silent
    assert str(client.send_and_wait(OP_UPDATE, server.peer_id, b"update 1")) == "accepted"  # still serving


@pytest.mark.soak
def test_a_send_to_itself_is_delivered_locally(pair):
    _, _, client = pair
    assert str(client.send_and_wait(OP_DELTA, client.peer_id, b"to myself")) == "accepted"


@pytest.mark.soak
def test_unreachable_peer_raises_a_clear_error(module_dht_peers):
    lonely = module_dht_peers()
    with P2PTransport(lonely.dht, run_id=RUN, manifest_hash=MANIFEST, fetch_timeout=5) as transport:
        absent = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
        with pytest.raises((ConnectionError, TimeoutError), match=absent):
            transport.fetch_snapshot(absent, 0)
        reason = str(transport.send_and_wait(OP_DELTA, absent, b"x", timeout=5))
        assert reason.startswith(("transport unreachable", "transport timeout")), reason


@pytest.mark.soak
def test_peers_off_the_allowlist_and_other_runs_are_refused(pair_peers):
    server_peer, client_peer = pair_peers
    private = dict(run_id="private-run", manifest_hash=MANIFEST, fetch_timeout=10)
    server = P2PTransport(
        server_peer.dht, handlers=RecordingHandlers(), allowed_peers={server_peer.peer_id}, **private
    )
    client = P2PTransport(client_peer.dht, **private)
    stranger = P2PTransport(client_peer.dht, run_id="no-such-run", manifest_hash=MANIFEST, fetch_timeout=10)
    try:
        with pytest.raises(RemoteRejected) as refused:
            client.fetch_updates(server.peer_id, 0, 0)
        assert refused.value.reason.startswith(AdmissionTag.NOT_ALLOWED)
        assert str(client.send_and_wait(OP_DELTA, server.peer_id, b"d")).startswith(AdmissionTag.NOT_ALLOWED)
        with pytest.raises(ConnectionError, match="cannot open"):  # nobody serves that run's protocol
            stranger.fetch_updates(server.peer_id, 0, 0)
    finally:
        for transport in (stranger, client, server):
            transport.close()
