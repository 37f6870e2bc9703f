"""Reliability on the CPU when memory runs out: every failed growth a counted WorkspaceLimitError, nothing lost.

Out-of-memory errors are injected by a counting allocator on the CPU, in a row,
on a first request, and at random under 16 threads. A real one on a GPU is in
tests/reliability/test_out_of_memory_gpu.py.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from tests.helpers.registry import make_registry
from tests.reliability.doubles import CountingAllocator, fill_with_pattern, run_threads
from wspool.errors import WorkspaceLimitError
from wspool.units import MiB

CPU = torch.device("cpu")

THREADS = 16
FAULT_REQUESTS_PER_THREAD = 500  # 8,000 requests growing through injected out-of-memory errors


def test_out_of_memory_keeps_the_old_buffer_until_memory_returns() -> None:
    """Five injected out-of-memory errors in a row: each raises, the old buffer is served; then growth succeeds."""
    allocator = CountingAllocator()
    reg = make_registry({"p": {"rules": {"default": "1MiB", "big": "3MiB"}}}, allocator=allocator)
    buf = reg.workspace("p", CPU)
    content = fill_with_pattern(buf)
    allocator.limit = MiB
    for _ in range(5):
        with pytest.raises(
            WorkspaceLimitError,
            match=r"pool 'p' on cpu \(lane main\) could not grow from 1048576 to 3145728 bytes \(3MiB\) for rule "
            r"big: the device is out of memory; the pool keeps its 1MiB buffer\. Lower pools\.p\.rules\.big / "
            r"WSPOOL_POOLS__P__RULES__BIG or free device memory",
        ) as info:
            reg.workspace("p", CPU, rule="big")
        assert isinstance(info.value, MemoryError)
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
        assert reg.workspace("p", CPU) is buf
    assert torch.equal(buf, content)
    stats = reg.stats("p", CPU)
    assert (stats.capacity_bytes, stats.grow_count, stats.refused_count) == (MiB, 1, 5)
    allocator.limit = None
    assert reg.workspace("p", CPU, rule="big").numel() == 3 * MiB
    assert reg.stats("p", CPU).grow_count == 2
    assert allocator.faults == 5


def test_out_of_memory_on_the_first_request_leaves_the_pool_empty() -> None:
    """A first allocation that fails leaves no buffer; the next request tries again."""
    allocator = CountingAllocator()
    allocator.limit = 0
    reg = make_registry({"p": {"rules": {"default": "1MiB"}}}, allocator=allocator)
    with pytest.raises(WorkspaceLimitError, match=r"could not grow from 0 to 1048576 bytes .*keeps its empty buffer"):
        reg.workspace("p", CPU)
    assert reg.pool("p", CPU).buffer is None
    allocator.limit = None
    assert reg.workspace("p", CPU).numel() == MiB


def test_injected_faults_under_sixteen_threads_lose_nothing() -> None:
    """Growth through random out-of-memory faults, 4 threads per lane: only WorkspaceLimitError, every fault counted."""
    allocator = CountingAllocator(zero=False)
    allocator.fail_rate = 0.3
    reg = make_registry({"p": {"rules": {"n": "n"}}}, allocator=allocator)
    lanes = [f"t{i}" for i in range(4)]
    short: list[int] = []
    refusals = Counter[int]()
    barrier = threading.Barrier(THREADS)

    def worker(index: int) -> None:
        lane = lanes[index % 4]
        pool = reg.pool("p", CPU, lane=lane)
        barrier.wait()
        for step in range(FAULT_REQUESTS_PER_THREAD):
            n = (step * 4 + index // 4 + 1) * 256  # sizes rising in each lane: most requests grow it
            while True:
                before = pool.capacity_bytes
                try:
                    buf = reg.workspace("p", CPU, rule="n", lane=lane, n=n)
                except WorkspaceLimitError:
                    refusals[index] += 1
                    assert pool.capacity_bytes >= before  # the pool lost nothing
                    continue
                if buf.numel() < n:
                    short.append(n)
                break

    run_threads(THREADS, worker)
    stats = [reg.stats("p", CPU, lane=lane) for lane in lanes]
    assert short == []
    assert allocator.faults >= 500
    assert sum(s.refused_count for s in stats) == allocator.faults == sum(refusals.values())
    assert sum(s.grow_count for s in stats) == len(allocator.calls)
    assert sum(s.request_count for s in stats) == THREADS * FAULT_REQUESTS_PER_THREAD
    assert {s.capacity_bytes for s in stats} == {FAULT_REQUESTS_PER_THREAD * 4 * 256}
