"""When a pool may grow: the registry's freeze, a context's growth allowance, and CUDA-graph capture.

:func:`cuda_capture_probe` tells, cheaply enough to ask per call, whether the
calling thread's stream is capturing. Thread-safe; the allowance is a context variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import types
from collections.abc import Callable, Iterator

import torch

__all__ = ["TORCH_NAMES_READ_FROM", "FreezeState", "cuda_capture_probe", "cuda_stream_functions"]


class FreezeState:
    """Shared by a registry's pools: growth is refused while ``frozen`` (held, or inside counted blocks).

    ``epoch`` counts freezes, so a pool can tell whether its buffer may be in a
    graph. A context inside :meth:`allowing_growth` may grow pools while frozen.
    """

    __slots__ = ("_allowed", "_blocks", "_held", "_lock", "_resets", "epoch")

    def __init__(self) -> None:
        self._held = False
        self._blocks = 0
        self._resets = 0
        self._lock = threading.Lock()
        self._allowed: contextvars.ContextVar[bool] = contextvars.ContextVar("wspool_growth_allowed", default=False)
        self.epoch = 0

    def refuses_growth(self) -> bool:
        """Whether growth is refused to the calling context now: frozen, and not inside :meth:`allowing_growth`."""
        return (self._held or self._blocks > 0) and not self._allowed.get()

    @contextlib.contextmanager
    def allowing_growth(self) -> Iterator[None]:
        """Let the calling thread or task grow pools inside the block, even while frozen (never while capturing)."""
        token = self._allowed.set(True)
        try:
            yield
        finally:
            self._allowed.reset(token)

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


#: The torch releases whose private names :func:`cuda_stream_functions` reads were read from.
TORCH_NAMES_READ_FROM = "torch 2.11, 2.13 and 2.14 (CUDA builds; a CPU build lacks them)"


def cuda_stream_functions() -> tuple[Callable[[int], int] | None, Callable[[], bool] | None]:
    """Return torch's C functions ``_cuda_getCurrentRawStream(index)`` and ``_cuda_isCurrentStreamCapturing()``.

    ``torch.cuda.current_stream`` and ``torch.cuda.is_current_stream_capturing`` are
    Python functions around them; a probe asked per call calls the C functions
    (:data:`TORCH_NAMES_READ_FROM`). Each is ``None`` where torch lacks it or has
    only a CPU build's placeholder.
    """
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    return (
        raw_stream if isinstance(raw_stream, types.BuiltinFunctionType) else None,
        capturing if isinstance(capturing, types.BuiltinFunctionType) else None,
    )


def cuda_capture_probe(device: torch.device) -> Callable[[], bool]:
    """Return a cheap "is the current stream capturing a CUDA graph?" (never on the legacy default stream)."""
    index = device.index if device.index is not None else 0
    raw_stream, capturing = cuda_stream_functions()
    if capturing is None:
        capturing = torch.cuda.is_current_stream_capturing
    if raw_stream is None:
        return capturing

    def probe() -> bool:
        return raw_stream(index) != 0 and capturing()

    # Its parts, for a caller that asks per call and can spare the closure's frame (bound handles).
    probe.cuda_parts = (raw_stream, index, capturing)  # type: ignore[attr-defined]
    return probe
