"""The freeze a registry's pools share, and the probe that tells a pool it is under CUDA-graph capture.

A pool refuses to grow while its :class:`FreezeState` is frozen or while its
capture probe answers true, so no buffer a graph uses is ever replaced.
Thread semantics: :class:`FreezeState` is thread-safe; the probe reads the
calling thread's current stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["FreezeState", "cuda_capture_probe"]


class FreezeState:
    """Shared by a registry's pools: growth is refused while ``frozen``.

    Frozen while :meth:`freeze` holds it or any ``frozen()`` block is open (the
    blocks are counted, so blocks overlapping across threads keep the freeze
    until the last one closes). ``epoch`` counts the times it became frozen, so a
    pool can tell at growth whether its buffer was current during a freeze (and
    so may be in a graph).
    """

    __slots__ = ("_blocks", "_held", "_lock", "_resets", "epoch")

    def __init__(self) -> None:
        self._held = False
        self._blocks = 0
        self._resets = 0
        self._lock = threading.Lock()
        self.epoch = 0

    @property
    def frozen(self) -> bool:
        """Whether growth is refused now."""
        return self._held or self._blocks > 0

    @frozen.setter
    def frozen(self, value: bool) -> None:
        with self._lock:
            if value and not self.frozen:
                self.epoch += 1
            self._held = bool(value)

    def enter(self) -> int:
        """Open a frozen block; returns the token that :meth:`leave` takes."""
        with self._lock:
            if not self.frozen:
                self.epoch += 1
            self._blocks += 1
            return self._resets

    def leave(self, token: int) -> None:
        """Close a block opened by :meth:`enter` (a no-op after :meth:`clear`)."""
        with self._lock:
            if token == self._resets and self._blocks > 0:
                self._blocks -= 1

    def clear(self) -> None:
        """Unfreeze completely; blocks open now no longer count."""
        with self._lock:
            self._held = False
            self._blocks = 0
            self._resets += 1


def cuda_capture_probe(device: torch.device) -> Callable[[], bool]:
    """Return a cheap "is the current stream capturing a CUDA graph?" for ``device``'s pools.

    The legacy default stream (raw handle 0) cannot be captured, so on it the
    probe answers with one call that reads the current stream instead of
    asking CUDA for the capture status, which costs more; any other stream is
    asked.
    """
    index = device.index if device.index is not None else 0
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    capturing = torch.cuda.is_current_stream_capturing
    if raw_stream is None:  # pragma: no cover - every torch this project supports has it
        return capturing

    def probe() -> bool:
        return raw_stream(index) != 0 and capturing()

    return probe
