"""Tests for wspool.pool: lazy growth, growth policies, limits and statistics."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wspool.errors import RuleError, WorkspaceFrozenError, WorkspaceLimitError
from wspool.freeze import FreezeState
from wspool.pool import PoolSpec, WorkspacePool
from wspool.units import MAX_SIZE_BYTES

CPU = torch.device("cpu")
MiB = 2**20


def _pool(rules: dict[str, str] | None = None, **kwargs: object) -> WorkspacePool:
    spec = PoolSpec("p", rules or {"default": "1MiB", "big": "3MiB", "expr": "x * 1KiB"}, **kwargs)  # type: ignore[arg-type]
    return WorkspacePool(spec, CPU)


def test_nothing_is_allocated_before_the_first_request() -> None:
    """A new pool holds no buffer."""
    pool = _pool()
    assert pool.buffer is None
    assert pool.stats().capacity_bytes == 0


def test_buffer_is_zeroed_uint8_of_the_resolved_size() -> None:
    """The first request allocates a zero-filled uint8 buffer of exactly the rule's size."""
    buf = _pool().workspace("default", {})
    assert buf.dtype == torch.uint8
    assert buf.device == CPU
    assert buf.numel() == MiB
    assert int(buf.count_nonzero()) == 0


def test_buffer_grown_under_inference_mode_is_a_normal_tensor() -> None:
    """A first request under torch.inference_mode still gives a buffer kernels may write in place afterwards."""
    pool = _pool()
    with torch.inference_mode():
        buf = pool.workspace("default", {})
    assert not buf.is_inference()
    buf[:16].fill_(7)  # outside inference mode: refused for an inference tensor
    assert int(pool.workspace("default", {})[:16].sum()) == 7 * 16


def test_reuse_and_growth() -> None:
    """Requests that fit reuse the buffer; a larger one grows it; it never shrinks."""
    pool = _pool()
    first = pool.workspace("default", {})
    assert pool.workspace("default", {}).data_ptr() == first.data_ptr()
    bigger = pool.workspace("big", {})
    assert bigger.numel() == 3 * MiB
    assert pool.workspace("default", {}).data_ptr() == bigger.data_ptr()
    stats = pool.stats()
    assert (stats.capacity_bytes, stats.grow_count, stats.request_count) == (3 * MiB, 2, 4)
    assert stats.peak_request_bytes == 3 * MiB
    assert stats.last_grow_reason == "rule big: 3MiB"
    assert dict(stats.requests_by_rule) == {"default": 3, "big": 1}


def test_stats_are_frozen_snapshots() -> None:
    """Statistics are an immutable snapshot that later requests do not change."""
    pool = _pool()
    pool.workspace("default", {})
    snapshot = pool.stats()
    pool.workspace("big", {})
    assert snapshot.capacity_bytes == MiB
    with pytest.raises(AttributeError):
        snapshot.capacity_bytes = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("growth", "requested", "capacity"),
    [
        ("exact", 1000, 1000),
        ("power_of_two", 1000, 1024),
        ("power_of_two", 1024, 1024),
        ("32MiB", 1, 32 * MiB),
        ("32MiB", 33 * MiB, 64 * MiB),
    ],
)
def test_growth_policies(growth: str, requested: int, capacity: int) -> None:
    """Exact, power-of-two and granularity policies round capacities as documented."""
    pool = _pool(growth=growth)
    pool.request(requested)
    assert pool.capacity_bytes == capacity


def test_rounding_never_exceeds_max_bytes() -> None:
    """A request that fits max_bytes is served even if rounding would go above it."""
    pool = _pool(growth="32MiB", max_bytes=40 * MiB)
    pool.request(33 * MiB)
    assert pool.capacity_bytes == 40 * MiB


