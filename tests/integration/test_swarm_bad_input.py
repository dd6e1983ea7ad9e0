"""Bad input at the wire against a live `join` process: every class is answered with its reason, counted
per reason and per sender in the peer's heartbeat (what `status` shows), and training goes on.

The attacker is the test process: a DHT peer with a `P2PTransport` of the same run, so its frames reach
the peer's real handlers over a real libp2p stream. The lone peer holds the synchronizer lease, so it
answers deltas as the synchronizer would.
"""

from __future__ import annotations

import signal

import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.net.dht_store import DhtKeyValueStore
from p2p_diloco.net.identity import write_identity
from p2p_diloco.net.transport import P2PTransport
from p2p_diloco.node.status import swarm_status
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.frames import encode_delta, encode_update
from p2p_diloco.wire.keys import OP_DELTA, OP_UPDATE
from tests.support.snapshots import fetch_fragment_state

pytestmark = [pytest.mark.integration, pytest.mark.soak]

MANIFEST = """
run_id = "badinput"
[diloco]
inner_steps = 8
fragments = 2
max_staleness = 2
[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
[wire]
max_message_bytes = 1048576
norm_bound = 100.0
[timing]
heartbeat_period = 0.5
heartbeat_ttl = 2.0
lease_ttl = 3.0
claim_grace = 1.0
[robust]
# This file checks the validation every handler does on its own. The robust screen (direction, norm
# history, cool-downs) would answer first, e.g. "cool-down" after the attacker's fifth rejection; it has
# its own tests (tests/unit/test_robust.py, tests/sim/test_byzantine.py).
enabled = false
"""


@pytest.fixture
def lone_peer(spawn, cli, wait_for, start_bootstrap, dht_peers, tmp_path):
    """(manifest, peer id, attacker transport, observer kv, process) with one training `join` process."""
    bootstrap = start_bootstrap()
    path = tmp_path / "run.toml"
    path.write_text(MANIFEST)
    manifest = RunManifest.load(path)
    key = tmp_path / "peer.key"
    peer_id = write_identity(key)
    handle = spawn(cli("join", str(path), "--initial-peers", *bootstrap.addresses, "--identity", str(key),
              "--state-dir", str(tmp_path / "state"), "--listen", "/ip4/127.0.0.1/tcp/0",
              "--min-step-time", "0.05"))  # fmt: skip
    attacker = dht_peers(initial_peers=bootstrap.addresses)
    transport = P2PTransport(
        attacker.dht,
        run_id=manifest.run_id,
        manifest_hash=manifest.manifest_hash,
        send_timeout=20,
        fetch_timeout=20,
    )
    yield manifest, peer_id, transport, DhtKeyValueStore(attacker, timeout=5), handle
    transport.close()


