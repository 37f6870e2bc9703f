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


class _Allowance:
    """One :meth:`FreezeState.allowing_growth` block: open until the block ends, then closed for good.

    A context copied inside the block (an asyncio task, ``contextvars.copy_context``)
    carries this object, so it sees the block end instead of keeping a copied ``True``.
    """

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = True


class FreezeState:
    """Shared by a registry's pools: growth is refused while ``frozen`` (held, or inside counted blocks).

    ``epoch`` counts freezes, so a pool can tell whether its buffer may be in a
    graph (:meth:`stamp`). A context inside :meth:`allowing_growth` may grow pools
    while frozen, only while that block is open.
    """

    __slots__ = ("_allowed", "_blocks", "_held", "_lock", "_resets", "epoch")

    def __init__(self) -> None:
        self._held = False
        self._blocks = 0
        self._resets = 0
        self._lock = threading.Lock()
        self._allowed: contextvars.ContextVar[_Allowance | None] = contextvars.ContextVar(
            "wspool_growth_allowed", default=None
        )
        self.epoch = 0

    def refuses_growth(self) -> bool:
        """Whether growth is refused to the calling context now: frozen, and outside an open :meth:`allowing_growth`."""
        if not (self._held or self._blocks > 0):
            return False
        allowance = self._allowed.get()
        return allowance is None or not allowance.open

    @contextlib.contextmanager
    def allowing_growth(self) -> Iterator[None]:
        """Let the calling thread or task grow pools inside the block, even while frozen (never while capturing).

        A thread started inside has no allowance; a task or ``asyncio.to_thread`` call made
        inside has it while the block is open, and none once it has ended (an exception too).
        """
        allowance = _Allowance()
        token = self._allowed.set(allowance)
        try:
            yield
        finally:
            allowance.open = False
            self._allowed.reset(token)

    def stamp(self) -> int:
        """Return the epoch a buffer installed now belongs to: ``-1`` while frozen, which no later epoch equals.

        A pool retires, rather than frees, a replaced buffer whose stamp differs from
        :attr:`epoch`: one current when a freeze began, or installed while frozen (under
        :meth:`allowing_growth`). Freezing sets the flag before moving the epoch, so a
        stamp taken meanwhile is either ``-1`` or an epoch the freeze moves past.
        """
        epoch = self.epoch
        return -1 if self._held or self._blocks > 0 else epoch

    @property
    def frozen(self) -> bool:
        """Whether growth is refused now."""
        return self._held or self._blocks > 0

    @frozen.setter
    def frozen(self, value: bool) -> None:
        with self._lock:
            starts = bool(value) and not self.frozen
            self._held = bool(value)
            if starts:
                self.epoch += 1

    def enter(self) -> int:
        """Open a frozen block; returns the token that :meth:`leave` takes."""
        with self._lock:
            starts = not self.frozen
            self._blocks += 1
            if starts:
                self.epoch += 1
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
