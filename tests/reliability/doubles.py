"""What the CPU reliability tests share: an allocator that counts and fails on demand, threads that report errors.

The allocator makes CPU buffers for any device, so a simulated ``cuda:0`` needs
no GPU; it fails with ``torch.OutOfMemoryError`` above a limit or at random,
as a full device does.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import torch

__all__ = ["CountingAllocator", "fill_with_pattern", "run_threads"]


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


def run_threads(count: int, target: Callable[[int], None]) -> None:
    """Run ``target(index)`` in ``count`` threads, join them all, and re-raise the first error any of them hit."""
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


def fill_with_pattern(buf: torch.Tensor) -> torch.Tensor:
    """Fill ``buf`` with a pattern a reallocation would lose, and return a copy to compare with later."""
    buf.copy_(torch.arange(buf.numel()).remainder(251).to(torch.uint8))
    return buf.clone()
