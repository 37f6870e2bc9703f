"""A debug check: one pool's buffer handed to two CUDA streams with no ordering between them.

Two streams that use one workspace at the same time corrupt each other's
partial results without any error. The fix is a lane per stream
(:func:`wspool.lane`); this module helps find the places that need one. It is
off by default and switched on with ``debug_streams: true`` in the YAML file
or ``WSPOOL_DEBUG_STREAMS=1``; pools on CUDA devices then carry a
:class:`StreamOrderWatch` and call it on every request served outside a
CUDA-graph capture. With the check off, a pool pays nothing for it beyond
one attribute test on CUDA devices.

How it decides. Each request records a CUDA event on the requesting stream:
the point after which that stream may use the buffer. When the next request
of the same pool comes from another stream, wspool cannot see whether the new
stream waited for the old one (``wait_stream``, ``wait_event``), so it looks at
the GPU instead. If the old stream's event is still pending, the host waits
until the *new* stream has reached its own event; if the old event is still
pending then, the new stream got there without waiting for the old one, and
the two may use the buffer at once: one :class:`StreamOrderWarning` is issued
per pool and pair of streams.

The heuristic never warns about correctly ordered streams, but it can miss a
race: when the old stream had already passed its request point by the time
the new stream asks, its kernels may still be running on the buffer and
nothing is reported. Passing the check is not a proof of safety.

Cost, with the check on: one event created and recorded per request (a few
microseconds of host time), and, when the stream changes while the previous
stream's event is pending, a host wait for the new stream to catch up, which
serialises the host with that stream. Use it in tests and debugging runs,
not in production. Requests made while the current stream is capturing are
not checked (event queries are not allowed during capture); nor should the
check run while another thread captures a graph in ``"global"`` capture mode.

Thread semantics: a watch is thread-safe; the host wait runs outside its lock.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Protocol

import torch

__all__ = ["StreamOrderWarning", "StreamOrderWatch"]


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
