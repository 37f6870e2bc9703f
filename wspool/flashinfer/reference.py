"""Attention in fp32 with torch: MLA decode and paged attention (the CPU path, the tests' reference), the LSE merge.

MLA layout (DeepSeek / Kimi, matrix-absorbed): ``query [batch, q_len, heads,
kv_lora_rank + rope]``, ``kv_cache [pages, page_size, kv_lora_rank + rope]``.
Paged layout (FlashInfer's NHD): ``kv_cache [pages, 2, page_size, kv_heads,
head_dim]``. The LSE is natural-log, fp32. The references are slow by design;
pure functions.

Under decode context parallelism each rank attends over its share of the KV
cache and returns its output and LSE; :func:`merge_lse_partials` combines them
(softmax over the shares' LSEs). A share whose LSE is ``-inf`` weighs nothing,
a row every share left empty merges to 0 and ``-inf``, and a NaN or ``+inf``
LSE makes its row NaN. It runs on the partials' device with PyTorch's
allocator, stateless, with no host synchronisation, so it can be captured in a
CUDA graph. Use with DCP: docs/multi-gpu.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from wspool.units import ceil_div

__all__ = ["merge_lse_partials", "mla_decode_reference", "mla_decode_reference_into", "paged_attention_reference"]


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


def merge_lse_partials(
    outs: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the partial outputs of attention over disjoint KV shares into the whole's.

    With ``m = max_i lse_i``: ``out = sum_i exp(lse_i - m) * out_i / sum_i exp(lse_i - m)``
    and ``lse = m + log(sum_i exp(lse_i - m))``.

    Args:
        outs: One output per share, each ``[*rows, dim]`` (e.g. ``[batch, q_len,
            heads, kv_lora_rank]`` or packed ``[tokens, heads, kv_lora_rank]``),
            all of one shape, dtype and device; or the same stacked as one
            ``[shares, *rows, dim]`` tensor (what an all-gather gives).
        lses: The shares' natural-log LSEs, each ``[*rows]`` (or stacked
            ``[shares, *rows]``): finite, or ``-inf`` for a row the share has no keys for
            (NaN or ``+inf`` make the row's output and LSE NaN).

    Returns:
        ``(out, lse)``: ``out [*rows, dim]`` in the partials' dtype and
        ``lse [*rows]`` in fp32, natural log.

    Raises:
        ValueError: No shares, different numbers of outputs and LSEs, or
            shapes, dtypes or devices that do not match.
    """
    out_stack, lse_stack = _stacked(outs, "outs"), _stacked(lses, "lses")
    if out_stack.shape[0] != lse_stack.shape[0]:
        raise ValueError(f"merge_lse_partials got {out_stack.shape[0]} outputs but {lse_stack.shape[0]} LSEs")
    if out_stack.dim() < 2 or lse_stack.shape != out_stack.shape[:-1]:
        raise ValueError(
            f"each share's LSE must have its output's shape without the last dimension: outputs "
            f"{tuple(out_stack.shape[1:])}, LSEs {tuple(lse_stack.shape[1:])}"
        )
    if out_stack.device != lse_stack.device:
        raise ValueError(f"the outputs are on {out_stack.device} but the LSEs on {lse_stack.device}")
    for name, tensor in (("outs", out_stack), ("lses", lse_stack)):
        if not tensor.is_floating_point():
            raise ValueError(f"merge_lse_partials: {name} must be floating point, got {tensor.dtype}")
    lse_stack = lse_stack.float()
    # A NaN or +inf LSE is no log-sum-exp: its row has no merge, and must not read as one (a row of zeros).
    invalid = (torch.isnan(lse_stack) | torch.isposinf(lse_stack)).any(dim=0)
    lse_max = lse_stack.amax(dim=0)
    # A row that every share left empty has lse_max = -inf: shift it by 0, since -inf - -inf is NaN.
    shift = torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lse_stack - shift)  # in [0, 1]; 0 exactly for empty shares
    total = weights.sum(dim=0)
    lse = shift + torch.log(total)  # log(0) = -inf for rows that every share left empty
    scale = torch.where(total > 0, weights / total, torch.zeros_like(weights)).unsqueeze(-1)
    # An empty share's output may hold anything (NaN included): select, do not multiply by 0.
    partials = torch.where(scale > 0, out_stack.float(), torch.zeros((), device=out_stack.device))
    out = (partials * scale).sum(dim=0)
    nan = torch.full((), float("nan"), device=out.device)
    out = torch.where(invalid.unsqueeze(-1), nan, out).to(out_stack.dtype)
    return out, torch.where(invalid, nan, lse)


def _stacked(tensors: Sequence[torch.Tensor] | torch.Tensor, name: str) -> torch.Tensor:
    """One ``[shares, ...]`` tensor from a stacked tensor or a sequence of equal tensors."""
    if isinstance(tensors, torch.Tensor):
        if tensors.dim() == 0 or tensors.shape[0] == 0:
            raise ValueError(
                f"merge_lse_partials: stacked {name} must be [shares, ...] with a share, got {tuple(tensors.shape)}"
            )
        return tensors
    shares = list(tensors)
    if not shares:
        raise ValueError(f"merge_lse_partials needs at least one share, got no {name}")
    first = shares[0]
    for i, tensor in enumerate(shares):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"merge_lse_partials: {name}[{i}] is a {type(tensor).__name__}, not a tensor")
        if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError(
                f"merge_lse_partials: {name}[{i}] is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                f"but {name}[0] is {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    return torch.stack(shares)
