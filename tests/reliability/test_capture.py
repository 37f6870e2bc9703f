"""Reliability on the CPU under freeze and CUDA-graph capture: refusals that change nothing, old buffers kept alive.

Capture is simulated without a GPU: a pool takes a ``capture_probe``, and a
registry's CUDA pools use ``torch.cuda.is_current_stream_capturing``, which the
``capture`` fixture replaces; buffers for the simulated ``cuda:0`` are made on
the CPU by an injected allocator. The same paths on a real GPU are in
tests/reliability/test_capture_gpu.py.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.helpers.registry import make_registry
from tests.reliability.doubles import CountingAllocator, fill_with_pattern
from wspool.errors import WorkspaceFrozenError
from wspool.pool import PoolSpec, WorkspacePool
from wspool.units import MiB

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Simulate CUDA (pools on cuda:0 made on the CPU) and graph capture: set ``capture[0] = True`` to capture."""
    state = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CUDA pools, made on the CPU
    yield state


# -- freeze and capture ---------------------------------------------------------


def test_freeze_refusals_leave_the_buffer_exactly_as_it_was() -> None:
    """While frozen, every way of growing raises, naming pool, device, bytes and key; nothing changes."""
    allocator = CountingAllocator()
    reg = make_registry({"p": {"rules": {"default": "1MiB", "big": "3MiB", "shape": "x * 1MiB"}}}, allocator=allocator)
    buf = reg.workspace("p", CPU)
    content = fill_with_pattern(buf)
    reg.freeze()
    attempts: list[tuple[Callable[[], object], str]] = [
        (lambda: reg.workspace("p", CPU, rule="big"),
         r"pool 'p' on cpu \(lane main\) would have to grow while the registry is frozen: rule big needs 3145728 "
         r"bytes \(3MiB\), 1048576 bytes available\. Reserve or warm up that size before capturing/freezing, or "
         r"raise pools\.p\.rules\.big / WSPOOL_POOLS__P__RULES__BIG"),
        (lambda: reg.workspace("p", CPU, rule="shape", x=2), r"rule shape needs 2097152 bytes .*rules\.shape"),
        (lambda: reg.reserve("p", CPU, nbytes="2MiB"), r"reserve needs 2097152 bytes \(2MiB\), 1048576 bytes"),
        (lambda: reg.warmup("p", [{"x": 1}, {"x": 4}], CPU, rule="shape"), r"needs 4194304 bytes"),
    ]  # fmt: skip
    for attempt, match in attempts:
        with pytest.raises(WorkspaceFrozenError, match=match):
            attempt()
        assert reg.stats("p", CPU).capacity_bytes == MiB
        assert reg.workspace("p", CPU).data_ptr() == buf.data_ptr()
    assert torch.equal(buf, content)
    stats = reg.stats("p", CPU)
    assert (stats.grow_count, stats.refused_count) == (1, len(attempts))
    assert allocator.calls == [MiB]
    reg.unfreeze()
    assert reg.workspace("p", CPU, rule="big").numel() == 3 * MiB


def test_frozen_empty_pool_stays_empty() -> None:
    """A first request while frozen raises with 0 bytes available and allocates nothing."""
    allocator = CountingAllocator()
    reg = make_registry({"p": {"rules": {"default": "1MiB"}}}, allocator=allocator)
    with reg.frozen(), pytest.raises(WorkspaceFrozenError, match=r"needs 1048576 bytes \(1MiB\), 0 bytes available"):
        reg.workspace("p", CPU)
    assert reg.pool("p", CPU).buffer is None
    assert allocator.calls == []


def test_capture_refusals_never_allocate_frozen_or_not() -> None:
    """During capture a request that fits is served; one that needs growth raises, frozen or not; nothing changes."""
    capturing = [False]
    allocator = CountingAllocator()
    spec = PoolSpec("p", {"default": "1MiB", "big": "3MiB"})
    pool = WorkspacePool(spec, CPU, allocator=allocator, capture_probe=lambda: capturing[0])
    buf = pool.workspace("default", {})
    content = fill_with_pattern(buf)
    capturing[0] = True
    assert pool.workspace("default", {}) is buf
    match = (
        r"pool 'p' on cpu \(lane main\) would have to grow during CUDA-graph capture: rule big needs 3145728 bytes "
        r"\(3MiB\), 1048576 bytes available\. Reserve or warm up that size before capturing/freezing, or raise "
        r"pools\.p\.rules\.big / WSPOOL_POOLS__P__RULES__BIG"
    )
    attempts: list[Callable[[], object]] = [
        lambda: pool.workspace("big", {}),
        lambda: pool.request(2 * MiB),
        lambda: pool.grow_to(2 * MiB, "overflow recovery"),
    ]
    for attempt in attempts:
        with pytest.raises(WorkspaceFrozenError, match="would have to grow during CUDA-graph capture"):
            attempt()
        assert (pool.capacity_bytes, pool.buffer.data_ptr()) == (MiB, buf.data_ptr())  # type: ignore[union-attr]
    with pytest.raises(WorkspaceFrozenError, match=match):
        pool.workspace("big", {})
    assert torch.equal(buf, content)
    assert allocator.calls == [MiB]
    assert pool.stats().refused_count == len(attempts) + 1