def test_eight_plus_classes_of_bad_input_are_rejected_with_reasons_while_training_goes_on(
    lone_peer, wait_for
):
    manifest, target, transport, kv, _ = lone_peer

    def me(status: dict) -> dict | None:
        return next((p for p in status["peers"] if p["peer_id"] == target), None)

    def status() -> dict:
        try:
            return swarm_status(kv, manifest, get_dht_time())
        except TimeoutError:
            return {"peers": [], "synchronizer": None}

    # the lone peer holds the lease and is past max_staleness, so stale anchors exist
    ready = wait_for(
        lambda: (s := status())["synchronizer"] and s["synchronizer"]["peer_id"] == target
        and (p := me(s)) and min(p["versions"]) >= 4 and s,
        90, "the peer to hold the lease and reach v4",
    )  # fmt: skip
    versions_before = me(ready)["versions"]

    model = build_model(manifest.model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = plan_fragments(list(shapes.items()), 2)
    good = {n: torch.full(shapes[n], 1e-4) for n in plan.names(0)}

    def delta(payload: bytes, **change) -> bytes:
        fields = dict(run_id=manifest.run_id, manifest_hash=manifest.manifest_hash, fragment=0,
                      anchor_version=versions_before[0], tokens=256, steps=1, seq=1)  # fmt: skip
        fields.update(change)
        return encode_delta(DeltaHeader(**fields), payload)

    int8 = encode_tensors(good, codec="int8", block_size=manifest.wire.block_size)
    wrong_shape = {n: torch.zeros(3) for n in plan.names(0)}
    nan = {n: torch.full(shapes[n], float("nan")) for n in plan.names(0)}
    huge = {n: torch.full(shapes[n], 1e3) for n in plan.names(0)}
    cases = {
        "bad magic": b"NOPE" + bytes(60),
        "truncated": delta(int8)[:-10],
        "wrong run": delta(int8, run_id="another-run"),
        "wrong manifest": delta(int8, manifest_hash="0123456789abcdef"),
        "unknown fragment": delta(int8, fragment=7),
        "wrong shape": delta(encode_tensors(wrong_shape, codec="fp32")),
        # the run's codec: a frame is capped at the exact size of the fragment's frame under it (net.limits)
        "non-finite": delta(encode_tensors(nan, codec="int8", block_size=manifest.wire.block_size)),
        "norm bound": delta(encode_tensors(huge, codec="int8", block_size=manifest.wire.block_size)),
        "stale anchor": delta(int8, anchor_version=0),
        "frame too large": bytes(2 * manifest.wire.max_message_bytes),
    }
    for tag, frame in cases.items():
        reason = str(transport.send_and_wait(OP_DELTA, target, frame, timeout=20))
        if tag == "frame too large" and reason.startswith("transport unreachable"):
            # P2PTransport race: the receiver's early rejection can lose to the stream reset while the
            # sender is still writing (net/transport.py); the receiver's counter is checked below
            continue
        assert reason.startswith(tag), f"{tag}: got {reason!r}"

    lower_term = UpdateRecord(
        run_id=manifest.run_id, manifest_hash=manifest.manifest_hash, fragment=0, from_version=versions_before[0],
        term=0, leader=transport.peer_id, contributors=((transport.peer_id, 1.0),), checksum="00" * 32,
        payload=int8,
    )  # fmt: skip
    reason = str(transport.send_and_wait(OP_UPDATE, target, encode_update(lower_term), timeout=20))
    assert reason.startswith("lower term"), reason
    assert transport.fetch_snapshot(target, 9) == b""  # unknown fragment: nothing, a counted rejection
    assert transport.fetch_snapshot(target, 1)  # and the peer keeps serving

    counted = set(cases) | {"lower term", "unknown fragment"}
    after = wait_for(
        lambda: (p := me(status())) and counted <= set(p["rejections"]) and min(p["versions"]) > max(versions_before)
        and p,
        30, "every rejection counted in the heartbeat while versions keep advancing",
    )  # fmt: skip
    by_sender = {(sender, tag) for sender, tag, _ in after["rejections_by_sender"]}
    assert (transport.peer_id, "stale anchor") in by_sender and (transport.peer_id, "norm bound") in by_sender
    assert after["tokens_per_s"] > 0


@pytest.mark.slow
def test_a_correctly_checksummed_update_from_a_peer_without_the_lease_is_refused(lone_peer, wait_for):
    """Everything an attacker needs is public: the snapshot (served to anyone) and the current term."""
    manifest, target, transport, kv, handle = lone_peer
    ready = wait_for(
        lambda: (s := swarm_status(kv, manifest, get_dht_time()))["synchronizer"] and s["peers"] and s,
        90, "the peer to hold the lease",
    )  # fmt: skip
    handle.signal(signal.SIGUSR1)  # stop training: the fragment's version then stays put while we forge
    wait_for(
        lambda: (s := swarm_status(kv, manifest, get_dht_time()))["peers"] and s["peers"][0]["tokens_per_s"] == 0,
        30, "the peer to stop training",
    )  # fmt: skip
    term = ready["synchronizer"]["term"]
    model = build_model(manifest.model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = plan_fragments(list(shapes.items()), 2)
    fragment_shapes = {n: shapes[n] for n in plan.names(0)}
    payload = encode_tensors({n: torch.full(s, 5.0) for n, s in fragment_shapes.items()}, codec="int8")
    replies = []
    for _ in range(10):  # the fragment moves on while we compute: retry on "duplicate update"
        # the peer's exact fragment, streamed as a newcomer gets it: index, then chunks checked by digest
        version, checksum, params, momentum = fetch_fragment_state(transport, target, 0, fragment_shapes)
        replica = GlobalReplica(
            plan, {**{n: p.detach().clone() for n, p in model.named_parameters()}, **params}
        )
        assert replica.load_fragment(0, version, params, momentum, checksum).action == "load"
        grad = decode_tensors(payload, expected_shapes=fragment_shapes, max_bytes=1 << 24)
        pending = replica.compute_update(
            0, grad, lr=manifest.diloco.outer_lr, momentum=manifest.diloco.outer_momentum
        )
        record = UpdateRecord(
            run_id=manifest.run_id, manifest_hash=manifest.manifest_hash, fragment=0, from_version=version,
            term=term, leader=transport.peer_id, contributors=((transport.peer_id, 1.0),),
            checksum=pending.checksum, payload=payload,
        )  # fmt: skip
        replies.append(str(transport.send_and_wait(OP_UPDATE, target, encode_update(record), timeout=20)))
        if not replies[-1].startswith("duplicate update"):
            break
    assert not replies[-1].startswith("applied"), replies
