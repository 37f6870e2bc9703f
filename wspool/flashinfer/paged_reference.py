"""A torch implementation of paged attention (GQA decode and prefill) in fp32: the CPU path and the tests' reference.

Layout (FlashInfer's NHD paged KV cache): ``kv_cache [pages, 2, page_size,
kv_heads, head_dim]`` with keys at ``[:, 0]`` and values at ``[:, 1]``;
``query [tokens, qo_heads, head_dim]`` holds the query tokens of every request
back to back, request ``b`` owning rows ``qo_indptr[b]:qo_indptr[b + 1]``. Query
head ``h`` reads KV head ``h // (qo_heads // kv_heads)`` (grouped-query
attention). Request ``b`` has ``seq_lens[b]`` cached tokens, the new ones
included, in pages ``block_tables[b, :ceil(seq_lens[b] / page_size)]``. With
``causal``, query row ``i`` of a request of ``n`` rows sees the first
``seq_len - n + i + 1`` tokens (the new tokens are the last ones). Decode is
the case of one query row per request. The LSE is the natural-log log-sum-exp
of the scaled scores.

Runs on whatever device its inputs are on; allocates its own temporaries.
"""

from __future__ import annotations

import torch

__all__ = ["paged_attention_reference"]


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
        pages = -(-length // page_size)
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
