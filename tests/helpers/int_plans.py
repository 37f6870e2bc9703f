"""How the CPU doubles keep a plan in a wrapper's int workspace, as FlashInfer's planners do.

FlashInfer's ``plan()`` writes its schedule into the wrapper's int workspace
and ``run()`` reads it from there, so two wrappers on one region see each
other's plans. The doubles write the planned lengths into their int
workspace the same way and compute from what they read back, so a plan
overwritten by another wrapper's shows up as a wrong result, and a region too
small for the plan raises FlashInfer's overflow of an int carve.
"""

from __future__ import annotations

import torch

_HEADER = 2  # int32 words: the number of arrays, then the plan's serial number


def int_overflow_message(name: str, size: int, available: int) -> str:
    """FlashInfer's AlignedAllocator error for an int carve, as its plan raises it."""
    return (
        f"Error in function 'aligned_alloc' at allocator.h:85: Buffer overflow when allocating memory for {name} "
        f"with size {size} and alignment 16, but only {available} bytes available in AlignedAllocator. "
        "Increase the workspace buffer size."
    )


def write_plan(int_buffer: torch.Tensor, arrays: list[torch.Tensor], carve: str, serial: int) -> None:
    """Write ``arrays`` (int32) into ``int_buffer`` at offset 0; raise FlashInfer's overflow if it is too small."""
    lengths = [int(a.numel()) for a in arrays]
    words = _HEADER + len(arrays) + sum(lengths)
    if words * 4 > int_buffer.numel():
        raise RuntimeError(int_overflow_message(carve, words * 4, int_buffer.numel()))
    flat = torch.cat(
        [torch.tensor([len(arrays), serial, *lengths], dtype=torch.int32)]
        + [a.to(device="cpu", dtype=torch.int32).reshape(-1) for a in arrays]
    )
    int_buffer[: words * 4].copy_(flat.view(torch.uint8).to(int_buffer.device))


def read_plan(int_buffer: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Return the serial number and the arrays :func:`write_plan` left in ``int_buffer``."""
    head = int_buffer[: _HEADER * 4].cpu().view(torch.int32)
    count, serial = int(head[0]), int(head[1])
    lengths = int_buffer[_HEADER * 4 : (_HEADER + count) * 4].cpu().view(torch.int32).tolist()
    start = (_HEADER + count) * 4
    arrays = []
    for n in lengths:
        arrays.append(int_buffer[start : start + n * 4].cpu().view(torch.int32).clone())
        start += n * 4
    return serial, arrays
