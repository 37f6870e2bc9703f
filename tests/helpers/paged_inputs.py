"""Random paged-attention inputs: an NHD paged KV cache with shuffled pages, ragged lengths and GQA heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wspool.units import ceil_div


@dataclass
class PagedInputs:
    """One step's tensors (decode when every request has one query row)."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    qo_indptr: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


def make_paged_inputs(
    lengths: list[int],
    *,
    q_lens: list[int] | None = None,
    num_qo_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedInputs:
    """Build inputs whose pages are scattered over the cache, as in a real engine (``q_lens``: rows per request)."""
    q_lens = q_lens if q_lens is not None else [1] * len(lengths)
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [ceil_div(n, page_size) for n in lengths]
    total = sum(pages_per_seq) + 5  # spare pages that no request owns
    order = torch.randperm(total, generator=generator)
    tables = torch.zeros(len(lengths), max(pages_per_seq), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        tables[b, :count] = order[used : used + count]
        used += count
    kv = torch.randn(total, 2, page_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    query = torch.randn(sum(q_lens), num_qo_heads, head_dim, generator=generator).to(dtype)
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedInputs(
        query=query.to(device),
        kv_cache=kv.to(device),
        qo_indptr=qo_indptr.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32).to(device),
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
    )
