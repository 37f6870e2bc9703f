"""How FlashInfer's MLA kernels carve their workspace, and page tables: their checks and FlashInfer's CSR form.

The carves follow FlashInfer's fa2/fa3 wrapper and trtllm-gen launcher; the
default profiles' rules compute these sizes (docs/kernels.md). Every plan makes
the page-table checks before anything grows; the CSR conversion runs on the
tensors' device. Pure functions; thread-safe.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from wspool.units import MiB, positive_int, round_up

__all__ = [
    "FA_MLA_WORKSPACE_RULE",
    "LEGACY_COUNTER_PREFIX_BYTES",
    "SOFTMAX_SLAB_RULE",
    "AlignedCarver",
    "CSRConstants",
    "CSRPageTable",
    "StepConstants",
    "carve_trtllm_mla_workspace",
    "check_int_tensor",
    "check_page_table",
    "csr_parts",
    "fa_mla_float_workspace_bytes",
    "page_table_to_csr",
    "softmax_slab_bytes",
    "step_constants",
    "wrapper_metadata",
]


#: The float workspace of FlashInfer's fa2/fa3 MLA plan, as a wspool rule over the call's facts.
FA_MLA_WORKSPACE_RULE = "64 * sm_count * (4 * kv_lora_rank + 8)"


def fa_mla_float_workspace_bytes(*, sm_count: int, num_heads: int, q_len: int, kv_lora_rank: int = 512) -> int:
    """Return the bytes FlashInfer's fa2/fa3 MLA ``plan()`` carves from a 16-byte aligned workspace."""
    cluster_size = 2 if q_len * num_heads > 64 else 1
    rows = (sm_count // cluster_size) * 64 * cluster_size
    partial_o = 2 * rows * 2 * kv_lora_rank
    partial_lse = 2 * rows * 4
    return round_up(partial_o, 16) + partial_lse


#: The softmax slab as a wspool rule over the call's facts.
SOFTMAX_SLAB_RULE = "8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB"

#: The counter FlashInfer 0.6.12-0.6.14 carved first (since 0.6.15 it is a separate buffer).
LEGACY_COUNTER_PREFIX_BYTES = 8 * MiB


def softmax_slab_bytes(num_heads: int, batch_size: int, q_len: int) -> int:
    """Bytes of the softmax slab a trtllm-gen MLA decode with LSE carves first."""
    return 8 * num_heads * batch_size * round_up(q_len, 256) + MiB


class AlignedCarver:
    """Carves aligned regions from a workspace front to back, like FlashInfer's ``AlignedAllocator``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.offset = 0

    def carve(self, name: str, size_bytes: int, alignment: int = 16) -> int:
        """Return the offset of a new region; raise ``RuntimeError`` with FlashInfer's message if it does not fit."""
        start = round_up(self.offset, alignment)
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

    ``counter_prefix_bytes`` is 8 MiB to model FlashInfer 0.6.12-0.6.14. A region
    that does not fit raises ``RuntimeError`` with FlashInfer's overflow message.
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


def check_int_tensor(name: str, tensor: torch.Tensor, dim: int, device: torch.device) -> None:
    """Check that ``tensor`` is a ``dim``-D integer tensor on ``device``, else raise ``ValueError`` naming ``name``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dim or tensor.dtype not in (torch.int32, torch.int64):
        shown = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a {dim}-D int32 tensor, got {shown}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but block_tables is on {device}")


def check_page_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, **sizes: object) -> tuple[torch.device, int]:
    """Check a plan's page table, its lengths and positive ``sizes``; return the plan's device and batch size.

    ``block_tables`` is ``[batch, max_pages]``, ``seq_lens`` ``[batch]``, both integer, on
    the plan's device. A bad argument raises ``ValueError``, naming it.
    """
    # A non-tensor page table fails its check before the device is ever compared.
    device = block_tables.device if isinstance(block_tables, torch.Tensor) else torch.device("cpu")
    check_int_tensor("block_tables", block_tables, 2, device)
    check_int_tensor("seq_lens", seq_lens, 1, device)
    batch_size: int = seq_lens.shape[0]
    if block_tables.shape[0] != batch_size:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has {batch_size} entries")
    for name, value in sizes.items():
        if positive_int(value) is None:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return device, batch_size


class CSRPageTable(NamedTuple):
    """A page table in CSR form (``indptr`` ``[batch + 1]``, ``indices`` of live pages); int32 on its device."""

    indptr: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor
    pages: torch.Tensor


def page_table_to_csr(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> CSRPageTable:
    """Convert a dense page table (``[batch, max_pages]`` ids, ``[batch]`` lengths) to CSR."""
    return CSRPageTable(*csr_parts(block_tables, seq_lens, page_size, CSRConstants.for_table(block_tables)))


class CSRConstants(NamedTuple):
    """What the conversion needs that depends only on the page table's shape and device, made once per plan."""

    zero: torch.Tensor
    page_positions: torch.Tensor

    @classmethod
    def for_table(cls, block_tables: torch.Tensor) -> CSRConstants:
        """The constants for ``block_tables``'s width and device (never inference tensors)."""
        device = block_tables.device
        with torch.inference_mode(False):
            return cls(
                torch.zeros(1, dtype=torch.int32, device=device),
                torch.arange(block_tables.shape[1], device=device).unsqueeze(0),
            )


def csr_parts(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, constants: CSRConstants
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conversion as a plain ``(indptr, indices, lengths, pages)`` tuple, in the fewest tensor operations.

    The masked select of the live pages is the step's one host sync.
    """
    lengths = seq_lens.to(torch.int32)
    pages = torch.floor_divide(lengths + (page_size - 1), page_size)
    indptr = torch.cat((constants.zero, torch.cumsum(pages, 0, dtype=torch.int32)))
    live = torch.lt(constants.page_positions, pages.unsqueeze(1))
    return indptr, torch.masked_select(block_tables, live).to(torch.int32), lengths, pages


#: The page-table constants and the ``[batch + 1]`` query offsets of one plan.
StepConstants = tuple[CSRConstants, torch.Tensor]


def step_constants(block_tables: torch.Tensor, batch_size: int, q_len: int, device: torch.device) -> StepConstants:
    """Make what the conversion needs that the plan's shapes fix, never written (FlashInfer may keep references)."""
    with torch.inference_mode(False):
        offsets = torch.arange(0, (batch_size + 1) * q_len, q_len, dtype=torch.int32, device=device)
    return CSRConstants.for_table(block_tables), offsets


def wrapper_metadata(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    constants: StepConstants,
    graph_capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert the page table to FlashInfer's ``(qo_indptr, kv_indptr, kv_indices, lengths)``, on the device.

    ``graph_capacity`` is the page capacity of a graph plan's fixed buffers; more
    live pages raise ``ValueError``.
    """
    kv_indptr, kv_indices, lengths, _ = csr_parts(block_tables, seq_lens, page_size, constants[0])
    if graph_capacity is not None and kv_indices.numel() > graph_capacity:
        # Graph mode: FlashInfer copies the metadata into the fixed buffers at plan time.
        raise ValueError(
            f"the page table holds {kv_indices.numel()} live pages, more than the {graph_capacity} "
            f"this CUDA-graph plan was made for; make a new plan"
        )
    return constants[1], kv_indptr, kv_indices, lengths
