"""The memory census names large tensors and buffers by the path that holds them (node/census.py)."""

from __future__ import annotations

import json
from collections import deque

import torch

from p2p_diloco.node.census import census, write_census

MIB = 1 << 20


class _Log:
    def __init__(self) -> None:
        self.records = deque([b"x" * (2 * MIB), b"y" * (2 * MIB)])


class _Peer:
    def __init__(self) -> None:
        self.replica = {"w": torch.zeros(MIB // 4 * 3)}  # 3 MiB of float32
        self.log = _Log()
        # a view, reached later (breadth first): its storage is counted once, under the first path
        self.cache = {"deeper": {"view": self.replica["w"][:10]}}
        self.small = torch.zeros(10)


def _groups(result: dict) -> dict[str, tuple[int, int]]:
    return {g["path"]: (g["bytes"], g["objects"]) for g in result["groups"]}


def test_census_names_each_storage_once_by_its_path_and_sums_indexed_records():
    peer = _Peer()
    groups = _groups(census({"node": peer}))
    assert groups["node.replica.w"] == (3 * MIB, 1)
    assert groups["node.log.records[]"] == (4 * MIB, 2)  # indices dropped: one log, summed
    assert not any(path.startswith("node.cache") for path in groups)
    assert not any("small" in path for path in groups)  # under the 1 MiB floor


def test_census_counts_gradients_and_what_only_a_frame_holds():
    param = torch.nn.Parameter(torch.zeros(MIB // 4))
    param.grad = torch.ones(MIB // 4)
    local = torch.zeros(2 * MIB, dtype=torch.int8)  # noqa: F841 - held by this frame alone
    groups = _groups(census({"node": {"param": param}}))
    assert groups["node.param"] == (MIB, 1)
    assert groups["node.param.grad"] == (MIB, 1)
    assert any(path.endswith(".local") and size == (2 * MIB, 1) for path, size in groups.items())


def test_write_census_writes_json_with_the_process_memory(tmp_path):
    peer = _Peer()
    target = tmp_path / "memory-census.json"
    write_census(target, {"node": peer})
    result = json.loads(target.read_text())
    assert result["total_bytes"] >= 7 * MIB
    assert result["pss_bytes"] > 0
    assert result["unaccounted_bytes"] == result["pss_bytes"] - result["total_bytes"]


def test_tensors_keyed_by_parameter_names_sum_under_one_path():
    model = {"blocks.0.w": torch.zeros(MIB // 4), "blocks.1.w": torch.zeros(MIB // 4)}
    groups = _groups(census({"node": {"params": model}}))
    assert groups["node.params[]"] == (2 * MIB, 2)
