"""Reliability on the CPU: threads, freeze and capture refusals, old buffers, out of memory, hostile configuration.

CUDA-graph capture is simulated without a GPU: a pool takes a ``capture_probe``,
and a registry's CUDA pools use ``torch.cuda.is_current_stream_capturing``,
which these tests replace; buffers for the simulated ``cuda:0`` are made on the
CPU by an injected allocator. The same paths on a real GPU are in
tests/reliability/test_reliability_gpu.py.
"""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wspool
from wspool.errors import ConfigError, WorkspaceFrozenError, WorkspaceLimitError
from wspool.pool import PoolSpec, WorkspacePool
from wspool.settings.schema import MAX_CONFIG_FILE_BYTES, load_settings

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)
KiB, MiB = 2**10, 2**20

THREADS = 16
REQUESTS_PER_THREAD = 8_000  # 128,000 requests in the one-allocation stress
GROWTH_REQUESTS_PER_THREAD = 2_000  # 32,000 requests racing growth
FAULT_REQUESTS_PER_THREAD = 500  # 8,000 requests growing through injected out-of-memory errors


class CountingAllocator:
    """Makes CPU buffers (for any device) and counts every allocation; optionally fails like a full GPU."""

    def __init__(self, *, zero: bool = True) -> None:
        self.calls: list[int] = []
        self.faults = 0
        self.limit: int | None = None  # above this, allocations fail as if the device were full
        self.fail_rate = 0.0
        self._zero = zero
        self._random = random.Random(4)
        self._lock = threading.Lock()

    def __call__(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            failing = (self.limit is not None and nbytes > self.limit) or self._random.random() < self.fail_rate
            if failing:
                self.faults += 1
            else:
                self.calls.append(nbytes)
        if failing:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes (injected)")
        make = torch.zeros if self._zero else torch.empty
        return make(nbytes, dtype=torch.uint8)


def _registry(pools: dict[str, object], allocator: CountingAllocator) -> wspool.PoolRegistry:
    return wspool.PoolRegistry(load_settings(pools=pools), allocator=allocator)


def _run_threads(count: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # reported by the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Simulate CUDA-graph capture on the current stream: set ``capture[0] = True`` to be capturing."""
    state = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state[0])
    yield state


# -- threads ------------------------------------------------------------------

STRESS_POOLS = {
    name: {"rules": {"small": "4KiB", "big": "60KiB", "shape": "x * 1KiB"}, "growth": "64KiB"}
    for name in ("attn", "moe", "sampler")
}
STRESS_LANES = ("main", "ubatch0", "ubatch1")
_STRESS_BYTES = {"small": 4 * KiB, "big": 60 * KiB}


def test_sixteen_threads_share_pools_with_one_allocation_each() -> None:
    """16 threads x 8,000 requests over 3 pools x 3 lanes: one allocation per pool and lane, exact statistics."""
    allocator = CountingAllocator()
    reg = _registry(STRESS_POOLS, allocator)
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
        _run_threads(THREADS, worker)
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
    reg = _registry({"p": {"rules": {"n": "n"}}}, allocator)
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

    _run_threads(THREADS, worker)
    stats = reg.stats("p", CPU)
    assert short == []
    assert stats.capacity_bytes == 64 * KiB
    assert stats.request_count == THREADS * GROWTH_REQUESTS_PER_THREAD
    assert stats.grow_count == len(allocator.calls) <= len(sizes)
    assert allocator.calls == sorted(set(allocator.calls))  # each growth strictly larger than the last


# -- freeze and capture ---------------------------------------------------------


def _filled(buf: torch.Tensor) -> torch.Tensor:
    buf.copy_(torch.arange(buf.numel()).remainder(251).to(torch.uint8))  # a pattern a reallocation would lose
    return buf.clone()


def test_freeze_refusals_leave_the_buffer_exactly_as_it_was() -> None:
    """While frozen, every way of growing raises, naming pool, device, bytes and key; nothing changes."""
    allocator = CountingAllocator()
    reg = _registry({"p": {"rules": {"default": "1MiB", "big": "3MiB", "shape": "x * 1MiB"}}}, allocator)
    buf = reg.workspace("p", CPU)
    content = _filled(buf)
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
    reg = _registry({"p": {"rules": {"default": "1MiB"}}}, allocator)
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
    content = _filled(buf)
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
    reg = _registry({"p": {"rules": {"default": "1MiB", "big": "3MiB", "shape": "x * 1MiB"}}}, allocator)
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
    reg = _registry({"p": {"rules": {"default": "1MiB", "big": "2MiB", "huge": "4MiB"}}}, CountingAllocator())
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


# -- out of memory ----------------------------------------------------------------


def test_out_of_memory_keeps_the_old_buffer_until_memory_returns() -> None:
    """Five injected out-of-memory errors in a row: each raises, the old buffer is served; then growth succeeds."""
    allocator = CountingAllocator()
    reg = _registry({"p": {"rules": {"default": "1MiB", "big": "3MiB"}}}, allocator)
    buf = reg.workspace("p", CPU)
    content = _filled(buf)
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
    reg = _registry({"p": {"rules": {"default": "1MiB"}}}, allocator)
    with pytest.raises(WorkspaceLimitError, match=r"could not grow from 0 to 1048576 bytes .*keeps its empty buffer"):
        reg.workspace("p", CPU)
    assert reg.pool("p", CPU).buffer is None
    allocator.limit = None
    assert reg.workspace("p", CPU).numel() == MiB


def test_injected_faults_under_sixteen_threads_lose_nothing() -> None:
    """Growth through random out-of-memory faults, 4 threads per lane: only WorkspaceLimitError, every fault counted."""
    allocator = CountingAllocator(zero=False)
    allocator.fail_rate = 0.3
    reg = _registry({"p": {"rules": {"n": "n"}}}, allocator)
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

    _run_threads(THREADS, worker)
    stats = [reg.stats("p", CPU, lane=lane) for lane in lanes]
    assert short == []
    assert allocator.faults >= 500
    assert sum(s.refused_count for s in stats) == allocator.faults == sum(refusals.values())
    assert sum(s.grow_count for s in stats) == len(allocator.calls)
    assert sum(s.request_count for s in stats) == THREADS * FAULT_REQUESTS_PER_THREAD
    assert {s.capacity_bytes for s in stats} == {FAULT_REQUESTS_PER_THREAD * 4 * 256}


# -- hostile configuration ----------------------------------------------------------

_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefg", "bcdefgh", strict=True)
)