def test_max_bytes_refuses_and_keeps_the_buffer(caplog: pytest.LogCaptureFixture) -> None:
    """Above max_bytes, growth raises WorkspaceLimitError (a MemoryError); the old buffer stays."""
    pool = _pool(max_bytes=2 * MiB)
    buf = pool.workspace("default", {})
    with (
        caplog.at_level(logging.WARNING, logger="wspool"),
        pytest.raises(
            WorkspaceLimitError,
            match=r"pool 'p' on cpu \(lane main\) needs 3145728 bytes \(3MiB\) for rule big, "
            r"above max_bytes = 2097152 bytes \(2MiB\); raise pools\.p\.max_bytes / WSPOOL_POOLS__P__MAX_BYTES",
        ) as info,
    ):
        pool.workspace("big", {})
    assert isinstance(info.value, MemoryError)
    assert pool.buffer is not None and pool.buffer.data_ptr() == buf.data_ptr()
    assert pool.stats().refused_count == 1
    assert "refused p on cpu" in caplog.text


def test_out_of_memory_keeps_serving_the_old_buffer() -> None:
    """An injected OutOfMemoryError on growth becomes WorkspaceLimitError; the pool keeps its buffer."""
    calls = []

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        calls.append(nbytes)
        if nbytes > MiB:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)

    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB", "big": "3MiB"}), CPU, allocator=allocator)
    buf = pool.workspace("default", {})
    with pytest.raises(WorkspaceLimitError, match=r"could not grow from 1048576 to 3145728 bytes .* out of memory"):
        pool.workspace("big", {})
    assert pool.workspace("default", {}).data_ptr() == buf.data_ptr()
    assert pool.capacity_bytes == MiB
    assert calls == [MiB, 3 * MiB]


def test_frozen_pool_refuses_growth_and_keeps_state() -> None:
    """While frozen, a request that fits is served and one that does not raises; nothing changes."""
    freeze = FreezeState()
    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB", "big": "3MiB"}), CPU, freeze=freeze)
    buf = pool.workspace("default", {})
    freeze.frozen = True
    assert pool.workspace("default", {}).data_ptr() == buf.data_ptr()
    with pytest.raises(
        WorkspaceFrozenError,
        match=r"would have to grow while the registry is frozen: rule big needs 3145728 bytes \(3MiB\), "
        r"1048576 bytes available.*raise pools\.p\.rules\.big / WSPOOL_POOLS__P__RULES__BIG",
    ):
        pool.workspace("big", {})
    assert (pool.capacity_bytes, pool.buffer.data_ptr()) == (MiB, buf.data_ptr())  # type: ignore[union-attr]


def test_unknown_rule_names_the_key() -> None:
    """Asking for a rule the pool lacks names the key to set."""
    with pytest.raises(
        RuleError, match=r"pool 'p' has no rule 'lse' \(rules: big, default, expr\); set pools\.p\.rules\.lse"
    ):
        _pool().workspace("lse", {})


def test_expression_rule_uses_facts() -> None:
    """An expression rule sizes the buffer from the call's facts."""
    pool = _pool()
    assert pool.workspace("expr", {"x": 8}).numel() == 8 * 1024


def test_retired_buffers_are_dropped_unless_captured() -> None:
    """Growth drops an uncaptured buffer, but keeps one marked as captured until release_retired()."""
    capturing = [False]
    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB", "big": "3MiB"}), CPU, capture_probe=lambda: capturing[0])
    pool.workspace("default", {})
    pool.workspace("big", {})
    assert pool.stats().retired_bytes == 0
    capturing[0] = True
    pool.workspace("default", {})  # handed out during a (simulated) CUDA-graph capture
    capturing[0] = False
    pool.request(4 * MiB)
    assert pool.stats().retired_bytes == 3 * MiB
    assert pool.release_retired() == 3 * MiB
    assert pool.stats().retired_bytes == 0


def test_generation_counts_buffer_replacements() -> None:
    """generation increments each time the buffer is replaced, so caches can key on it."""
    pool = _pool()
    assert pool.generation == 0
    pool.workspace("default", {})
    pool.workspace("default", {})
    assert pool.generation == 1
    pool.workspace("big", {})
    assert pool.generation == 2


