"""The real peer's local pieces: lock guard, state directory, extended heartbeat records, join arguments."""

from __future__ import annotations

import concurrent.futures
import json
from types import SimpleNamespace

import pytest
import torch

from p2p_diloco.cli import build_parser
from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.assembly import with_known_peers
from p2p_diloco.node.guard import REJECT_HANDLER_ERROR, REJECT_NOT_READY, HandlerSlot, ServeRefused
from p2p_diloco.node.join import options_from_args
from p2p_diloco.node.options import check_device
from p2p_diloco.node.state import StateDir, read_events
from p2p_diloco.node.threads import ThreadedDriver
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import DeltaHeader
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm import effects as fx
from p2p_diloco.wire.frames import encode_delta
from p2p_diloco.wire.records import HeartbeatInfo, RecordError, decode_heartbeat
from p2p_diloco.wire.replies import Reply, ReplyStatus
from tests.support.peers import AnsweringPeer

MANIFEST = RunManifest(run_id="unit-node")


class FakeDriver:
    """Answers like a driver: deltas at once, updates through a future (as the owner thread does)."""

    def handle_delta(self, sender: str, frame: bytes) -> Reply:
        if frame == b"boom":
            raise RuntimeError("bug")
        return Reply(ReplyStatus.ACCEPTED, "accepted")

    def handle_update(self, sender: str, frame: bytes) -> concurrent.futures.Future:
        answer: concurrent.futures.Future = concurrent.futures.Future()
        answer.set_result(Reply(ReplyStatus.APPLIED, "applied: fragment 0 v0 -> v1"))
        return answer

    def serve_updates(self, requester: str, fragment: int, after_version: int) -> list[bytes]:
        return [b"u"]

    def serve_snapshot(self, requester: str, fragment: int) -> bytes:
        raise ValueError("no such fragment")


def test_handler_slot_answers_with_reasons_and_never_raises_from_handle():
    slot = HandlerSlot()
    before = slot.handle_delta("a", b"x")
    assert before.status is ReplyStatus.TRANSIENT and before.tag == REJECT_NOT_READY  # before attach
    slot.attach(FakeDriver())
    assert slot.handle_delta("a", b"x").status is ReplyStatus.ACCEPTED
    reply = slot.handle_delta("a", b"boom")
    assert reply.tag == REJECT_HANDLER_ERROR and "RuntimeError: bug" in reply.reason
    assert slot.handle_update("s", b"f").result(timeout=1).status is ReplyStatus.APPLIED
    assert slot.serve_updates("r", 0, 0) == [b"u"]
    with pytest.raises(ServeRefused, match="ValueError: no such fragment"):
        slot.serve_snapshot("r", 0)
    slot.detach()
    assert slot.handle_update("s", b"f").tag == REJECT_NOT_READY
    assert slot.serve_updates("r", 0, 0) == []  # the requester asks another peer
    assert slot.rejections == {REJECT_NOT_READY: 3, REJECT_HANDLER_ERROR: 2}


DELTA_FIELDS = {"run_id": "r", "manifest_hash": "0123456789abcdef", "anchor_version": 0, "tokens": 8,
                "steps": 1, "seq": 1}  # fmt: skip


class Clock:
    t = 100.0

    def now(self) -> float:
        return self.t


def test_the_driver_notes_accepted_deltas_and_the_first_one_per_term():
    peer, clock = AnsweringPeer(sync_term=4), Clock()
    driver = ThreadedDriver(peer, kv=None, transport=None, clock=clock, bind=False)

    def arrive(reply: Reply) -> concurrent.futures.Future:
        peer.replies.append(reply)
        answer: concurrent.futures.Future = concurrent.futures.Future()
        driver.process(fx.DeltaArrived("a", b"x", answer, clock.now()))
        return answer

    assert arrive(Reply(ReplyStatus.REFUSED, "stale anchor: v1")).result(0).status is ReplyStatus.REFUSED
    arrive(Reply(ReplyStatus.ACCEPTED, "accepted"))
    assert driver.accepts.count == 1 and driver.accepts.first_accepts() == ((4, 100.0, 0),)
    peer.sync.term, clock.t = 5, 130.0
    arrive(Reply(ReplyStatus.ACCEPTED, "accepted"))
    clock.t = 140.0
    arrive(Reply(ReplyStatus.ACCEPTED, "replaced"))
    assert driver.accepts.count == 3 and driver.accepts.first_accepts() == ((4, 100.0, 0), (5, 130.0, 0))
    peer.sync = None  # no longer the synchronizer: counted under the highest term seen
    arrive(Reply(ReplyStatus.ACCEPTED, "accepted"))
    assert [term for term, _, _ in driver.accepts.first_accepts()] == [4, 5, 9]
    for term in range(10, 20):  # only the last few terms are kept
        driver.accepts.note(term, 1.0)
    assert [term for term, _, _ in driver.accepts.first_accepts()] == list(range(12, 20))
    driver.stop(timeout=1.0)


