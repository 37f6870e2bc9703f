"""Overflow recovery shared by the FlashInfer ops: grow the pool past what a failed carve needed, then retry.

A FlashInfer ``plan()`` or kernel that finds its float workspace too small
raises one of the :mod:`~wspool.flashinfer.refusals` forms (a ``RuntimeError``
from the C++ allocator, a ``ValueError`` from FlashInfer's Python checks). The
op calls :func:`grow_after_overflow` with it; the pool grows once past the need (with
headroom for the carves after the failing one), a warning names the setting to
raise, and the op retries. After :data:`MAX_RECOVERIES` growths the op gives up
with a :class:`~wspool.errors.WorkspaceOverflowError`.

Growth obeys the pool: while the registry is frozen or the stream is
capturing, it raises :class:`~wspool.errors.WorkspaceFrozenError` naming the
bytes needed, and the buffer stays as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Container

import torch

from wspool.errors import WorkspaceOverflowError
from wspool.flashinfer.refusals import WorkspaceRefusal, parse_refusal
from wspool.pool import WorkspacePool
from wspool.units import format_size

__all__ = ["MAX_RECOVERIES", "grow_after_overflow"]

logger = logging.getLogger("wspool")

#: Growths tried for one call before an overflow is reported (each grows past the last need).
MAX_RECOVERIES = 3
_MiB = 1 << 20


def grow_after_overflow(
    exc: Exception,
    *,
    pool: WorkspacePool,
    capacity: int,
    attempt: int,
    op: str,
    rule: str,
    setting: str,
    float_carves: Container[str] | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """Grow ``pool`` past what the overflow in ``exc`` needed; re-raise anything else.

    Args:
        exc: What FlashInfer raised.
        pool: The pool whose buffer the kernel was given.
        capacity: The size of that buffer, in bytes.
        attempt: How many growths this call already made (0 first).
        op: Names the op in messages, e.g. ``"MLA decode"``.
        rule: The rule that sized the call.
        setting: The key to raise, ``"key / ENV_VAR"``.
        float_carves: The carve names that live in the pool's buffer; an overflow
            of any other carve (FlashInfer's own int workspace) is re-raised as
            it is. ``None``: every carve.
        path: The backend the op asked FlashInfer for, to read a refusal that lists several.

    Returns:
        The grown buffer.

    Raises:
        Exception: ``exc`` itself, when it is not a refusal of the pool's buffer, or names no size.
        WorkspaceOverflowError: The call still overflowed after :data:`MAX_RECOVERIES` growths.
        WorkspaceFrozenError: Growth is refused (frozen or capturing).
        WorkspaceLimitError: Growth would pass ``max_bytes`` or the device's memory.
    """
    overflow = parse_refusal(exc, path)
    if (
        overflow is None
        or not overflow.sized
        or (float_carves is not None and overflow.form == "aligned-allocator" and overflow.name not in float_carves)
    ):
        raise exc
    needed = overflow.needed_capacity(capacity)
    # A carve names what was left; a whole-need refusal had the entire buffer to work with.
    available = overflow.available_bytes if overflow.form == "aligned-allocator" else capacity
    name, device = pool.spec.name, pool.device
    if attempt >= MAX_RECOVERIES:
        raise WorkspaceOverflowError(
            f"FlashInfer {op} still overflowed pool {name!r} on {device} after {attempt} growth(s): "
            f"{overflow.name} needs {overflow.size_bytes} bytes with {available} of "
            f"{capacity} available; raise {setting}"
        ) from exc
    # Headroom for the carves after the one that failed, so one retry normally suffices.
    target = -(-(needed + max(needed // 8, _MiB)) // _MiB) * _MiB
    if attempt == 0:
        _warn_growth(op, pool, rule, setting, overflow, available=available, capacity=capacity,
                     target=target, needed=needed)  # fmt: skip
    return pool.grow_to(target, f"overflow recovery ({overflow.name})", setting)


def _warn_growth(
    op: str,
    pool: WorkspacePool,
    rule: str,
    setting: str,
    overflow: WorkspaceRefusal,
    *,
    available: int | None,
    capacity: int,
    target: int,
    needed: int,
) -> None:
    """Say once per call, before growing, what overflowed and which setting to raise."""
    logger.warning(
        "wspool: FlashInfer %s overflowed pool %s on %s (rule %s): %s needed %d bytes, %d available of %s; "
        "growing to %s and retrying. Raise %s to at least %s to avoid this",
        op,
        pool.spec.name,
        pool.device,
        rule,
        overflow.name,
        overflow.size_bytes,
        available,
        format_size(capacity),
        format_size(target),
        setting,
        format_size(needed),
    )
