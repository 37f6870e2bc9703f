"""Page tables in FlashInfer's CSR form, converted on the device.

Engines hold a dense ``block_tables [batch, max_pages]`` and ``seq_lens
[batch]``; FlashInfer's planned wrappers take CSR: an ``indptr`` of pages per
request and the flat list of live page ids. The conversion runs on the page
table's device with one host sync (selecting the live pages).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["CSRConstants", "CSRPageTable", "csr_parts", "page_table_to_csr"]


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