BAD_YAML = [
    ("pools: [unclosed\n", r"invalid YAML in config file .*c\.yaml:2:1"),
    ("pools: !!python/object/apply:os.system ['true']\n", r"invalid YAML .*could not determine a constructor"),
    ("\x00", r"invalid YAML .*special characters are not allowed"),
    ("[" * 5000 + "]" * 5000, r"invalid YAML in config file .*: it nests too deeply"),
    ("a: " + "{a: " * 40 + "1" + "}" * 40 + "\n", r"nests deeper than 32 levels"),
    (_BOMB, r"holds more than 10000 values once its YAML aliases are expanded"),
    ("# padding\n" * (MAX_CONFIG_FILE_BYTES // 10 + 1), r"is larger than 64KiB"),
    ("- 1\n- 2\n", r"must hold a mapping at the top level, got list"),
    ("? [a]\n: 1\n", r"found unhashable key"),
    ("0: 1\n", r"top-level key 0 is not a string \(the keys are pools, debug_streams, profile\)"),
    ("pools: {p: {0: 1}}\n", r"pools\.p\.0 = 0 .*Keys should be strings"),
    ("pools: !!binary aGVsbG8=\n", r"pools = b'hello' .*valid dictionary"),
    ("pools:\n  1: {rules: {default: 1MiB}}\n", r"pools\.1 = 1 \(from YAML file .*\): a key must be a string, not int"),
    ("pools: {p: {rules: {r: 0}}}\n", r"pools\.p\.rules\.r = 0 .*must be a positive size"),
    ("pools: {p: {rules: {r: '1MiB - 2MiB'}}}\n", r"pools\.p\.rules\.r .*is not positive"),
    ("pools: {p: {rules: {r: -1}}}\n", r"pools\.p\.rules\.r = -1 .*negative"),
    ("pools: {p: {rules: {r: 2001-01-01}}}\n", r"pools\.p\.rules\.r = datetime\.date\(2001, 1, 1\) .*got date"),
    ("pools: {p: {rules: {r: .nan}}}\n", r"pools\.p\.rules\.r = nan .*got float"),
    ("pools: {p: {rules: {r: 99999999999999999999999}}}\n", r"exceeds the limit of 1024TiB"),
    ("pools: {p: {rules: {r: \"__import__('os')\"}}}\n", r"pools\.p\.rules\.r = .*calling '__import__' is not allowed"),
    ("pools: {p: {rules: {r: '" + "x + " * 300 + "x'}}}\n", r"longer than 1000 characters"),
    ("pools: {p: {rules: {r: '" + "-(" * 40 + "x" + ")" * 40 + "'}}}\n", r"deeper than 32 levels"),
    ("pools: {p: {max_bytes: 0}}\n", r"pools\.p\.max_bytes = 0 .*must be positive"),
    ("pools: {p: {rules: {lse: 256MiB}, max_bytes: 128MiB}}\n",
     r"pools\.p\.rules\.lse = '256MiB' \(256MiB, from YAML file .*\) is above pools\.p\.max_bytes = 128MiB \(from "
     r"YAML file .*\), so it could never be served; lower pools\.p\.rules\.lse / WSPOOL_POOLS__P__RULES__LSE or "
     r"raise pools\.p\.max_bytes / WSPOOL_POOLS__P__MAX_BYTES"),
    ("pools: {p: {description: [1, 2]}}\n", r"pools\.p\.description = \[1, 2\] .*valid string"),
    ("pools: {p: {description: " + "[" * 8 + "]" * 8 + "}}\n", r"pools\.p\.description = \[\[\[\[\.\.\.\]\]\]\]"),
    ("pools: {p: {growth: sometimes}}\n", r"pools\.p\.growth = 'sometimes'"),
    ("debug_streams: maybe\n", r"debug_streams = 'maybe'"),
]  # fmt: skip

BAD_ENV = [
    ({"WSPOOL_POOLS": "{not json"}, r"invalid environment variable WSPOOL_POOLS = '\{not json': is not valid JSON"),
    ({"WSPOOL_POOLS": "[" * 100_000}, r"invalid environment variable WSPOOL_POOLS = '\[\[\[.*: nests too deeply"),
    ({"WSPOOL_POOLS__P__RULES": "garbage"},
     r"invalid environment variable WSPOOL_POOLS__P__RULES = 'garbage': is not valid JSON .*pools\.p\.rules takes a "
     r"mapping"),
    ({"WSPOOL_POOLS__P": "garbage"}, r"pools\.p = 'garbage' \(from environment variable WSPOOL_POOLS__P\)"),
    ({"WSPOOL_POOLS__P__RULES": "[1, 2]"},
     r"pools\.p\.rules = \[1, 2\] \(from environment variable WSPOOL_POOLS__P__RULES\)"),
    ({"WSPOOL_DEBUG_STREAMS": "maybe"}, r"debug_streams = 'maybe' \(from environment variable WSPOOL_DEBUG_STREAMS\)"),
    ({"WSPOOL_POOLS__P__MAX_BYTES": "lots"}, r"pools\.p\.max_bytes = 'lots' \(from environment variable"),
    ({"WSPOOL_POOLS__P__GROWTH": "0"}, r"pools\.p\.growth = '0' .*positive"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "__import__('os').system('true')"},
     r"WSPOOL_POOLS__P__RULES__DEFAULT\).*calling"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "x" * 2000}, r"longer than 1000 characters"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "10 ** 10 ** 10"}, r"'\*\*' is not allowed"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "0"}, r"must be a positive size"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "1MiB", "WSPOOL_POOLS__P__MAX_BYTES": "1KiB"},
     r"pools\.p\.rules\.default = '1MiB' \(1MiB, from environment variable WSPOOL_POOLS__P__RULES__DEFAULT\) is above "
     r"pools\.p\.max_bytes = 1KiB \(from environment variable WSPOOL_POOLS__P__MAX_BYTES\)"),
    ({"WSPOOL_POOLS": '{"p": {"rules": {"d": "2GiB"}, "max_bytes": "1GiB"}}'},
     r"pools\.p\.rules\.d = '2GiB'.*is above"),
    ({"WSPOOL_CONFIG": "/nonexistent/wspool.yaml"}, r"named by WSPOOL_CONFIG\) does not exist"),
    ({"WSPOOL_CONFIG": "/"}, r"config file / \(named by WSPOOL_CONFIG\) does not exist or is not a file"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "match"), BAD_YAML, ids=range(len(BAD_YAML)))
