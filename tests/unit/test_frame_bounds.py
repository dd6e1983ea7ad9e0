"""Frame size bounds: a run's caps are the exact size of the frames its peers really send, per codec."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import WireConfig
from p2p_diloco.protocol.messages import DeltaHeader, UpdateRecord
from p2p_diloco.swarm.outbox import Outbox
from p2p_diloco.wire import bounds, frames, keys
from p2p_diloco.wire.codecs import codec
from p2p_diloco.wire.frames import FragmentSnapshot
from tests.support.manifests import tiny_manifest, tiny_training

RUN, HASH = "bounds-run", "0123456789abcdef"
SHAPES = {"blocks.0.w": (300, 70), "blocks.0.b": (70,), "emb": (5, 3, 2), "empty": (0, 4)}
CODECS = [
    ("int8", 64, 0.03),
    ("int8", 4096, 0.03),
    ("fp32", 4096, 0.03),
    ("topk-int8", 64, 0.03),
    ("topk-int8", 256, 0.5),
    ("topk-int4", 64, 0.03),
    ("topk-int4", 1024, 1.0),
    ("topk4k-int2", 64, 0.03),
    ("topk4k-int4", 4096, 0.02),
    ("topk4k-int8", 256, 1.0),
]


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


@pytest.mark.parametrize(("name", "block", "density"), CODECS)
def test_a_delta_frame_is_never_longer_than_its_bound_and_the_longest_header_meets_it(name, block, density):
    payload = codec.encode_tensors(tensors(), codec=name, block_size=block, density=density)
    size = codec.frame_size(SHAPES, codec=name, block_size=block, density=density)
    assert len(payload) == size  # the payload's size is exact, sparse codecs included
    bound = frames.delta_frame_bound(RUN, HASH, size)
    longest = DeltaHeader(
        RUN, HASH, frames.MAX_FRAGMENT, *(frames.MAX_COUNTER,) * 4, since_seq=frames.MAX_COUNTER
    )
    assert len(frames.encode_delta(longest, payload)) == bound
    typical = frames.encode_delta(DeltaHeader(RUN, HASH, 1, 7, 4096, 8, 3), payload)
    assert len(typical) <= bound and bound - len(typical) < 80  # only digits of counters apart


@pytest.mark.parametrize(("name", "block", "density"), CODECS)
def test_an_update_frame_fits_its_bound_even_with_the_most_contributors(name, block, density):
    payload = codec.encode_tensors(tensors(1), codec=name, block_size=block, density=density)
    bound = frames.update_frame_bound(codec.frame_size(SHAPES, codec=name, block_size=block, density=density))
    peer = "Qm" + "x" * 44
    many = tuple((f"{peer}{i}", 0.123456789) for i in range(5000))
    record = UpdateRecord(
        RUN, HASH, 3, frames.MAX_COUNTER - 1, frames.MAX_COUNTER, peer, many, "ab" * 32, payload,
        signature=bytes(frames.MAX_SIGNATURE_BYTES),
    )  # fmt: skip
    assert len(frames.encode_update(record)) <= bound
    assert bound - len(payload) <= frames.MAX_HEADER_BYTES + 17  # the header's own cap, no more


def test_a_snapshot_frame_meets_its_bound_with_the_longest_checksum():
    params = codec.encode_tensors(tensors(2), codec="fp32")
    momentum = codec.encode_tensors(tensors(3), codec="fp32")
    size = 2 * codec.frame_size(SHAPES, codec="fp32")
    assert len(params) + len(momentum) == size
    longest = FragmentSnapshot(
        RUN, HASH, frames.MAX_FRAGMENT, frames.MAX_COUNTER, "f" * frames.MAX_ID_CHARS, params, momentum
    )
    bound = frames.snapshot_frame_bound(RUN, HASH, size)
    assert bound - 1 <= len(frames.encode_snapshot(longest)) <= bound  # params_len has one digit less here
    whole = FragmentSnapshot(
        RUN, HASH, frames.MAX_FRAGMENT, frames.MAX_COUNTER, "f" * frames.MAX_ID_CHARS, params + momentum, b""
    )
    assert len(frames.encode_snapshot(whole)) == bound  # all payload in params: the longest params_len


@pytest.mark.parametrize("wire", [WireConfig(), WireConfig(codec="topk-int4", block_size=64, density=0.1)])
def test_run_caps_admit_the_deltas_a_learner_really_sends_and_nothing_larger(wire):
    from p2p_diloco.net.limits import run_frame_caps

    manifest = tiny_manifest("caps", wire=wire)
    training = tiny_training(manifest)
    caps = run_frame_caps(manifest, training.plan, training.shapes)
    routing = Outbox("me", manifest, journal=None, emit=lambda intent: None)  # type: ignore[arg-type]
    sizes = []
    for p in range(training.plan.num_fragments):
        delta = {n: torch.randn(training.shapes[n]) for n in training.plan.names(p)}
        payload, _ = routing.feedback.compress(p, delta)
        header = DeltaHeader(manifest.run_id, manifest.manifest_hash, p, 12, 512, 4, 9)
        if wire.codec.sparse:  # sparse deltas are signed: the cap admits the longest signature
            header = dataclasses.replace(header, signature=b"\xff" * frames.MAX_SIGNATURE_BYTES)
        sizes.append(len(frames.encode_delta(header, payload)))
    assert max(sizes) <= caps.request(keys.OP_DELTA) < max(sizes) + 80
    fp32 = codec.encode_tensors(
        {n: torch.randn(training.shapes[n]) for n in training.plan.names(0)}, codec="fp32"
    )
    if wire.codec != "fp32":  # a frame of another (larger) codec than the run's is over the cap
        assert len(
            frames.encode_delta(DeltaHeader(manifest.run_id, manifest.manifest_hash, 0, 1, 1, 1, 1), fp32)
        ) > (caps.request(keys.OP_DELTA))
    snapshot_item, snapshot_total = caps.reply(keys.OP_FETCH_SNAPSHOT)
    assert snapshot_item == snapshot_total < 4 * 1024 * 1024  # the tiny model's snapshot, not 256 MiB
    assert caps.request("some-new-op") == manifest.wire.max_message_bytes  # a new op gets the run's limit


def test_run_caps_admit_the_snapshots_a_peer_really_serves():
    from p2p_diloco.net.limits import run_frame_caps

    manifest = tiny_manifest("caps")
    training = tiny_training(manifest)
    cap, total = run_frame_caps(manifest, training.plan, training.shapes).reply(keys.OP_FETCH_SNAPSHOT)
    sizes = []
    for p in range(training.plan.num_fragments):  # what `swarm.repair` serves for a snapshot request
        version, params, momentum = training.replica.snapshot(p)
        snapshot = FragmentSnapshot(
            manifest.run_id,
            manifest.manifest_hash,
            p,
            version,
            training.replica.checksum(p),
            codec.encode_tensors(params, codec="fp32"),
            codec.encode_tensors(momentum, codec="fp32"),
        )
        sizes.append(len(frames.encode_snapshot(snapshot)))
    assert max(sizes) <= cap == total < max(sizes) + 200


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("QmZVHrWb1vCDGadLdmBAFSsPGtttfhtQkqT4bMjaswwYhc", True),
        ("node-1.a_b:c", True),
        ("pär-1", True),  # letters of any script, as str.isalnum says
        ("a b", False),
        ("x/y", False),
        ("ab\n", False),
        ("", False),
        ("a" * 129, False),
        (7, False),
    ],
)
def test_an_identifier_holds_letters_digits_and_dash_underscore_dot_colon(value, ok):
    assert (bounds.identifier(value) is None) == ok


@pytest.mark.parametrize(
    "pairs",
    [
        [["node-1", 1.0], ["node-2", 0.5]],  # valid: the bulk check's case
        [["pär-1", 1.0], ["node-2", 0.5]],  # valid, not ASCII: checked pair by pair
        [["a\nb", 1.0], ["c", 1.0]],  # a line break inside an identifier, not between two
        [["a", 1.0], ["", 1.0]],
        [["a", 1.0], ["a", 2.0]],
        [["a", 1.0], ["b", 1]],
        [["a", 1.0], ["b", True]],
        [["a", 1.0], ["b", float("nan")]],
        [["a", 1.0], ["b", float("inf")]],
        [["a", 1.0], ["b", -1.0]],
        [["a", 1.0], ["b/c", 1.0]],
        [["a", 1.0], [7, 1.0]],
        [["a", 1.0], ["b", 1.0, 2.0]],
        [["a", 1.0], ("b", 1.0)],
        [["a" * 129, 1.0]],
    ],
)
def test_a_contributor_list_checked_in_bulk_is_judged_as_pair_by_pair(pairs):
    """`contributor_list` checks a plain list in bulk (issue #40); it must accept exactly what the checks of
    each pair accept, and a refused list still says what is wrong."""
    one_by_one = _pairwise_contributor_problem(pairs)
    found = bounds.contributor_list(pairs)
    assert (found is None) == (one_by_one is None)
    if one_by_one is not None:
        assert found == one_by_one


def _pairwise_contributor_problem(pairs: list) -> str | None:
    """The rule of `contributor_list`, pair by pair (the reference the bulk check must agree with)."""
    seen = set()
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            return "entries must be [peer, weight] pairs"
        peer, weight = pair
        if bounds.identifier(peer) is not None:
            return f"peer {str(peer)[:40]!r} {bounds.identifier(peer)}"
        if type(weight) is not float or not weight >= 0 or weight == float("inf"):
            return f"weight of {peer!r} must be a finite float >= 0"
        if peer in seen:
            return f"peer {peer!r} listed twice"
        seen.add(peer)
    return None
