"""Tests for wspool.flashinfer.layouts: dense page tables to FlashInfer's CSR form."""

from __future__ import annotations

import torch

from wspool.flashinfer.layouts import page_table_to_csr


def test_csr_keeps_only_live_pages_in_order() -> None:
    """Each request contributes its first ceil(len / page_size) pages, in table order."""
    tables = torch.tensor([[7, 3, 9], [4, 0, 0], [1, 8, 2]], dtype=torch.int32)
    lengths = torch.tensor([33, 1, 16], dtype=torch.int32)
    csr = page_table_to_csr(tables, lengths, page_size=16)
    assert csr.indptr.tolist() == [0, 3, 4, 5]
    assert csr.indices.tolist() == [7, 3, 9, 4, 1]
    assert csr.pages.tolist() == [3, 1, 1]
    assert csr.lengths.dtype == torch.int32 and csr.indices.dtype == torch.int32


def test_int64_inputs_become_int32() -> None:
    """int64 page tables and lengths are converted to the int32 FlashInfer takes."""
    csr = page_table_to_csr(torch.tensor([[5, 6]]), torch.tensor([3]), page_size=2)
    assert csr.indices.tolist() == [5, 6] and csr.indices.dtype == torch.int32
    assert csr.lengths.dtype == torch.int32
