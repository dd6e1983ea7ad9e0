"""Restarting a peer: when hivemind's identity check runs (`identity_check_needed`), how `PeerNode`
applies it from its state directory, and the bounded DHT teardown (`DhtPeer.shutdown`). No network."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from p2p_diloco.config import RunManifest
from p2p_diloco.net import dht_store
from p2p_diloco.net.dht_store import DhtPeer, identity_check_needed
from p2p_diloco.net.identity import peer_id_of, write_identity
from p2p_diloco.node import assembly, runtime
from p2p_diloco.node.options import NodeOptions
from p2p_diloco.node.state import PEER_STATE_FILE, PeerState

MANIFEST = RunManifest(run_id="unit-restart")


def test_identity_check_skipped_only_for_our_own_predecessor() -> None:
    assert not identity_check_needed("QmA", previous_peer_id="QmA", holds_state_dir=True)
    assert identity_check_needed("QmA", previous_peer_id=None, holds_state_dir=True)  # fresh state dir
    assert identity_check_needed("QmA", previous_peer_id="QmB", holds_state_dir=True)  # another key's dir
    assert identity_check_needed("QmA", previous_peer_id="QmA", holds_state_dir=False)  # lock not held


class StopHere(Exception):
    pass


class FakePending:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self, timeout: float = 0.0) -> None:
        self.aborted = True

    def wait(self):  # noqa: ANN201
        raise AssertionError("start must not wait for the DHT after a failed build")


def _start_until_corpus(tmp_path, monkeypatch, previous: str | None) -> tuple[dict, FakePending]:  # noqa: ANN001
    key = tmp_path / "peer.key"
    write_identity(key)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    if previous is not None:
        state = PeerState(
            run_id=MANIFEST.run_id,
            manifest_hash=MANIFEST.manifest_hash,
            peer_id=peer_id_of(key) if previous == "self" else previous,
            versions=(0,),
            digest="",
            last_in_sync=0.0,
            saved_at=0.0,
        )
        (state_dir / PEER_STATE_FILE).write_text(json.dumps(asdict(state)))
    calls: dict = {}
    pending = FakePending()

    def fake_start_dht(**kwargs):  # noqa: ANN003, ANN202
        calls.update(kwargs)
        return pending

    def fail(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise StopHere

    monkeypatch.setattr(assembly, "start_dht", fake_start_dht)
    monkeypatch.setattr(assembly, "load_corpus", fail)
    node = runtime.PeerNode(
        NodeOptions(manifest=MANIFEST, identity=key, state_dir=state_dir, display="plain")
    )
    with pytest.raises(StopHere):
        node.start()
    node.shutdown()  # releases the state directory; nothing else was started
    return calls, pending


@pytest.mark.parametrize(("previous", "checked"), [("self", False), (None, True), ("QmSomebodyElse", True)])
def test_peer_node_checks_identity_unless_restarting(tmp_path, monkeypatch, previous, checked) -> None:  # noqa: ANN001
    calls, pending = _start_until_corpus(tmp_path, monkeypatch, previous)
    assert calls["check_identity"] is checked
    assert pending.aborted  # the build failed while the DHT was starting: the node is stopped


class FakeDht:
    """A DHT process that ignores the polite shutdown and, if `stubborn`, SIGTERM too."""

    def __init__(self, stubborn: bool) -> None:
        self.alive = True
        self.stubborn = stubborn
        self.calls: list[str] = []
        self.shutdown_timeout = 3.0

    def is_alive(self) -> bool:
        return self.alive

    def shutdown(self) -> None:
        self.calls.append(f"shutdown {self.shutdown_timeout}")

    def terminate(self) -> None:
        self.calls.append("terminate")

    def join(self, timeout: float | None = None) -> None:
        self.calls.append("join")
        if not self.stubborn:
            self.alive = False

    def kill(self) -> None:
        self.calls.append("kill")
        self.alive = False


@pytest.mark.parametrize("stubborn", [False, True])
def test_dht_shutdown_is_bounded(stubborn: bool) -> None:
    dht = FakeDht(stubborn)
    peer = DhtPeer(dht=dht, peer_id="QmA", signer=None, identity_path=None)  # type: ignore[arg-type]
    peer.shutdown(timeout=0.5)
    assert dht.calls[0] == "shutdown 0.5"
    assert ("kill" in dht.calls) is stubborn
    assert not dht.alive
    peer.shutdown()  # idempotent once the process is gone
    assert dht.calls.count("shutdown 0.5") == 1


def test_dht_shutdown_survives_a_closed_pipe() -> None:
    dht = FakeDht(stubborn=False)

    def broken() -> None:
        raise OSError("handle is closed")

    dht.shutdown = broken  # type: ignore[method-assign]
    dht_store._stop_dht(dht, 1.0)  # type: ignore[arg-type]
    assert dht.calls[0] == "terminate" and not dht.alive
