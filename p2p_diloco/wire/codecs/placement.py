"""Where a delta is quantized: the int8 encoder chosen explicitly from the tensors' device and what the
machine has, and the device a learner leaves its delta on for that encoder.

Two int8 encoders make the same frame format (`wire.codecs.codec`):

* `Int8Encoder.CPU`: the project's kernel (`blockwise.quantize_blockwise_cpu`, the C kernel where it is
  built), on CPU tensors; tensors elsewhere are copied to the CPU first.
* `Int8Encoder.BITSANDBYTES`: bitsandbytes' kernel, on the tensors' CUDA device, where bitsandbytes is
  installed. Only the codes and absmax (about a quarter of the float32 bytes) come back to the host.

A learner on CUDA with the dense int8 codec takes its delta on its device (`delta_device`,
`delta_for_encoder`), so that bitsandbytes encodes it there; on any other device, or with another codec,
the delta is taken on the CPU as before. The choice reads the machine through `Accelerators.here()`; tests
pass an `Accelerators` of their own (a device list), so every branch runs without a GPU. The CUDA path is
untested on a GPU until a session with one runs tests/gpu (docs/gpu.md).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import torch

from p2p_diloco.config import Codec
from p2p_diloco.protocol.diloco import outer_delta


class Int8Encoder(StrEnum):
    CPU = "cpu"  # blockwise.quantize_blockwise_cpu, on a CPU copy where the tensors lie elsewhere
    BITSANDBYTES = "bitsandbytes"  # bitsandbytes.functional.quantize_blockwise on the CUDA device


@dataclass(frozen=True)
class Accelerators:
    """What the int8 encoders can use here: the CUDA devices (``cuda:0`` ...) and whether bitsandbytes is
    installed (its wheels carry their CUDA kernels)."""

    cuda: tuple[str, ...] = ()
    bitsandbytes: bool = False

    @staticmethod
    @functools.cache
    def here() -> Accelerators:
        """This machine's, read once (bitsandbytes looked up, not imported: importing it costs seconds)."""
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        installed = importlib.util.find_spec("bitsandbytes") is not None
        return Accelerators(cuda=tuple(f"cuda:{i}" for i in range(count)), bitsandbytes=installed)

    def has(self, device: torch.device) -> bool:
        """Whether `device` (``cuda`` without an index: the current one) is among the CUDA devices."""
        if device.type != "cuda":
            return False
        return bool(self.cuda) if device.index is None else f"cuda:{device.index}" in self.cuda


def int8_encoder(device: torch.device | str, accelerators: Accelerators | None = None) -> Int8Encoder:
    """The encoder for int8 frames of tensors on `device`: bitsandbytes on a CUDA device it can use, the
    CPU kernel everywhere else (the CPU, MPS, a CUDA device without bitsandbytes)."""
    found = Accelerators.here() if accelerators is None else accelerators
    if found.bitsandbytes and found.has(torch.device(device)):
        return Int8Encoder.BITSANDBYTES
    return Int8Encoder.CPU


def delta_device(
    learner_device: torch.device | str, codec: Codec | str, accelerators: Accelerators | None = None
) -> torch.device:
    """Where a learner on `learner_device` takes its deltas: its own device when the codec is dense int8
    and that device's encoder is bitsandbytes (the delta never crosses to the host as float32), else the
    CPU (the codecs that encode on the CPU, and devices the CPU kernel serves)."""
    device = torch.device(learner_device)
    if Codec(codec) == Codec.INT8 and int8_encoder(device, accelerators) == Int8Encoder.BITSANDBYTES:
        return device
    return torch.device("cpu")


def delta_for_encoder(
    anchor: Mapping[str, torch.Tensor],
    theta: Mapping[str, torch.Tensor],
    live: Mapping[str, torch.Tensor],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Δ = anchor − θ (`protocol.diloco.outer_delta`) per tensor of `anchor`, on `device`: on the CPU from
    `theta` (the learner's float32 CPU copy), elsewhere from the `live` parameters with the anchor copied
    there. One float32 subtraction either way, so the delta is the same bits on both."""
    if device.type == "cpu":
        return {name: outer_delta(anchor[name], theta[name]) for name in anchor}
    return {
        name: outer_delta(anchor[name].to(device), live[name].detach().to(device, torch.float32))
        for name in anchor
    }
