"""Torch implementations of MLA decode and paged attention in fp32: the CPU path and the tests' reference.

MLA layout (DeepSeek / Kimi, matrix-absorbed): ``query [batch, q_len, heads,
kv_lora_rank + rope]``, ``kv_cache [pages, page_size, kv_lora_rank + rope]``.
Paged layout (FlashInfer's NHD): ``kv_cache [pages, 2, page_size, kv_heads,
head_dim]``. The LSE is natural-log, fp32. Slow by design; pure functions.
"""

from __future__ import annotations

import torch

from wspool.units import ceil_div

__all__ = ["mla_decode_reference", "mla_decode_reference_into", "paged_attention_reference"]


def mla_decode_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    kv_lora_rank: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute MLA decode attention in fp32.

    Args:
        query: ``[batch, q_len, heads, kv_lora_rank + rope]``.
        kv_cache: ``[pages, page_size, kv_lora_rank + rope]``.
        block_tables: ``[batch, max_pages]`` integer page ids.
        seq_lens: ``[batch]`` integer cached lengths (the query tokens included).
        sm_scale: The softmax scale.
        kv_lora_rank: Width of the latent (value) part of each row.

    Returns:
        ``(out, lse)``: ``out [batch, q_len, heads, kv_lora_rank]`` in the
        query's dtype and ``lse [batch, q_len, heads]`` in fp32, natural log.
    """
    batch, q_len, heads, _ = query.shape
    page_size = kv_cache.shape[1]
    out = torch.empty(batch, q_len, heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    lse = torch.empty(batch, q_len, heads, dtype=torch.float32, device=query.device)
    lengths = seq_lens.tolist()
    tables = block_tables.to(torch.long)
    for b, length in enumerate(lengths):
        pages = ceil_div(length, page_size)
        # The row width is explicit: a request with no cached tokens (an empty context-parallel share) has 0 rows.
        rows = kv_cache[tables[b, :pages]].reshape(pages * page_size, kv_cache.shape[-1])[:length].float()
        q = query[b].float()  # [q_len, heads, dim]
        scores = torch.einsum("qhd,ld->qhl", q, rows) * sm_scale
        if q_len > 1:
            visible = torch.arange(length, device=query.device)[None, :] < (
                length - q_len + 1 + torch.arange(q_len, device=query.device)[:, None]
            )
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        lse[b] = torch.logsumexp(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("qhl,ld->qhd", probs, rows[:, :kv_lora_rank]).to(query.dtype)
    return out, lse


def mla_decode_reference_into(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    *,
    sm_scale: float,
    kv_lora_rank: int,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`mla_decode_reference` in a plan's form: into ``out``/``lse`` where given, the LSE only if asked."""
    ref_out, ref_lse = mla_decode_reference(
        query, kv_cache, block_tables, seq_lens, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank
    )
    if out is not None:
        out.copy_(ref_out)
        ref_out = out
    if not return_lse:
        return ref_out
    if lse is not None:
        lse.copy_(ref_lse)
        ref_lse = lse
    return ref_out, ref_lse


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute paged attention in fp32.

    Args:
        query: ``[tokens, qo_heads, head_dim]``.
        kv_cache: ``[pages, 2, page_size, kv_heads, head_dim]``.
        qo_indptr: ``[batch + 1]`` integer offsets of each request's query rows.
        block_tables: ``[batch, max_pages]`` integer page ids.
        seq_lens: ``[batch]`` integer cached lengths (the query tokens included).
        sm_scale: The softmax scale.
        causal: Mask each query row to the tokens up to its own position.

    Returns:
        ``(out, lse)``: ``out [tokens, qo_heads, head_dim]`` in the query's dtype
        and ``lse [tokens, qo_heads]`` in fp32, natural log.
    """
    tokens, qo_heads, head_dim = query.shape
    page_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = qo_heads // kv_heads
    out = torch.empty_like(query)
    lse = torch.empty(tokens, qo_heads, dtype=torch.float32, device=query.device)
    starts = qo_indptr.tolist()
    tables = block_tables.to(torch.long)
    for b, length in enumerate(seq_lens.tolist()):
        first, last = starts[b], starts[b + 1]
        rows = last - first
        if rows == 0:
            continue
        pages = ceil_div(length, page_size)
        kv = kv_cache[tables[b, :pages]].transpose(0, 1).reshape(2, pages * page_size, kv_heads, head_dim)
        keys = kv[0, :length].float().repeat_interleave(group, dim=1)  # [length, qo_heads, head_dim]
        values = kv[1, :length].float().repeat_interleave(group, dim=1)
        q = query[first:last].float()  # [rows, qo_heads, head_dim]
        scores = torch.einsum("qhd,lhd->hql", q, keys) * sm_scale
        if causal:
            visible = torch.arange(length, device=query.device)[None, :] < (
                length - rows + 1 + torch.arange(rows, device=query.device)[:, None]
            )
            scores = scores.masked_fill(~visible[None], float("-inf"))
        lse[first:last] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        probs = torch.softmax(scores, dim=-1)
        out[first:last] = torch.einsum("hql,lhd->qhd", probs, values).to(query.dtype)
    return out, lse
