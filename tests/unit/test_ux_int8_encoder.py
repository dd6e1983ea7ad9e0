"""Issue #43 item 7: the int8 encoder is an explicit choice (`wire.codecs.placement`), and a learner on a
CUDA device with bitsandbytes takes its delta there for bitsandbytes to quantize, instead of copying it to
the CPU first. The machine's devices are injected (`Accelerators`): no GPU is needed, and the CUDA kernels
themselves are checked by tests/gpu (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.wire.codecs.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.codecs.placement import (
    Accelerators,
    Int8Encoder,
    delta_device,
    delta_for_encoder,
    int8_encoder,
)

ONE_GPU = Accelerators(cuda=("cuda:0",), bitsandbytes=True)
TWO_GPUS = Accelerators(cuda=("cuda:0", "cuda:1"), bitsandbytes=True)
NO_BNB = Accelerators(cuda=("cuda:0",), bitsandbytes=False)
CPU_ONLY = Accelerators()


@pytest.mark.parametrize(
    ("device", "found", "encoder"),
    [
        ("cpu", ONE_GPU, Int8Encoder.CPU),
        ("cuda:0", ONE_GPU, Int8Encoder.BITSANDBYTES),
        ("cuda", ONE_GPU, Int8Encoder.BITSANDBYTES),  # the current CUDA device
        ("cuda:1", TWO_GPUS, Int8Encoder.BITSANDBYTES),
        ("cuda:1", ONE_GPU, Int8Encoder.CPU),  # not a device of this machine
        ("cuda:0", NO_BNB, Int8Encoder.CPU),  # CUDA without bitsandbytes: the CPU kernel on a copy
        ("cuda", CPU_ONLY, Int8Encoder.CPU),
        ("mps", ONE_GPU, Int8Encoder.CPU),  # bitsandbytes has no MPS kernel
    ],
)
def test_the_int8_encoder_is_bitsandbytes_only_on_a_cuda_device_it_can_use(device, found, encoder):
    assert int8_encoder(device, found) == encoder


@pytest.mark.parametrize(
    ("learner", "codec", "found", "where"),
    [
        ("cuda:0", "int8", ONE_GPU, "cuda:0"),
        ("cuda:1", "int8", TWO_GPUS, "cuda:1"),
        ("cuda", "int8", ONE_GPU, "cuda"),
        ("cuda:0", "int8", NO_BNB, "cpu"),
        ("cuda:0", "fp32", ONE_GPU, "cpu"),  # raw float32 frames are written from the host
        ("cuda:0", "topk-int8", ONE_GPU, "cpu"),  # the sparse codecs encode on the CPU as before
        ("cuda:0", "topk4k-int2", ONE_GPU, "cpu"),
        ("mps", "int8", ONE_GPU, "cpu"),
        ("cpu", "int8", ONE_GPU, "cpu"),
    ],
)
def test_a_learner_takes_its_delta_on_its_cuda_device_only_for_bitsandbytes_int8(
    learner, codec, found, where
):
    assert delta_device(learner, codec, found) == torch.device(where)


def test_on_the_cpu_the_delta_is_anchor_minus_the_theta_copy_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    anchor = {"w": torch.randn(300, generator=gen), "b": torch.randn(7, generator=gen)}
    theta = {name: t + 1e-3 * torch.randn(t.shape, generator=gen) for name, t in anchor.items()}
    delta = delta_for_encoder(anchor, theta, {}, torch.device("cpu"))  # the live parameters are not read
    assert list(delta) == ["w", "b"]
    for name in anchor:
        assert torch.equal(delta[name], anchor[name] - theta[name])


def test_on_another_device_the_delta_is_taken_there_from_the_live_parameters():
    anchor = {"w": torch.zeros(5)}
    live = {"w": torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))}
    delta = delta_for_encoder(anchor, {}, live, torch.device("meta"))  # a device that is not the CPU
    assert delta["w"].device.type == "meta" and delta["w"].dtype == torch.float32
    assert delta["w"].shape == (5,)


def test_this_machine_without_cuda_encodes_on_the_cpu_and_the_frame_round_trips():
    here = Accelerators.here()
    if here.cuda:
        pytest.skip("a machine with CUDA: tests/gpu checks its encoder")
    assert int8_encoder("cpu") == Int8Encoder.CPU and int8_encoder("cuda") == Int8Encoder.CPU
    assert delta_device("cuda", "int8") == torch.device("cpu")
    values = {"w": torch.linspace(-1, 1, 5000)}
    decoded = decode_tensors(encode_tensors(values, codec="int8", block_size=256), max_bytes=1 << 20)
    assert (decoded["w"] - values["w"]).abs().max() < 0.02