def test_each_hostile_yaml_file_is_a_config_error(tmp_path: Path, text: str, match: str) -> None:
    """Malformed, unsafe, deep, huge, aliased or out-of-range YAML is a ConfigError that says what is wrong."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_settings(path)


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    """A file that is not UTF-8 is a ConfigError naming the file."""
    path = tmp_path / "c.yaml"
    path.write_bytes(b"pools: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"cannot read config file .*c\.yaml \(given explicitly\)"):
        load_settings(path)


@pytest.mark.parametrize(("env", "match"), BAD_ENV, ids=range(len(BAD_ENV)))
def test_each_hostile_environment_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str
) -> None:
    """A garbage WSPOOL_* value is a ConfigError naming the variable."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match):
        load_settings()


_KEYS = st.one_of(
    st.sampled_from(
        ["pools", "flashinfer_mla", "p", "rules", "default", "lse", "growth", "max_bytes", "description",
         "debug_streams"]
    ),
    st.text(max_size=6),
    st.integers(-3, 3),
)  # fmt: skip
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(["256MiB", "0", "-1MiB", "1.5GiB", "x * 1KiB", "max(x, 1MiB)", "power_of_two", "exact", "32MiB",
                     "1e3", "nan", "10 ** 10", "__import__('os')", "x // 0", "round_up(x, 0)"]),
)  # fmt: skip
_VALUES = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4), max_leaves=16
)
_POOL = st.fixed_dictionaries(
    {},
    optional={
        "rules": st.dictionaries(_KEYS, _VALUES, max_size=3) | _VALUES,
        "growth": _VALUES,
        "max_bytes": _VALUES,
        "description": _VALUES,
    },
)
_DOCUMENTS = st.one_of(
    st.fixed_dictionaries({}, optional={"pools": st.dictionaries(_KEYS, _POOL | _VALUES, max_size=3),
                                        "debug_streams": _VALUES}),
    st.dictionaries(_KEYS, _VALUES, max_size=4),
    _VALUES,
)  # fmt: skip


