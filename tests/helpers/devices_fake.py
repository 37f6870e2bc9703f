"""Descriptions of real GPUs, for tests that stand the CPU in for one (wspool.devices.fake_device)."""

from __future__ import annotations

import torch

from wspool.devices import DeviceDescription

H200 = DeviceDescription("NVIDIA H200", 9, 0, 132, 150_754_820_096)
A100 = DeviceDescription("NVIDIA A100-SXM4-80GB", 8, 0, 108, 85_097_971_712)
B200 = DeviceDescription("NVIDIA B200", 10, 0, 148, 191_514_607_616)
GB300 = DeviceDescription("NVIDIA GB300", 10, 3, 160, 287_000_000_000)
RTX_PRO_6000 = DeviceDescription("NVIDIA RTX PRO 6000 Blackwell", 12, 0, 188, 102_000_000_000)

HOPPER_MLA_BYTES = 64 * 132 * (4 * 512 + 8)  # 17369088: the hopper profile's rule on an H200


def meta_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    """Allocate nothing: a meta tensor of the right size stands in for the buffer."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")
