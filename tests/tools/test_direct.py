"""Tests for wspool.tools.direct on the CPU: the decode inputs the direct baseline is measured on."""

from __future__ import annotations

import torch

from wspool.tools.direct import PAGE_SIZE, SM_SCALE, DecodeInputs


def test_decode_inputs_page_a_permutation_of_the_cache() -> None:
    """Every request holds ``length`` tokens on its own pages; the page table is a permutation of the cache's pages."""
    inputs = DecodeInputs(batch=3, heads=4, length=PAGE_SIZE + 5, device=torch.device("cpu"), layers=3, seed=1)
    assert inputs.block_tables.shape == (3, 2) and inputs.block_tables.dtype == torch.int32
    assert sorted(inputs.block_tables.flatten().tolist()) == list(range(6))
    assert inputs.seq_lens.tolist() == [PAGE_SIZE + 5] * 3 and inputs.max_seq_len == PAGE_SIZE + 5
    assert inputs.distinct == 3  # small caches: one per layer, up to the layer count
    assert [tuple(kv.shape) for kv in inputs.kv] == [(6, PAGE_SIZE, 576)] * 3
    assert [tuple(q.shape) for q in inputs.queries] == [(3, 1, 4, 576)] * 3
    assert all(flat.data_ptr() == q.data_ptr() for flat, q in zip(inputs.flat_queries, inputs.queries, strict=True))
    assert SM_SCALE == 1 / 192**0.5


def test_decode_inputs_are_reproducible_from_the_seed() -> None:
    """The same seed gives the same page table and tensors; another seed another page table."""
    cpu = torch.device("cpu")
    first, again = (DecodeInputs(2, 2, 3 * PAGE_SIZE, cpu, layers=2, seed=7) for _ in range(2))
    assert torch.equal(first.block_tables, again.block_tables) and torch.equal(first.kv[1], again.kv[1])
    other = DecodeInputs(2, 2, 3 * PAGE_SIZE, cpu, layers=2, seed=8)
    assert not torch.equal(first.block_tables, other.block_tables)
