"""Lanes, and a debug check for one buffer handed to two CUDA streams without ordering.

A pool is keyed by ``(name, device, lane)`` and lanes never share memory:
work that may run concurrently takes a lane of its own (:func:`lane`, a
context variable that follows threads and asyncio tasks). With
``debug_streams`` on, :class:`StreamOrderWatch` warns once per pool and pair
of streams that used one buffer without ordering; off, it costs nothing.
"""

from __future__ import annotations

import contextvars
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

__all__ = ["DEFAULT_LANE", "StreamOrderWarning", "StreamOrderWatch", "current_lane", "lane"]


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


class StreamOrderWarning(RuntimeWarning):
    """One pool's buffer was handed to two CUDA streams that are not ordered."""


class _Event(Protocol):
    """The part of :class:`torch.cuda.Event` the watch uses."""

    def record(self, stream: torch.cuda.Stream) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class StreamOrderWatch:
    """Watch one pool's requests for unordered use from two CUDA streams.

    Args:
        where: Names the pool in warnings, e.g. ``"pool 'flashinfer_mla' on cuda:0 (lane main)"``.
        device: The pool's CUDA device; its current stream is the requesting stream.
        current_stream: Returns the requesting stream (default
            ``torch.cuda.current_stream(device)``); tests pass fakes.
        new_event: Makes an event (default :class:`torch.cuda.Event`); tests pass fakes.
    """

    def __init__(
        self,
        where: str,
        device: torch.device,
        *,
        current_stream: Callable[[], Hashable] | None = None,
        new_event: Callable[[], _Event] | None = None,
    ) -> None:
        self.where = where
        self._current_stream: Callable[[], Hashable] = current_stream or (lambda: torch.cuda.current_stream(device))
        self._new_event: Callable[[], _Event] = new_event or torch.cuda.Event
        self._lock = threading.Lock()
        self._last: tuple[Hashable, _Event] | None = None
        self._warned: set[tuple[Hashable, Hashable]] = set()
        self.warning_count = 0
        """Warnings issued so far."""

    def observe(self) -> None:
        """Note a request from the current stream; warn if it races the previous stream's.

        Call outside CUDA-graph capture only.
        """
        stream = self._current_stream()
        event = self._new_event()
        event.record(stream)  # type: ignore[arg-type]
        with self._lock:
            previous = self._last
            self._last = (stream, event)
        if previous is None or previous[0] == stream:
            return
        old_stream, old_event = previous
        if old_event.query():
            return  # the old stream is past its request point: nothing decidable, stay quiet
        event.synchronize()  # wait until the new stream reaches its request point
        if old_event.query():
            return  # the new stream waited for the old one (or the old one just finished)
        self._warn(old_stream, stream)

    def _warn(self, old_stream: Hashable, new_stream: Hashable) -> None:
        with self._lock:
            if (old_stream, new_stream) in self._warned:
                return
            self._warned.add((old_stream, new_stream))
            self.warning_count += 1
        warnings.warn(
            f"wspool: {self.where} was handed to stream {new_stream} while stream {old_stream}, "
            f"which requested the same buffer earlier, had not reached that request on the GPU, and "
            f"{new_stream} did not wait for it: the two streams may use the buffer at the same time. "
            f"Give each stream its own lane (with wspool.lane('...') or lane='...'), or order the "
            f"streams (new.wait_stream(old)) before the request",
            StreamOrderWarning,
            stacklevel=4,
        )
