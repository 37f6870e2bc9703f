"""What the GPU reliability tests share: a registry with one scratch pool, and the current CUDA device.

Pool ``ws`` holds 16 MiB by its ``default`` rule (``NUMEL`` float32 elements of
scratch) and 64 MiB by ``big``, a size no test reserves, so asking for it grows.
"""

from __future__ import annotations

import torch

import wspool
from tests.helpers.registry import make_registry
from wspool.units import MiB

__all__ = ["NUMEL", "current_cuda_device", "scratch_registry"]

NUMEL = 4 * MiB  # float32 elements of scratch: 16MiB, the pool's default rule


def scratch_registry(*, debug_streams: bool = False) -> wspool.PoolRegistry:
    """Return a registry whose only configured pool is ``ws`` (16 MiB by ``default``, 64 MiB by ``big``)."""
    return make_registry({"ws": {"rules": {"default": "16MiB", "big": "64MiB"}}}, debug_streams=debug_streams)


def current_cuda_device() -> torch.device:
    """Return the current CUDA device with its index (pools and statistics name it so)."""
    return torch.device("cuda", torch.cuda.current_device())
