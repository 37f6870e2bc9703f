"""Tests for wspool.flashinfer.refusals: growth past an overflow, other errors untouched, giving up."""

from __future__ import annotations

import logging

import pytest

import wspool
from tests.helpers.paged_doubles import overflow_message
from wspool.errors import WorkspaceOverflowError
from wspool.flashinfer.refusals import MAX_RECOVERIES, grow_after_overflow

MiB = 1 << 20
SETTING = "pools.p.rules.default / WSPOOL_POOLS__P__RULES__DEFAULT"


def _pool() -> wspool.WorkspacePool:
    registry = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "4MiB"}}})
    pool = registry.pool("p", "cpu")
    pool.workspace("default", {})
    return pool


def _grow(pool: wspool.WorkspacePool, exc: RuntimeError, attempt: int = 0, **kwargs: object) -> object:
    return grow_after_overflow(
        exc, pool=pool, capacity=pool.capacity_bytes, attempt=attempt, op="test op", rule="default",
        setting=SETTING, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_grows_past_the_need_with_headroom() -> None:
    """The pool grows to the capacity the carve needed plus an eighth (at least 1MiB), rounded to MiB."""
    pool = _pool()
    grown = _grow(pool, RuntimeError(overflow_message("tmp_v", 10 * MiB, 3 * MiB)))
    needed = 4 * MiB - 3 * MiB + 10 * MiB + 16
    assert grown is pool.buffer and pool.capacity_bytes == -(-(needed + needed // 8) // MiB) * MiB
    assert pool.stats().last_grow_reason.startswith("overflow recovery (tmp_v)")  # type: ignore[union-attr]


def test_other_errors_and_foreign_carves_are_raised_as_they_are() -> None:
    """Anything but an overflow, or an overflow of a carve outside float_carves, is re-raised unchanged."""
    pool = _pool()
    other = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as info:
        _grow(pool, other)
    assert info.value is other
    foreign = RuntimeError(overflow_message("int_buffer_indices", 9 * MiB, 8 * MiB))
    with pytest.raises(RuntimeError, match="int_buffer_indices"):
        _grow(pool, foreign, float_carves={"tmp_v"})
    assert pool.capacity_bytes == 4 * MiB


def test_gives_up_after_the_last_recovery() -> None:
    """At MAX_RECOVERIES growths the overflow is reported with the setting to raise."""
    pool = _pool()
    exc = RuntimeError(overflow_message("tmp_v", 10 * MiB, 3 * MiB))
    with pytest.raises(WorkspaceOverflowError, match=r"test op still overflowed pool 'p' on cpu after 3 growth.*"
                       r"WSPOOL_POOLS__P__RULES__DEFAULT"):  # fmt: skip
        _grow(pool, exc, attempt=MAX_RECOVERIES)


def test_headroom_stops_at_max_bytes(caplog: pytest.LogCaptureFixture) -> None:
    """A 60MiB need on a pool capped at 64MiB is served at the cap: the headroom never asks past max_bytes."""
    registry = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "4MiB"}, "max_bytes": "64MiB"}})
    pool = registry.pool("p", "cpu")
    pool.workspace("default", {})
    with caplog.at_level(logging.WARNING, logger="wspool"):
        grown = _grow(pool, RuntimeError(overflow_message("tmp_v", 60 * MiB, 4 * MiB)))
    assert grown is pool.buffer and pool.capacity_bytes == 64 * MiB
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "tmp_v needed 62914560 bytes, 4194304 available of 4MiB; growing to 64MiB and retrying" in warning


@pytest.mark.parametrize("digits", [17, 400, 5000])
def test_an_absurd_refusal_is_raised_as_it_is(digits: int) -> None:
    """A refusal naming more bytes than any device holds is re-raised unchanged; the pool does not grow."""
    pool = _pool()
    absurd = RuntimeError(
        f"Buffer overflow when allocating memory for tmp_v with size {'9' * digits} and alignment 16, "
        f"but only 4194304 bytes available in AlignedAllocator. Increase the workspace buffer size."
    )
    with pytest.raises(RuntimeError) as info:
        _grow(pool, absurd)
    assert info.value is absurd and pool.capacity_bytes == 4 * MiB