def test_accepted_deltas_count_under_their_fragments_shard_and_its_term():
    """S = 2: shard 1's term 4 is not shard 0's term 4 (terms are numbered per shard), so an accept in one
    never hides the other's first; a delta goes to the seat of its fragment's shard (fragment mod S)."""
    peer, clock = AnsweringPeer(sync_term=4), Clock()
    peer.seats.append(SimpleNamespace(shard=1, sync=SimpleNamespace(term=4), membership=SimpleNamespace()))
    driver = ThreadedDriver(peer, kv=None, transport=None, clock=clock, bind=False)

    def arrive(fragment: int) -> None:
        peer.replies.append(Reply(ReplyStatus.ACCEPTED, "accepted"))
        frame = encode_delta(DeltaHeader(fragment=fragment, **DELTA_FIELDS), b"payload")
        driver.process(fx.DeltaArrived("a", frame, concurrent.futures.Future(), clock.now()))

    arrive(1)  # shard 1
    clock.t = 120.0
    arrive(0)  # shard 0, same term number, later
    arrive(3)  # shard 1 again: not a first
    assert driver.accepts.first_accepts() == ((4, 120.0, 0), (4, 100.0, 1))
    assert driver.accepts.count == 3
    driver.stop(timeout=1.0)


def test_state_dir_round_trip_lock_and_foreign_manifest(tmp_path):
    plan = plan_fragments([("a", (4,)), ("b", (3,))], 2)
    replica = GlobalReplica(plan, {"a": torch.ones(4), "b": torch.zeros(3)})
    state = StateDir(tmp_path, MANIFEST)
    assert state.read_peer_state() is None and state.load_replica(plan) is None
    with pytest.raises(ConfigError, match="in use by another running peer"):
        StateDir(tmp_path, MANIFEST)
    with pytest.raises(
        ConfigError, match="in use by another running peer"
    ):  # a hot spare waits, then gives up
        StateDir(tmp_path, MANIFEST, lock_wait=0.1)
    state.save(replica, "QmPeer", now=100.0, in_sync=True, previous=0.0)
    state.save(replica, "QmPeer", now=130.0, in_sync=False, previous=100.0)
    state.event("note", t=1.0, line="hello")
    saved = state.read_peer_state()
    assert (saved.last_in_sync, saved.saved_at, saved.versions) == (100.0, 130.0, (0, 0))
    assert state.load_replica(plan).digest() == replica.digest()
    state.close()
    assert read_events(tmp_path) == [{"t": 1.0, "event": "note", "line": "hello"}]
    with pytest.raises(ConfigError, match="belongs to run 'unit-node'"):
        StateDir(tmp_path, RunManifest(run_id="other")).read_peer_state()


def test_heartbeat_status_fields_round_trip_and_are_schema_checked():
    info = HeartbeatInfo(
        role="learner",
        may_sync=True,
        reachable=True,
        versions=(1, 2),
        tokens=512,
        updates_applied=3,
        last_contribution=12.5,
        rejections=(("stale anchor", 2),),
        rejections_by_sender=(("QmA", "stale anchor", 2),),
        decisions=("election: follow",),
    )
    assert decode_heartbeat(info.to_bytes(), 2) == info
    for change in (
        {"rejections": [["tag", -1]]},
        {"rejections": [["tag"]]},
        {"rejections_by_sender": [["a", "b", "c"]]},
        {"decisions": ["x" * 1000]},
        {"decisions": ["a"] * 50},
    ):
        d = json.loads(info.to_bytes())
        d.update(change)
        with pytest.raises(RecordError):
            decode_heartbeat(json.dumps(d).encode(), 2)


def _join_args(tmp_path, *extra: str):
    manifest = tmp_path / "run.toml"
    manifest.write_text('run_id = "t"\n')
    key = tmp_path / "peer.key"
    from p2p_diloco.net.identity import write_identity

    if not key.exists():
        write_identity(key)
    argv = ["join", str(manifest), "--identity", str(key), "--state-dir", str(tmp_path / "s"), *extra]
    return build_parser().parse_args(argv)


