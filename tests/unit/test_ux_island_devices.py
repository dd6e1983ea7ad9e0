"""Issue #43 items 6 and 7: an island's ranks map onto the CUDA devices there are, or are refused with the
fix (a 2-rank island on one GPU put rank 1 on cuda:1); `--device cuda` without CUDA gives the CUDA torch
install line. The device list is injected."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.errors import ConfigError
from p2p_diloco.node.island import IslandEnv, check_island_gpus, rank_device
from p2p_diloco.node.options import CUDA_TORCH, check_device


def test_two_ranks_on_one_gpu_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"has 1 CUDA device .*--nproc 1.*--device cpu"):
        rank_device("cuda", IslandEnv(rank=1, world_size=2, local_rank=1), device_count=1)
    with pytest.raises(ConfigError, match="--nproc 1"):
        check_island_gpus(2, device_count=1)


def test_ranks_map_onto_the_gpus_there_are():
    assert [rank_device("cuda", IslandEnv(r, 2, r), device_count=2) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    # a second machine of a multi-node island: its local ranks, not the global ones, pick the device
    assert rank_device("cuda", IslandEnv(rank=3, world_size=4, local_rank=1), device_count=2) == "cuda:1"
    check_island_gpus(2, device_count=4)
    assert rank_device("cpu", IslandEnv(1, 2, 1), device_count=0) == "cpu"


def test_no_cuda_at_all_names_the_cuda_torch_install():
    with pytest.raises(ConfigError) as info:
        check_island_gpus(2, device_count=0)
    assert CUDA_TORCH in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_join_device_cuda_without_cuda_gives_the_install_line():
    with pytest.raises(ConfigError) as info:
        check_device("cuda")
    assert CUDA_TORCH in str(info.value) and "--device cpu" in str(info.value)