def _loads_or_config_error(load: Callable[[], wspool.WspoolSettings]) -> None:
    """Load; on success, the settings must also build a registry that resolves every fixed rule."""
    try:
        settings = load()
    except ConfigError:
        return
    reg = wspool.PoolRegistry(settings)
    for name, pool in settings.pools.items():
        for rule in pool.rules:
            try:
                nbytes = reg.resolve(name, rule)
            except ConfigError:
                continue  # an expression rule needs the call's facts
            assert 0 < nbytes <= (pool.max_bytes or 2**50)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(document=_DOCUMENTS)
def test_random_yaml_documents_only_raise_config_errors(tmp_path: Path, document: object) -> None:
    """Any YAML document either loads into a usable configuration or raises ConfigError."""
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(document))
    _loads_or_config_error(lambda: load_settings(path))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_random_yaml_text_only_raises_config_errors(tmp_path: Path, text: str) -> None:
    """Any text as a config file either loads or raises ConfigError (never a YAML or Python error)."""
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _loads_or_config_error(lambda: load_settings(path))


_ENV_NAMES = st.sampled_from(
    ["WSPOOL_POOLS", "WSPOOL_POOLS__P", "WSPOOL_POOLS__P__RULES", "WSPOOL_POOLS__P__RULES__DEFAULT",
     "WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE", "WSPOOL_POOLS__P__MAX_BYTES", "WSPOOL_POOLS__P__GROWTH",
     "WSPOOL_POOLS__P__DESCRIPTION", "WSPOOL_DEBUG_STREAMS", "WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES",
     "WSPOOL_POOLS__P__RULES__DEFAULT__X", "WSPOOL_NOPE"]
)  # fmt: skip
_ENV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
_ENV_VALUES = st.one_of(_ENV_TEXT, _SCALARS.map(str), _DOCUMENTS.map(lambda d: json.dumps(d, default=str))).map(
    lambda v: v.replace("\x00", "").encode("utf-8", "replace").decode()  # what an environment can hold
)


@given(env=st.dictionaries(_ENV_NAMES, _ENV_VALUES, min_size=1, max_size=4))
def test_random_environment_only_raises_config_errors(env: dict[str, str]) -> None:
    """Any WSPOOL_* values either load into a usable configuration or raise ConfigError."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("WSPOOL_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        _loads_or_config_error(load_settings)
