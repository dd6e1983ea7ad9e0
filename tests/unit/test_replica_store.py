"""The replica on disk as safetensors (node/replica_store.py): round trip bit for bit, only changed fragments
written, crash safety (a write killed midway leaves the old file), and clear refusals of bad files."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from p2p_diloco.node import replica_store
from p2p_diloco.node.replica_store import (
    FILE_FORMAT,
    ReplicaFileError,
    ReplicaStore,
    fragment_file,
    load_replica,
    save_replica,
)
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.replica import GlobalReplica, ReplicaTag

LR, MU = 0.7, 0.9
PLAN = FragmentPlan(fragments=(("emb", "head.b"), ("blocks.0.w",)))
SHAPES = {"emb": (5, 3), "head.b": (3,), "blocks.0.w": (4, 4)}


def initial() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def step(replica: GlobalReplica, fragment: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)
    grad = {n: torch.randn(SHAPES[n], generator=gen) * 0.1 for n in PLAN.names(fragment)}
    version = replica.version(fragment)
    assert (
        replica.apply(fragment, version, grad, lr=LR, momentum=MU, expected_checksum=None).action == "apply"
    )


def assert_identical(a: GlobalReplica, b: GlobalReplica) -> None:
    assert a.digest() == b.digest() and a.versions() == b.versions()
    for p in range(PLAN.num_fragments):
        _, pa, ma = a.fragment_state(p)
        _, pb, mb = b.fragment_state(p)
        for n in pa:
            assert torch.equal(pa[n].view(torch.int32), pb[n].view(torch.int32))
            assert torch.equal(ma[n].view(torch.int32), mb[n].view(torch.int32))


def test_safetensors_round_trip_bit_for_bit_without_pickle(tmp_path) -> None:
    replica = GlobalReplica(PLAN, initial())
    for seed in range(3):
        step(replica, 0, seed)
    step(replica, 1, 7)
    directory = tmp_path / "replica"
    assert save_replica(replica, directory) == 2
    assert sorted(f.name for f in directory.iterdir()) == [
        "fragment-00000.safetensors",
        "fragment-00001.safetensors",
    ]
    for p in range(2):  # plain safetensors: no pickle anywhere, metadata says what it is
        raw = fragment_file(directory, p).read_bytes()
        assert raw[:1] != b"\x80" and raw[:2] != b"PK" and b"torch._utils" not in raw  # no pickle, no zip
        with safe_open(str(fragment_file(directory, p)), framework="pt") as f:
            meta = f.metadata()
            assert meta["format"] == FILE_FORMAT and int(meta["version"]) == replica.version(p)
            assert meta["checksum"] == replica.checksum(p)
            assert json.loads(meta["names"]) == list(PLAN.names(p))
    loaded = load_replica(directory, PLAN)
    assert loaded.versions() == (3, 1)
    assert_identical(replica, loaded)
    step(loaded, 0, 3)  # the loaded replica keeps going like the original
    step(replica, 0, 3)
    assert_identical(replica, loaded)


def test_only_changed_fragments_are_written(tmp_path) -> None:
    replica = GlobalReplica(PLAN, initial())
    store = ReplicaStore(tmp_path / "replica")
    assert store.save(replica) == 2
    assert store.save(replica) == 0
    mtime = os.stat(fragment_file(store.directory, 1)).st_mtime_ns
    step(replica, 0, 0)
    assert store.save(replica) == 1
    assert os.stat(fragment_file(store.directory, 1)).st_mtime_ns == mtime
    # a new store (a restarted peer) reads what is on disk and writes nothing new either
    again = ReplicaStore(tmp_path / "replica")
    assert again.save(replica) == 0
    assert_identical(again.load(PLAN), replica)


def test_a_write_killed_midway_leaves_the_previous_file_and_no_debris(tmp_path, monkeypatch) -> None:
    replica = GlobalReplica(PLAN, initial())
    store = ReplicaStore(tmp_path / "replica")
    store.save(replica)
    before = replica.frozen()
    step(replica, 0, 0)
    step(replica, 1, 1)

    real_fsync = os.fsync
    calls = {"n": 0}

    def dying_fsync(fd: int) -> None:  # the machine dies while fragment 1 is being written
        calls["n"] += 1
        if calls["n"] == 2:  # fragment 0's file was fsynced, fragment 1's is next
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(replica_store.os, "fsync", dying_fsync)
    with pytest.raises(OSError):
        store.save(replica)
    monkeypatch.setattr(replica_store.os, "fsync", real_fsync)
    assert sorted(f.name for f in store.directory.iterdir()) == [
        "fragment-00000.safetensors",
        "fragment-00001.safetensors",
    ]
    loaded = load_replica(store.directory, PLAN)  # fragment 0 new, fragment 1 old: both whole and valid
    assert loaded.versions() == (1, 0)
    assert loaded.checksum(0) == replica.checksum(0) and loaded.checksum(1) == before.checksum(1)
    assert store.save(replica) == 1  # the next save finishes the job
    assert_identical(load_replica(store.directory, PLAN), replica)


def test_bad_files_are_refused_with_the_reason(tmp_path) -> None:
    replica = GlobalReplica(PLAN, initial())
    step(replica, 0, 0)
    directory = tmp_path / "replica"
    save_replica(replica, directory)
    with pytest.raises(ReplicaFileError, match="different fragment plan"):
        load_replica(directory, FragmentPlan(fragments=(("emb",), ("head.b", "blocks.0.w"))))
    with pytest.raises(ReplicaFileError, match="different fragment plan"):
        load_replica(directory, FragmentPlan(fragments=(("emb", "head.b"),)))
    with pytest.raises(ReplicaFileError, match="does not exist"):
        load_replica(tmp_path / "missing", PLAN)

    file = fragment_file(directory, 0)
    good = file.read_bytes()
    file.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ReplicaFileError, match="unreadable"):
        load_replica(directory, PLAN)
    rotten = bytearray(good)
    rotten[-5] ^= 0x01  # one flipped bit in the momentum of the last tensor
    file.write_bytes(bytes(rotten))
    with pytest.raises(ReplicaFileError, match=ReplicaTag.CHECKSUM_MISMATCH):
        load_replica(directory, PLAN)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(file), metadata={"format": "something else"})
    with pytest.raises(ReplicaFileError, match="not a p2p_diloco replica"):
        load_replica(directory, PLAN)
    fragment_file(directory, 0).unlink()
    with pytest.raises(ReplicaFileError, match="does not exist"):
        load_replica(directory, PLAN)