def test_registry_refuses_growth_during_capture_on_cuda_only(capture: list[bool]) -> None:
    """A registry's CUDA pools refuse growth while the stream captures; its CPU pools are not affected."""
    allocator = CountingAllocator()
    reg = make_registry({"p": {"rules": {"default": "1MiB", "big": "3MiB", "shape": "x * 1MiB"}}}, allocator=allocator)
    reg.warmup("p", [{"x": 1}, {"x": 2}], CUDA0, rule="shape")
    buf = reg.workspace("p", CUDA0)
    capture[0] = True
    assert reg.workspace("p", CUDA0, rule="shape", x=2) is buf
    for attempt in (
        lambda: reg.workspace("p", CUDA0, rule="big"),
        lambda: reg.reserve("p", CUDA0, nbytes="4MiB"),
        lambda: reg.workspace("p", CUDA0, lane="ubatch1"),  # a lane's first buffer is growth too
    ):
        with pytest.raises(WorkspaceFrozenError, match=r"on cuda:0 \(lane \w+\) would have to grow during CUDA-graph"):
            attempt()
    with reg.frozen(), pytest.raises(WorkspaceFrozenError, match=r"would have to grow during CUDA-graph capture"):
        reg.workspace("p", CUDA0, rule="big")  # frozen too: the message names the capture
    assert reg.stats("p", CUDA0).capacity_bytes == 2 * MiB
    assert reg.workspace("p", CUDA0).data_ptr() == buf.data_ptr()
    assert reg.workspace("p", CPU, rule="big").numel() == 3 * MiB  # capture is a CUDA-stream matter
    assert allocator.calls == [2 * MiB, 3 * MiB]


# -- old buffers ----------------------------------------------------------------


def test_buffer_handed_out_during_capture_is_retired_until_released() -> None:
    """A buffer served during a capture is kept alive on growth, even with no reference left, until released."""
    capturing = [False]
    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB", "big": "3MiB"}), CPU, capture_probe=lambda: capturing[0])
    old = weakref.ref(pool.workspace("default", {}))
    capturing[0] = True
    pool.workspace("default", {})  # the graph now holds this buffer's address
    capturing[0] = False
    pool.workspace("big", {})
    gc.collect()
    assert old() is not None
    assert pool.stats().retired_bytes == MiB
    assert pool.release_retired() == MiB
    gc.collect()
    assert old() is None
    assert pool.stats().retired_bytes == 0


def test_buffer_never_in_a_graph_is_dropped_on_growth() -> None:
    """Growth drops a buffer no capture saw: PyTorch frees it once the caller's references go."""
    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB", "big": "3MiB"}), CPU, capture_probe=lambda: False)
    kept = pool.workspace("default", {})  # a caller (a kernel wrapper) still holding the old buffer keeps it
    old = weakref.ref(kept)
    pool.workspace("big", {})
    assert pool.stats().retired_bytes == 0
    assert old() is kept
    del kept
    gc.collect()
    assert old() is None


def test_buffer_current_during_a_freeze_is_retired_on_later_growth() -> None:
    """Freezing says graphs may be captured: a buffer current then is retired when the pool grows after unfreeze."""
    pools = {"p": {"rules": {"default": "1MiB", "big": "2MiB", "huge": "4MiB"}}}
    reg = make_registry(pools, allocator=CountingAllocator())
    frozen_buffer = weakref.ref(reg.workspace("p", CPU))
    with reg.frozen():
        reg.workspace("p", CPU)  # e.g. taken by a kernel wrapper and captured
    reg.workspace("p", CPU, rule="big")
    assert reg.stats("p", CPU).retired_bytes == MiB
    reg.workspace("p", CPU, rule="huge")  # the 2MiB buffer never lived through a freeze or a capture: dropped
    gc.collect()
    assert reg.stats("p", CPU).retired_bytes == MiB
    assert frozen_buffer() is not None
    assert reg.release_retired() == MiB
    gc.collect()
    assert frozen_buffer() is None


def test_retired_buffers_accumulate_across_captures() -> None:
    """Each captured generation is kept; release_retired() frees them all at once."""
    capturing = [False]
    pool = WorkspacePool(PoolSpec("p", {"n": "n"}), CPU, capture_probe=lambda: capturing[0])
    for n in (1, 2, 3):
        pool.workspace("n", {"n": n * MiB})
        capturing[0] = True
        pool.workspace("n", {"n": n * MiB})
        capturing[0] = False
    pool.workspace("n", {"n": 4 * MiB})
    assert pool.stats().retired_bytes == 6 * MiB
    assert pool.release_retired() == 6 * MiB
    assert pool.release_retired() == 0
