"""Reliability on a CUDA device under capture: graphs captured through the pool, refusals, retired buffers.

The kernels are plain PyTorch ones that use the pool's buffer as scratch, as
an attention kernel uses its workspace: ``scratch = ws.view(float32)``, then
``sin(x) * 3`` into the scratch and ``scratch + x`` into the output. Every test
skips, with the reason, where there is no CUDA device; the same paths are
simulated on the CPU in tests/reliability/test_capture.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import wspool
from tests.reliability.gpu_scratch import NUMEL, current_cuda_device, scratch_registry
from wspool.devices import StreamOrderWarning
from wspool.errors import WorkspaceFrozenError
from wspool.units import MiB

pytestmark = pytest.mark.gpu


def _step(reg: wspool.PoolRegistry, x: torch.Tensor, out: torch.Tensor, *, rule: str = "default") -> None:
    """One layer: ask the pool for its workspace (as a backend does on every call), compute through it."""
    ws = reg.workspace("ws", x.device, rule=rule)
    scratch = ws[: x.numel() * 4].view(torch.float32)
    torch.sin(x, out=scratch)
    scratch.mul_(3.0)
    torch.add(scratch, x, out=out)


def _capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Warm ``fn`` up on a side stream, then capture it (the pattern of PyTorch's CUDA-graph docs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _eager(reg: wspool.PoolRegistry, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _step(reg, x, out)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("debug_streams", [False, True], ids=["plain", "debug_streams"])
def test_graph_captured_through_the_pool_replays_identically(debug_streams: bool) -> None:
    """A graph whose kernels use the pool's buffer replays with output identical to eager runs; nothing grows."""
    device = current_cuda_device()
    reg = scratch_registry(debug_streams=debug_streams)
    reg.reserve("ws", device, rule="default")
    x = torch.randn(NUMEL, device=device)
    out = torch.empty_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)  # capture and replay never trip the stream check
        graph = _capture(lambda: _step(reg, x, out))
        pointer = reg.pool("ws", device).buffer.data_ptr()  # type: ignore[union-attr]
        for seed in range(3):
            x.copy_(torch.randn(NUMEL, device=device, generator=torch.Generator(device).manual_seed(seed)))
            expected = _eager(reg, x)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected)
    stats = reg.stats("ws", device)
    assert (stats.capacity_bytes, stats.grow_count, stats.refused_count) == (16 * MiB, 1, 0)
    assert reg.pool("ws", device).buffer.data_ptr() == pointer  # type: ignore[union-attr]


def test_capture_that_would_grow_raises_and_the_first_graph_still_replays() -> None:
    """Growth needed during capture raises WorkspaceFrozenError; the buffer is untouched; the first graph replays."""
    device = current_cuda_device()
    reg = scratch_registry()
    reg.reserve("ws", device, rule="default")
    x = torch.randn(NUMEL, device=device)
    out, other = torch.empty_like(x), torch.empty_like(x)
    graph = _capture(lambda: _step(reg, x, out))
    before = (reg.stats("ws", device).capacity_bytes, reg.pool("ws", device).buffer.data_ptr())  # type: ignore[union-attr]

    second = torch.cuda.CUDAGraph()
    with (
        pytest.raises(
            WorkspaceFrozenError,
            match=r"pool 'ws' on cuda:\d+ \(lane main\) would have to grow during CUDA-graph capture: rule big needs "
            r"67108864 bytes \(64MiB\), 16777216 bytes available",
        ),
        torch.cuda.graph(second),  # its __exit__ ends the capture cleanly while the error propagates
    ):
        other.copy_(x)  # a layer that fits was captured before the one that does not
        _step(reg, x, other, rule="big")
    assert not torch.cuda.is_current_stream_capturing()
    del second

    after = (reg.stats("ws", device).capacity_bytes, reg.pool("ws", device).buffer.data_ptr())  # type: ignore[union-attr]
    assert after == before
    assert reg.stats("ws", device).refused_count == 1
    x.copy_(torch.randn(NUMEL, device=device))
    expected = _eager(reg, x)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_buffer_served_during_capture_is_retired_when_the_pool_grows() -> None:
    """Growth after a capture keeps the captured buffer alive: replays stay correct and touch no new allocation."""
    device = current_cuda_device()
    reg = scratch_registry()
    reg.reserve("ws", device, rule="default")
    x = torch.randn(NUMEL, device=device)
    out = torch.empty_like(x)
    graph = _capture(lambda: _step(reg, x, out))
    captured = reg.pool("ws", device).buffer.data_ptr()  # type: ignore[union-attr]

    grown = reg.workspace("ws", device, rule="big").data_ptr()  # unfrozen, outside capture: allowed
    assert grown != captured
    assert reg.stats("ws", device).retired_bytes == 16 * MiB
    # Had the captured buffer been freed, blocks of its size would be handed out again; fill some to catch it.
    decoys = [torch.full((16 * MiB,), 0x5A, dtype=torch.uint8, device=device) for _ in range(4)]

    x.copy_(torch.randn(NUMEL, device=device))
    expected = _eager(reg, x)  # through the new, larger buffer
    out.zero_()
    graph.replay()  # through the retired one
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert all(bool((decoy == 0x5A).all()) for decoy in decoys)

    del graph
    torch.cuda.synchronize()
    assert reg.release_retired() == 16 * MiB
    assert reg.stats("ws", device).retired_bytes == 0