def test_growth_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Growth is logged on the wspool logger with pool, device, old and new capacity and rule."""
    with caplog.at_level(logging.INFO, logger="wspool"):
        _pool().workspace("big", {})
    assert "pool p on cpu lane main grew 0B -> 3MiB for rule big" in caplog.text


# -- hostile use: re-entry, allocation failures, bad sizes --------------------------------


def _run_with_timeout(target: object, timeout: float = 20.0) -> list[BaseException]:
    """Run ``target`` in a thread; fail (instead of hanging) if it does not finish in ``timeout`` s."""
    import threading

    errors: list[BaseException] = []

    def body() -> None:
        try:
            target()  # type: ignore[operator]
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "deadlock: the call did not return"
    return errors


def test_a_log_handler_that_reads_statistics_does_not_deadlock() -> None:
    """A wspool log handler calling stats() on growth and refusal returns (no lock is held while logging)."""
    pool = _pool(max_bytes=2 * MiB)
    seen: list[int] = []

    class Reader(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(pool.stats().capacity_bytes)

    logger = logging.getLogger("wspool")
    handler, level = Reader(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:

        def body() -> None:
            pool.workspace("default", {})
            with pytest.raises(WorkspaceLimitError):
                pool.workspace("big", {})

        assert _run_with_timeout(body, timeout=5) == []
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == [MiB, MiB]


def test_an_allocator_that_reads_statistics_does_not_deadlock() -> None:
    """An allocator that calls the pool's stats() while allocating returns."""
    pool: WorkspacePool

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        pool.stats()
        return torch.zeros(nbytes, dtype=torch.uint8)

    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB"}), CPU, allocator=allocator)
    assert _run_with_timeout(lambda: pool.workspace("default", {}), timeout=5) == []
    assert pool.capacity_bytes == MiB


