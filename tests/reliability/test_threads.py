"""Reliability on the CPU under threads: one allocation per pool and lane, growth raced by 16 threads.

Buffers come from a counting allocator on the CPU, so every allocation is seen;
a thread reading statistics runs beside the workers.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import torch

import wspool
from tests.helpers.registry import make_registry
from tests.reliability.doubles import CountingAllocator, run_threads
from wspool.units import KiB

CPU = torch.device("cpu")

THREADS = 16
REQUESTS_PER_THREAD = 8_000  # 128,000 requests in the one-allocation stress
GROWTH_REQUESTS_PER_THREAD = 2_000  # 32,000 requests racing growth

STRESS_POOLS = {
    name: {"rules": {"small": "4KiB", "big": "60KiB", "shape": "x * 1KiB"}, "growth": "64KiB"}
    for name in ("attn", "moe", "sampler")
}
STRESS_LANES = ("main", "ubatch0", "ubatch1")
_STRESS_BYTES = {"small": 4 * KiB, "big": 60 * KiB}


def test_sixteen_threads_share_pools_with_one_allocation_each() -> None:
    """16 threads x 8,000 requests over 3 pools x 3 lanes: one allocation per pool and lane, exact statistics."""
    allocator = CountingAllocator()
    reg = make_registry(STRESS_POOLS, allocator=allocator)
    barrier = threading.Barrier(THREADS + 1)
    done = threading.Event()
    counts: list[Counter[tuple[str, str, str]]] = [Counter() for _ in range(THREADS)]
    peaks: list[dict[tuple[str, str], int]] = [{} for _ in range(THREADS)]
    served: list[dict[tuple[str, str], set[int]]] = [{} for _ in range(THREADS)]
    short: list[int] = []

    def worker(index: int) -> None:
        rng = random.Random(index)
        plan = [
            (rng.choice(list(STRESS_POOLS)), rng.choice(STRESS_LANES), rng.choice(("small", "big", "shape")),
             rng.randint(1, 64))
            for _ in range(REQUESTS_PER_THREAD)
        ]  # fmt: skip
        count, peak, ids = counts[index], peaks[index], served[index]
        barrier.wait()
        for i, (pool, lane, rule, x) in enumerate(plan):
            if i % 2:
                buf = reg.workspace(pool, CPU, rule=rule, lane=lane, x=x)
            else:
                with wspool.lane(lane):  # the context-variable path, local to this thread
                    buf = reg.workspace(pool, CPU, rule=rule, x=x)
            nbytes = _STRESS_BYTES.get(rule, x * KiB)
            if buf.numel() < nbytes:
                short.append(nbytes)
            count[pool, lane, rule] += 1
            if nbytes > peak.get((pool, lane), 0):
                peak[pool, lane] = nbytes
            ids.setdefault((pool, lane), set()).add(id(buf))

    snapshots: list[int] = []
    bad_snapshots: list[wspool.PoolStats] = []

    def reader() -> None:
        # Statistics read under contention stay self-consistent and never go backwards.
        seen: dict[tuple[str, str], int] = {}
        barrier.wait()
        while not done.is_set():
            for stats in reg.all_stats():
                key = (stats.pool, stats.lane)
                if (
                    stats.grow_count > 1
                    or stats.peak_request_bytes > stats.capacity_bytes
                    or stats.request_count < seen.get(key, 0)
                ):
                    bad_snapshots.append(stats)
                seen[key] = stats.request_count
                snapshots.append(stats.request_count)

    reader_thread = threading.Thread(target=reader)
    reader_thread.start()
    try:
        run_threads(THREADS, worker)
    finally:
        done.set()
        reader_thread.join()

    assert short == []
    assert snapshots and bad_snapshots == []
    keys = [(pool, lane) for pool in STRESS_POOLS for lane in STRESS_LANES]
    assert allocator.calls == [64 * KiB] * len(keys)
    total: Counter[tuple[str, str, str]] = sum(counts, Counter())
    assert sum(total.values()) == THREADS * REQUESTS_PER_THREAD
    buffers = set()
    for pool, lane in keys:
        stats = reg.stats(pool, CPU, lane=lane)
        assert (stats.capacity_bytes, stats.grow_count, stats.refused_count) == (64 * KiB, 1, 0)
        by_rule = {rule: n for (p, lane_, rule), n in total.items() if (p, lane_) == (pool, lane)}
        assert dict(stats.requests_by_rule) == by_rule
        assert stats.request_count == sum(by_rule.values())
        assert stats.peak_request_bytes == max(peak.get((pool, lane), 0) for peak in peaks)
        ids = set().union(*(s.get((pool, lane), set()) for s in served))
        buffer = reg.pool(pool, CPU, lane=lane).buffer
        assert ids == {id(buffer)}  # every request of this pool and lane got this one buffer
        buffers.add(buffer.data_ptr())  # type: ignore[union-attr]
    assert len(buffers) == len(keys)  # pools and lanes never alias
    assert sum(s.request_count for s in reg.all_stats()) == THREADS * REQUESTS_PER_THREAD


def test_growth_racing_sixteen_threads_never_serves_a_short_buffer() -> None:
    """16 threads asking for random sizes while the pool grows: every buffer fits, every growth is counted."""
    allocator = CountingAllocator(zero=False)
    reg = make_registry({"p": {"rules": {"n": "n"}}}, allocator=allocator)
    sizes = [k * KiB for k in range(1, 65)]
    short: list[int] = []
    barrier = threading.Barrier(THREADS)

    def worker(index: int) -> None:
        rng = random.Random(100 + index)
        plan = [rng.choice(sizes) for _ in range(GROWTH_REQUESTS_PER_THREAD)]
        barrier.wait()
        for n in plan:
            if reg.workspace("p", CPU, rule="n", n=n).numel() < n:
                short.append(n)

    run_threads(THREADS, worker)
    stats = reg.stats("p", CPU)
    assert short == []
    assert stats.capacity_bytes == 64 * KiB
    assert stats.request_count == THREADS * GROWTH_REQUESTS_PER_THREAD
    assert stats.grow_count == len(allocator.calls) <= len(sizes)
    assert allocator.calls == sorted(set(allocator.calls))  # each growth strictly larger than the last