def test_join_refuses_bad_addresses_naming_the_bad_part(tmp_path):
    good = "/ip4/127.0.0.1/tcp/5/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    options = options_from_args(
        _join_args(tmp_path, "--initial-peers", good, "--no-sync", "--max-steps", "3")
    )
    assert options.initial_peers == (good,) and not options.may_sync and options.max_steps == 3
    with pytest.raises(ConfigError, match=r"--initial-peers.*invalid IPv4 address '1\.2\.3'"):
        options_from_args(_join_args(tmp_path, "--initial-peers", "/ip4/1.2.3/tcp/5/p2p/x"))
    with pytest.raises(ConfigError, match=r"--listen.*invalid tcp port '99999'"):
        options_from_args(_join_args(tmp_path, "--listen", "/ip4/127.0.0.1/tcp/99999"))
    with pytest.raises(ConfigError, match="--threads"):
        options_from_args(_join_args(tmp_path, "--threads", "0"))
    with pytest.raises(ConfigError, match="--train-nice must be 0 .off. to 19, got 25"):
        options_from_args(_join_args(tmp_path, "--train-nice", "25"))
    assert options_from_args(_join_args(tmp_path)).train_nice == 5


def test_device_check_names_the_problem():
    check_device("cpu")
    with pytest.raises(ConfigError, match="--device must be"):
        check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            check_device("cuda")


def test_event_log_rotates_past_its_size_cap(tmp_path, monkeypatch):
    import p2p_diloco.node.state as state_module

    monkeypatch.setattr(state_module, "MAX_EVENTS_BYTES", 200)
    state = StateDir(tmp_path, MANIFEST)
    for i in range(10):
        state.event("note", t=float(i), line="x" * 40)
    state.close()
    current = read_events(tmp_path)
    previous = [json.loads(line) for line in (tmp_path / "events.jsonl.1").read_text().splitlines()]
    assert current and previous and current[-1]["t"] == 9.0
    assert (tmp_path / "events.jsonl").stat().st_size <= 200
    assert [e["t"] for e in previous + current] == [
        float(i) for i in range(10 - len(previous) - len(current), 10)
    ]


def test_seconds_since_launch_counts_from_the_process_start():
    from p2p_diloco.node.reporting import seconds_since_launch

    first = seconds_since_launch()
    assert first is not None and first > 0  # this process imported torch before getting here
    ticks = []
    while not ticks or ticks[-1] == first:  # /proc counts in clock ticks: wait for the next one
        ticks.append(seconds_since_launch())
    assert ticks[-1] > first


def test_a_restart_dials_the_peers_it_knew_besides_the_bootstrap(tmp_path):
    """Saved with the replica: other live peers' addresses. A restart while the bootstrap node is down,
    or after it restarted with an empty routing table, still reaches the swarm through them."""
    own, other, third = (write_identity(tmp_path / f"{n}.key") for n in ("own", "other", "third"))
    boot = f"/ip4/127.0.0.1/tcp/4000/p2p/{third}"
    known = (
        f"/ip4/127.0.0.1/tcp/4001/p2p/{other}",
        f"/ip4/127.0.0.1/tcp/4002/p2p/{own}",  # this peer itself: skipped
        "garbage",  # unparsable: skipped
        boot,  # already configured
    )
    assert with_known_peers((boot,), known, own) == (boot, known[0])
    plan = plan_fragments([("a", (4,))], 1)
    state = StateDir(tmp_path / "state", MANIFEST)
    replica = GlobalReplica(plan, {"a": torch.ones(4)})
    state.save(
        replica,
        own,
        now=1.0,
        in_sync=True,
        previous=0.0,
        known_peers=known,
        term_seen=25,
        shard_terms=(25, 7),
    )
    saved = state.read_peer_state()
    assert saved.known_peers == known and saved.term_seen == 25  # a restart keeps its term floor
    assert saved.shard_terms == (25, 7)  # ... of every synchronizer shard
    state.close()
    old = json.loads((tmp_path / "state" / "peer_state.json").read_text())
    del old["known_peers"], old["shard_terms"]  # written before peers and shard terms were remembered
    (tmp_path / "state" / "peer_state.json").write_text(json.dumps(old))
    restored = StateDir(tmp_path / "state", MANIFEST).read_peer_state()
    assert restored.known_peers == () and restored.shard_terms == () and restored.term_seen == 25
