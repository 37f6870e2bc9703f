"""How FlashInfer's trtllm-gen MLA decode launcher carves its workspace (Blackwell).

Read from FlashInfer 0.7.2's launcher: the workspace is
``[softmax slab (only when the LSE is returned) | scratch (all the rest)]``
with ``softmax slab = 8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB``.
The scratch is not bounds-checked; about 20-32 MB is used on a B200, so rules
keep headroom. FlashInfer 0.6.12-0.6.14 put an 8 MiB counter in front (which
is why the seed's error said 125829120 bytes were available of 128 MiB).

:class:`AlignedCarver` reproduces FlashInfer's ``AlignedAllocator`` and its
exact overflow message, so the CPU tests and the demo can exercise the same
failure and recovery as a Blackwell GPU would.
"""

from __future__ import annotations

__all__ = [
    "LEGACY_COUNTER_PREFIX_BYTES",
    "SOFTMAX_SLAB_RULE",
    "AlignedCarver",
    "carve_trtllm_mla_workspace",
    "softmax_slab_bytes",
]

MiB = 1 << 20

#: The softmax slab as a wspool rule over the call's facts.
SOFTMAX_SLAB_RULE = "8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB"

#: The counter FlashInfer 0.6.12-0.6.14 carved first (since 0.6.15 it is a separate buffer).
LEGACY_COUNTER_PREFIX_BYTES = 8 * MiB


def softmax_slab_bytes(num_heads: int, batch_size: int, q_len: int) -> int:
    """Bytes of the softmax slab a trtllm-gen MLA decode with LSE carves first."""
    return 8 * num_heads * batch_size * (-(-q_len // 256) * 256) + MiB


class AlignedCarver:
    """Carves aligned regions from a workspace front to back, like FlashInfer's ``AlignedAllocator``.

    Args:
        capacity_bytes: The workspace's size.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.offset = 0

    def carve(self, name: str, size_bytes: int, alignment: int = 16) -> int:
        """Return the offset of a new region.

        Raises:
            RuntimeError: With FlashInfer's exact message when it does not fit.
        """
        start = -(-self.offset // alignment) * alignment
        available = self.capacity_bytes - self.offset
        if start + size_bytes > self.capacity_bytes:
            raise RuntimeError(
                f"Buffer overflow when allocating memory for {name} with size {size_bytes} and alignment "
                f"{alignment}, but only {available} bytes available in AlignedAllocator. "
                f"Increase the workspace buffer size."
            )
        self.offset = start + size_bytes
        return start


def carve_trtllm_mla_workspace(
    capacity_bytes: int,
    *,
    num_heads: int,
    batch_size: int,
    q_len: int,
    return_lse: bool,
    scratch_bytes: int,
    counter_prefix_bytes: int = 0,
) -> dict[str, int]:
    """Carve a workspace as the trtllm-gen launcher does; return each region's offset.

    Args:
        capacity_bytes: The workspace's size.
        num_heads: Query heads.
        batch_size: Requests.
        q_len: Query tokens per request.
        return_lse: Whether the softmax slab is carved.
        scratch_bytes: What the kernel's scratch needs behind the slab.
        counter_prefix_bytes: 8 MiB to model FlashInfer 0.6.12-0.6.14, else 0.

    Raises:
        RuntimeError: FlashInfer's overflow message, when a region does not fit.
    """
    carver = AlignedCarver(capacity_bytes)
    offsets = {}
    if counter_prefix_bytes:
        offsets["multi_ctas_kv_counter"] = carver.carve("multi_ctas_kv_counter", counter_prefix_bytes)
    if return_lse:
        offsets["trtllm_gen_softmax_workspace"] = carver.carve(
            "trtllm_gen_softmax_workspace", softmax_slab_bytes(num_heads, batch_size, q_len)
        )
    offsets["trtllm_gen_scratch"] = carver.carve("trtllm_gen_scratch", scratch_bytes)
    return offsets