def test_concurrent_first_requests_allocate_once_with_the_lock_released() -> None:
    """Threads racing a slow allocator still make one allocation, and stats() answers meanwhile."""
    import threading

    started, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        calls.append(nbytes)
        started.set()
        assert release.wait(20)
        return torch.zeros(nbytes, dtype=torch.uint8)

    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB"}), CPU, allocator=allocator)
    threads = [threading.Thread(target=pool.workspace, args=("default", {}), daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    assert started.wait(20)
    try:
        assert _run_with_timeout(pool.stats, timeout=5) == []  # the lock is free while allocating
    finally:
        release.set()
    for thread in threads:
        thread.join(20)
        assert not thread.is_alive()
    assert calls == [MiB]
    assert pool.stats().request_count == 8


def test_any_allocation_failure_is_a_counted_limit_error() -> None:
    """A RuntimeError from the allocator (a huge CPU allocation) becomes a counted WorkspaceLimitError."""

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        if nbytes > MiB:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory")
        return torch.zeros(nbytes, dtype=torch.uint8)

    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB", "big": "3MiB"}), CPU, allocator=allocator)
    pool.workspace("default", {})
    with pytest.raises(WorkspaceLimitError, match=r"the allocation failed \(RuntimeError: \[enforce fail") as info:
        pool.workspace("big", {})
    assert isinstance(info.value, MemoryError)
    stats = pool.stats()
    assert (stats.refused_count, stats.capacity_bytes) == (1, MiB)
    assert pool.workspace("default", {}).numel() == MiB  # still serving


def test_a_huge_cpu_request_is_a_limit_error() -> None:
    """Real torch: a 2**49-byte CPU buffer cannot be made; the pool refuses and keeps serving."""
    pool = _pool()
    with pytest.raises(WorkspaceLimitError, match="could not grow from 0 to 562949953421312 bytes"):
        pool.request(2**49)
    assert pool.stats().refused_count == 1
    assert pool.workspace("default", {}).numel() == MiB


def test_a_request_above_the_size_limit_is_a_limit_error() -> None:
    """request(2**63) is refused as above wspool's size limit, counted, with nothing allocated."""
    pool = _pool()
    with pytest.raises(WorkspaceLimitError, match=r"above wspool's size limit = 1125899906842624 bytes"):
        pool.request(2**63)
    assert pool.stats().refused_count == 1
    assert pool.buffer is None


@pytest.mark.parametrize("nbytes", [0, -5, True, 1.5, "1MiB", None])
def test_a_request_that_is_not_a_positive_integer_is_an_error(nbytes: object) -> None:
    """request(0), request(-5) and non-integers raise SizeError and are not counted."""
    from wspool.errors import SizeError

    pool = _pool()
    with pytest.raises(SizeError, match="a request needs a positive integer number of bytes"):
        pool.request(nbytes)  # type: ignore[arg-type]
    assert pool.stats().request_count == 0


def test_a_freeze_while_allocating_drops_the_new_buffer() -> None:
    """Frozen while the allocator runs: the request is refused and the new buffer not installed."""
    freeze = FreezeState()

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        freeze.frozen = True  # another thread freezes meanwhile
        return torch.zeros(nbytes, dtype=torch.uint8)

    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB"}), CPU, freeze=freeze, allocator=allocator)
    with pytest.raises(WorkspaceFrozenError, match="while the registry is frozen"):
        pool.workspace("default", {})
    stats = pool.stats()
    assert (pool.buffer, stats.grow_count, stats.refused_count, stats.request_count) == (None, 0, 1, 0)


def test_reserve_of_zero_bytes_is_an_error() -> None:
    """reserve(nbytes=0) raises SizeError and counts no request."""
    import wspool
    from wspool.errors import SizeError

    reg = wspool.PoolRegistry.from_config(None)
    with pytest.raises(SizeError, match="a request needs a positive integer number of bytes, got 0"):
        reg.reserve("flashinfer_mla", "cpu", nbytes=0)
    assert reg.stats("flashinfer_mla", "cpu").request_count == 0


def test_an_allocator_that_asks_its_own_pool_to_grow_is_refused_not_deadlocked() -> None:
    """An allocator re-entering its pool's growth gets an error (the outer growth a WorkspaceLimitError), not a hang."""
    pool: WorkspacePool

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        pool.request(nbytes + 1)
        return torch.zeros(nbytes, dtype=torch.uint8)

    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB"}), CPU, allocator=allocator)
    errors = _run_with_timeout(lambda: pool.workspace("default", {}), timeout=5)
    assert len(errors) == 1 and isinstance(errors[0], WorkspaceLimitError)
    assert "its allocator asked the same pool for memory" in str(errors[0])
    assert pool.buffer is None


def test_a_request_of_thousands_of_digits_is_a_readable_limit_error() -> None:
    """A request far above any device is refused with wspool's own error, its size written readably, nothing lost."""
    from tests.helpers.registry import make_registry

    pool = make_registry({"p": {"rules": {"default": "1KiB"}}}).pool("p", "cpu")
    with pytest.raises(WorkspaceLimitError, match=r"needs 1e\+5000 bytes"):
        pool.request(10**5000)
    assert pool.capacity_bytes == 0 and pool.stats().refused_count == 1


def test_a_request_reason_never_serves_as_a_rule() -> None:
    """A sized request's reason is counted under its own name but is no rule: asking for it by rule is refused."""
    pool = _pool()
    pool.request(100, "warmup")
    for ask in (lambda: pool.workspace("warmup", {}), lambda: pool.ensure("warmup", {}),
                lambda: pool.resolve("warmup", {})):  # fmt: skip
        with pytest.raises(RuleError, match=r"pool 'p' has no rule 'warmup' \(rules: big, default, expr\)"):
            ask()
    assert dict(pool.stats().requests_by_rule) == {"warmup": 1}


def test_a_request_reason_named_like_a_rule_counts_under_that_rule() -> None:
    """request(n, "big") and workspace("big") count in one slot; the rule keeps sizing later calls."""
    pool = _pool()
    pool.request(100, "big")
    pool.workspace("big", {})
    pool.request(200, "big")
    stats = pool.stats()
    assert dict(stats.requests_by_rule) == {"big": 3}
    assert stats.capacity_bytes == 3 * 1024 * 1024  # the rule's size, grown by the workspace() call
    assert pool.resolve("big", {}) == 3 * 1024 * 1024


def _smallest_power_of_two_at_least(nbytes: int) -> int:
    power = 1
    while power < nbytes:
        power *= 2
    return power


@given(
    nbytes=st.one_of(st.integers(1, 1 << 40), st.integers(0, 40).map(lambda k: (1 << k) + 1)),
    growth=st.sampled_from(["exact", "power_of_two", "4KiB", "3MiB"]),
    cap_offset=st.one_of(st.none(), st.integers(-3, 5 * MiB)),
)
def test_capacity_for_holds_the_request_is_minimal_and_keeps_under_a_cap_it_fits(
    nbytes: int, growth: str, cap_offset: int | None
) -> None:
    """capacity_for(n) is the smallest capacity of its policy that holds n, lowered to max_bytes where n fits it."""
    cap = None if cap_offset is None else max(1, nbytes + cap_offset)
    spec = PoolSpec("p", {"default": "1MiB"}, growth=growth, max_bytes=cap)
    granularity = {"4KiB": 4096, "3MiB": 3 * MiB}.get(growth, 1)
    if growth == "power_of_two":
        rounded = _smallest_power_of_two_at_least(nbytes)
    else:
        rounded = (nbytes + granularity - 1) // granularity * granularity
    expected = cap if cap is not None and rounded > cap >= nbytes else rounded
    assert spec.capacity_for(nbytes) == expected
    assert spec.capacity_for(nbytes) >= nbytes


@pytest.mark.parametrize("k", [0, 1, 10, 20])
def test_power_of_two_growth_gives_one_byte_past_a_power_the_next_power(k: int) -> None:
    """A request of 2**k + 1 bytes gets a buffer of 2**(k+1) bytes under power_of_two growth, never 2**k."""
    pool = _pool(growth="power_of_two")
    buffer = pool.request((1 << k) + 1)
    assert buffer.numel() == pool.capacity_bytes == 1 << (k + 1)


@pytest.mark.parametrize("path", ["workspace", "request"])
def test_a_buffer_served_during_a_capture_is_retired_not_freed_when_the_pool_grows(path: str) -> None:
    """A request that fits, served while the probe says a graph captures, keeps that buffer alive past growth."""
    capturing = [False]
    spec = PoolSpec("p", {"default": "1MiB", "big": "2MiB"})
    pool = WorkspacePool(spec, CPU, capture_probe=lambda: capturing[0])

    def serve() -> torch.Tensor:
        return pool.workspace("default", {}) if path == "workspace" else pool.request(MiB)

    serve()
    capturing[0] = True
    captured = serve()
    capturing[0] = False
    pool.request(2 * MiB)
    assert pool.stats().retired_bytes == MiB and captured.numel() == MiB
    assert pool.release_retired() == MiB and pool.stats().retired_bytes == 0


@pytest.mark.parametrize("path", ["workspace", "request"])
def test_a_buffer_never_captured_nor_frozen_is_not_retired_on_growth(path: str) -> None:
    """Without a capture or a freeze, growth drops the old buffer: nothing is retired, nothing to release."""
    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB"}), CPU, capture_probe=lambda: False)
    pool.workspace("default", {}) if path == "workspace" else pool.request(MiB)
    pool.request(2 * MiB)
    assert pool.stats().retired_bytes == 0 and pool.release_retired() == 0


def test_the_peak_request_is_the_largest_served_even_when_it_fits() -> None:
    """peak_request_bytes is the largest request served, whether it grew the buffer or fit one grown ahead."""
    pool = _pool()
    pool.ensure("big", {})  # grows without counting a request
    assert pool.stats().peak_request_bytes == 0
    pool.workspace("default", {})
    assert pool.stats().peak_request_bytes == MiB
    pool.request(2 * MiB)
    assert pool.stats().peak_request_bytes == 2 * MiB
    pool.workspace("expr", {"x": 2560})
    assert pool.stats().peak_request_bytes == 2560 * 1024
    pool.request(MiB)
    pool.workspace("default", {})
    stats = pool.stats()
    assert (stats.peak_request_bytes, stats.capacity_bytes, stats.grow_count) == (2560 * 1024, 3 * MiB, 1)


def test_a_request_of_exactly_a_limit_is_served() -> None:
    """max_bytes and wspool's size limit are inclusive: a request of exactly either grows the buffer to it."""
    capped = _pool(max_bytes=2 * MiB)
    assert capped.request(2 * MiB).numel() == 2 * MiB
    with pytest.raises(WorkspaceLimitError, match="above max_bytes"):
        capped.request(2 * MiB + 1)
    meta = WorkspacePool(
        PoolSpec("p", {"default": "1MiB"}), CPU, allocator=lambda n, _: torch.empty(n, dtype=torch.uint8, device="meta")
    )
    assert meta.request(MAX_SIZE_BYTES).numel() == MAX_SIZE_BYTES
    with pytest.raises(WorkspaceLimitError, match="above wspool's size limit"):
        meta.request(MAX_SIZE_BYTES + 1)
    assert meta.stats().refused_count == 1
