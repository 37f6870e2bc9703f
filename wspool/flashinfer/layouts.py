"""How FlashInfer's MLA kernels carve their workspace, and page tables: their checks and FlashInfer's CSR form.

The fa2/fa3 planned wrapper (Hopper, Ampere) and the trtllm-gen launcher
(Blackwell) carve the float workspace as read from FlashInfer's sources; the
sizes here are what the default profiles' rules compute (docs/kernels.md).
The page-table checks are the ones every plan makes before anything grows; the
CSR conversion runs on the tensors' device without a host sync. Pure
functions; thread-safe.
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
    """Return the bytes FlashInfer's fa2/fa3 MLA ``plan()`` carves from a 16-byte aligned workspace.

    Args:
        sm_count: The device's streaming multiprocessors.
        num_heads: Query heads.
        q_len: Query tokens per request (all requests alike).
        kv_lora_rank: The latent width, FlashInfer's ``head_dim_ckv`` (the output's head dim).
    """
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


def check_int_tensor(name: str, tensor: torch.Tensor, dim: int, device: torch.device) -> None:
    """Check that ``tensor`` is a ``dim``-D integer tensor on ``device`` (the page table's device).

    Raises:
        ValueError: It is not, naming ``name``.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dim or tensor.dtype not in (torch.int32, torch.int64):
        shown = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a {dim}-D int32 tensor, got {shown}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but block_tables is on {device}")


def check_page_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, **sizes: object) -> tuple[torch.device, int]:
    """Check a plan's page table, its lengths and its sizes; return the plan's device and batch size.

    Args:
        block_tables: ``[batch, max_pages]`` integer page ids; their device is the plan's.
        seq_lens: ``[batch]`` integer lengths on the same device.
        **sizes: Each must be a positive integer (``num_heads=...``, ``page_size=...``), checked in order.

    Raises:
        ValueError: A bad argument, named.
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
    """A page table in CSR form; every tensor int32 on the page table's device.

    Attributes:
        indptr: ``[batch + 1]`` offsets of each request's pages in ``indices``.
        indices: ``[live pages]`` page ids.
        lengths: ``[batch]`` token counts.
        pages: ``[batch]`` live pages per request.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor
    pages: torch.Tensor


def page_table_to_csr(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> CSRPageTable:
    """Convert a dense page table (``[batch, max_pages]`` ids, ``[batch]`` lengths) to CSR."""
    return CSRPageTable(*csr_parts(block_tables, seq_lens, page_size, CSRConstants.for_table(block_tables)))


class CSRConstants(NamedTuple):
    """What the conversion needs that depends only on the page table's shape and device.

    Made once per plan: a caller converting every step passes it to
    :func:`csr_parts` and saves the kernel launches and host work of remaking it.

    Attributes:
        zero: ``[1]`` int32 zero (the leading ``indptr`` entry).
        page_positions: ``[1, max_pages]`` page positions ``0 .. max_pages - 1``.
    """

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
    """The conversion, as a plain ``(indptr, indices, lengths, pages)`` tuple (the per-step form).

    Every operation here costs host time once per step, so it uses the fewest
    tensor operations: one add and one divide for the page counts, a cumulative
    sum and a concatenation for the offsets, a comparison and a masked select
    (the host sync) for the live pages.
    """
    lengths = seq_lens.to(torch.int32)
    pages = torch.floor_divide(lengths + (page_size - 1), page_size)
    indptr = torch.cat((constants.zero, torch.cumsum(pages, 0, dtype=torch.int32)))
    live = torch.lt(constants.page_positions, pages.unsqueeze(1))
    return indptr, torch.masked_select(block_tables, live).to(torch.int32), lengths, pages


#: The page-table constants and the ``[batch + 1]`` query offsets of one plan.
StepConstants = tuple[CSRConstants, torch.Tensor]


def step_constants(block_tables: torch.Tensor, batch_size: int, q_len: int, device: torch.device) -> StepConstants:
    """Make what the conversion needs that the plan's shapes fix: made once, never written.

    FlashInfer may keep a reference to the query offsets until the step's last run.
    """
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

    Args:
        graph_capacity: The page capacity of a CUDA-graph plan's fixed buffers; ``None`` for eager plans.

    Raises:
        ValueError: The live pages exceed ``graph_capacity``.
    """
    kv_indptr, kv_indices, lengths, _ = csr_parts(block_tables, seq_lens, page_size, constants[0])
    if graph_capacity is not None and kv_indices.numel() > graph_capacity:
        # Graph mode: FlashInfer copies the metadata into the fixed buffers at plan time.
        raise ValueError(
            f"the page table holds {kv_indices.numel()} live pages, more than the {graph_capacity} "
            f"this CUDA-graph plan was made for; make a new plan"
        )
    return constants[1], kv_indptr, kv_indices, lengths
