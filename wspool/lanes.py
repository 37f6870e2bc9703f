"""Lanes: separate buffers of one pool for work that may run concurrently.

Two CUDA streams (or two micro-batches overlapped on them) that share one
workspace race on it. Give each its own lane: a pool is keyed by
``(name, device, lane)`` and lanes never alias. The lane is an argument of
:meth:`~wspool.PoolRegistry.workspace`, or set for a block with
:func:`lane`, a context variable, so it follows threads and asyncio tasks
without leaking between them.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["DEFAULT_LANE", "current_lane", "lane"]

DEFAULT_LANE = "main"

_LANE: contextvars.ContextVar[str] = contextvars.ContextVar("wspool_lane", default=DEFAULT_LANE)

#: The hot path reads the lane through this bound method (no attribute lookups).
current_lane = _LANE.get


@contextmanager
def lane(name: str) -> Iterator[str]:
    """Use lane ``name`` for every request made inside the block (this thread/task only).

    Example:
        >>> with wspool.lane("ubatch1"):
        ...     buf = reg.workspace("flashinfer_mla", device="cuda")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a lane name must be a non-empty string, got {name!r}")
    token = _LANE.set(name)
    try:
        yield name
    finally:
        _LANE.reset(token)
