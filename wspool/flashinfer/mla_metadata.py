"""An MLA decode step's metadata in the form FlashInfer's planned wrapper takes.

The page table in CSR form with the query offsets, checked against a CUDA-graph
plan's fixed buffers, and those buffers themselves. Runs once per step, at plan
time, never per layer. Device semantics: the page table's device (one host
sync per conversion). Thread semantics: none shared; the constants are made
once per plan and only read after. Capture semantics: making the constants or
graph buffers allocates, so plans make them before capture.
"""

from __future__ import annotations

import torch

from wspool.flashinfer.page_table import CSRConstants, csr_parts

__all__ = ["StepConstants", "graph_buffers", "step_constants", "wrapper_metadata"]

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


def graph_buffers(
    batch_size: int, max_pages: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CUDA-graph wrapper's fixed index buffers: ``(qo_indptr, kv_indptr, kv_indices, kv_len)``.

    Normal tensors (never inference tensors): FlashInfer copies into them at every plan, in any mode.
    """
    with torch.inference_mode(False):
        return (
            torch.empty(batch_size + 1, dtype=torch.int32, device=device),
            torch.empty(batch_size + 1, dtype=torch.int32, device=device),
            torch.empty(max_pages, dtype=torch.int32, device=device),
            torch.empty(batch_size, dtype=torch.int32, device=device),
        )
