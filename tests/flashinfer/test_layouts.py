"""Tests for wspool.flashinfer.layouts: the page-table checks, and dense page tables to FlashInfer's CSR form."""

from __future__ import annotations

import pytest
import torch

from wspool.flashinfer.layouts import check_page_table, page_table_to_csr

TABLES = torch.tensor([[7, 3, 9], [4, 0, 0]], dtype=torch.int32)
LENGTHS = torch.tensor([33, 1], dtype=torch.int32)


def test_a_checked_page_table_gives_its_device_and_batch() -> None:
    """A good page table, lengths and sizes give the table's device and the batch size."""
    assert check_page_table(TABLES, LENGTHS, num_heads=4, page_size=16) == (torch.device("cpu"), 2)


@pytest.mark.parametrize(
    ("tables", "lengths", "sizes", "match"),
    [
        ([[7, 3, 9]], LENGTHS, {}, r"^block_tables must be a 2-D int32 tensor, got list$"),
        (TABLES.float(), LENGTHS, {}, r"^block_tables must be a 2-D int32 tensor, got \(2, 3\)$"),
        (TABLES, LENGTHS[None], {}, r"^seq_lens must be a 1-D int32 tensor, got \(1, 2\)$"),
        (TABLES, LENGTHS[:1], {}, r"^block_tables has 2 rows but seq_lens has 1 entries$"),
        (TABLES, LENGTHS, {"num_heads": 0, "page_size": -1}, r"^num_heads must be a positive integer, got 0$"),
        (TABLES, LENGTHS, {"num_heads": 4, "page_size": True}, r"^page_size must be a positive integer, got True$"),
        (TABLES, LENGTHS, {"max_seq_len": 8.0}, r"^max_seq_len must be a positive integer, got 8.0$"),
    ],
)
def test_each_bad_argument_is_named(tables: object, lengths: object, sizes: dict[str, object], match: str) -> None:
    """A bad page table, lengths or size is a ValueError naming it; sizes are checked in the order given."""
    with pytest.raises(ValueError, match=match):
        check_page_table(tables, lengths, **sizes)  # type: ignore[arg-type]


def test_lengths_on_another_device_are_refused() -> None:
    """Lengths on another device than the page table are named with both devices."""
    with pytest.raises(ValueError, match=r"^seq_lens is on meta, but block_tables is on cpu$"):
        check_page_table(TABLES, LENGTHS.to("meta"))


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
