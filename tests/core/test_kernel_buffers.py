"""Tests for wspool.memory: FlashInfer wrappers' own buffers counted per pool, while they live."""

from __future__ import annotations

import gc

import torch

import wspool
from wspool.memory import kernel_buffer_stats, track_kernel_buffers

MiB = 1 << 20


class FakeWrapper:
    """Stands in for a FlashInfer wrapper: a float workspace it was given, and buffers of its own."""

    def __init__(self, workspace: torch.Tensor, index: torch.Tensor) -> None:
        self._float_workspace_buffer = workspace
        self._qo_indptr_buf = index
        self._int_workspace_buffer = torch.empty(8 * MiB, dtype=torch.uint8, device="meta")
        self._backend = type("Backend", (), {})()
        self._backend.scratch = torch.empty(MiB, dtype=torch.uint8, device="meta")
        self._backend.same = self._int_workspace_buffer
        self._host_copy = torch.empty(16, dtype=torch.uint8)  # plain host memory: not pinned, not counted


def test_live_wrappers_are_counted_per_pool_and_dropped_ones_are_not() -> None:
    """Each live wrapper's own tensors count once; the pool's buffer and supplied index buffers do not."""
    reg = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "1MiB"}}})
    pool = reg.pool("p", "cpu")
    workspace = reg.workspace("p", "cpu")
    index = torch.zeros(9, dtype=torch.int32)
    first, second = FakeWrapper(workspace, index), FakeWrapper(workspace, index)
    for wrapper in (first, second, first):
        track_kernel_buffers(reg, pool, wrapper, supplied=[index])
    (stats,) = kernel_buffer_stats(reg)
    assert (stats.pool, stats.device, stats.lane, stats.wrappers) == ("p", "cpu", "main", 2)
    assert (stats.device_bytes, stats.pinned_host_bytes) == (2 * 9 * MiB, 0)
    del second
    gc.collect()
    assert kernel_buffer_stats(reg)[0].wrappers == 1


def test_memory_summary_shows_the_wrappers_buffers() -> None:
    """memory_summary and memory_stats report the wrappers' own bytes next to the pool's."""
    reg = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "1MiB"}}})
    wrapper = FakeWrapper(reg.workspace("p", "cpu"), torch.zeros(1))
    track_kernel_buffers(reg, reg.pool("p", "cpu"), wrapper)
    summary = reg.memory_summary()
    line = (
        "FlashInfer's own buffers on p cpu lane main: 1 wrapper(s) hold 9MiB more on the device, 0B pinned host "
        "(FlashInfer's defaults: 8MiB + 8MiB pinned)"
    )
    assert line in summary
    assert reg.memory_stats()["devices"]["cpu"]["kernel_bytes"] == 9 * MiB
    assert wrapper is not None


def test_no_wrappers_no_rows() -> None:
    """A registry whose ops built no wrapper reports none."""
    assert kernel_buffer_stats(wspool.PoolRegistry()) == []
