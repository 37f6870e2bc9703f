"""Tests for wspool.flashinfer.overflow: FlashInfer's overflow message."""

from __future__ import annotations

from wspool.flashinfer.overflow import parse_overflow

SEED = (
    "RuntimeError: Error in function 'aligned_alloc' at /workspace/include/flashinfer/allocator.h:49: "
    "Buffer overflow when allocating memory for trtllm_gen_softmax_workspace with size 135266304 and "
    "alignment 16, but only 125829120 bytes available in AlignedAllocator. Increase the workspace buffer size."
)
HOPPER = (
    "Buffer overflow when allocating memory for mla_partial_o with size 17301504 and alignment 16, "
    "but only 8388608 bytes available in AlignedAllocator. Increase the workspace buffer size."
)


def test_parses_the_seed_message() -> None:
    """The seed's trtllm-gen overflow parses to its name, size, alignment and bytes available."""
    overflow = parse_overflow(RuntimeError(SEED))
    assert overflow is not None
    assert (overflow.name, overflow.size_bytes, overflow.alignment, overflow.available_bytes) == (
        "trtllm_gen_softmax_workspace", 135266304, 16, 125829120,
    )  # fmt: skip
    # 8 MiB were used before the slab: 128 MiB - 125829120.
    assert overflow.needed_capacity(128 * 2**20) == 8 * 2**20 + 135266304 + 16


def test_parses_the_hopper_message() -> None:
    """The fa3 plan's overflow on an 8 MiB workspace parses, with nothing used before it."""
    overflow = parse_overflow(HOPPER)
    assert overflow is not None
    assert overflow.needed_capacity(8 * 2**20) == 17301504 + 16


def test_other_errors_are_not_overflows() -> None:
    """Any other error text is not an overflow."""
    assert parse_overflow(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert parse_overflow("XQA MLA requires SM120a (CUDA >= 12.8) or SM121a (CUDA >= 12.9)") is None
