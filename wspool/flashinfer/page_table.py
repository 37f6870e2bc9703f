"""Page tables in FlashInfer's CSR form, converted on the device.

Engines hold a dense ``block_tables [batch, max_pages]`` and ``seq_lens
[batch]``; FlashInfer's planned wrappers take CSR: an ``indptr`` of pages per
request and the flat list of live page ids. The conversion runs on the page
table's device with one host sync (selecting the live pages).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["CSRPageTable", "page_table_to_csr"]


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
    lengths = seq_lens.to(torch.int32)
    pages = (lengths + page_size - 1) // page_size
    indptr = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(pages, 0, out=indptr[1:])
    live = torch.arange(block_tables.shape[1], device=lengths.device)[None, :] < pages[:, None]
    return CSRPageTable(indptr, block_tables[live].to(torch.int32), lengths, pages)
