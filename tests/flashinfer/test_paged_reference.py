"""Tests for wspool.flashinfer.reference: the fp32 paged-attention reference against dense attention."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.paged_inputs import PagedInputs, make_paged_inputs
from wspool.flashinfer.reference import paged_attention_reference


def _dense(inputs: PagedInputs, b: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One request through torch's scaled_dot_product_attention on its gathered, contiguous KV."""
    length = int(inputs.seq_lens[b])
    first, last = int(inputs.qo_indptr[b]), int(inputs.qo_indptr[b + 1])
    pages = inputs.kv_cache[inputs.block_tables[b].long()].transpose(0, 1).flatten(1, 2)[:, :length].float()
    group = inputs.num_qo_heads // inputs.num_kv_heads
    k = pages[0].repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, length, dim]
    v = pages[1].repeat_interleave(group, dim=1).transpose(0, 1)
    q = inputs.query[first:last].float().transpose(0, 1)  # [heads, rows, dim]
    rows = last - first
    mask = None
    if causal:
        mask = torch.arange(length)[None, :] < (length - rows + 1 + torch.arange(rows)[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) / inputs.head_dim**0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(scores, dim=-1).transpose(0, 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("qo_heads", "kv_heads"), [(8, 8), (8, 2), (12, 1)])
def test_matches_dense_attention(qo_heads: int, kv_heads: int, causal: bool) -> None:
    """Each request equals dense attention over its gathered pages, GQA heads repeated, masked bottom-right."""
    inputs = make_paged_inputs(
        [37, 5, 64, 100], q_lens=[10, 5, 1, 33], num_qo_heads=qo_heads, num_kv_heads=kv_heads, dtype=torch.float32
    )
    out, lse = paged_attention_reference(
        inputs.query, inputs.kv_cache, inputs.qo_indptr, inputs.block_tables, inputs.seq_lens,
        sm_scale=inputs.head_dim**-0.5, causal=causal,
    )  # fmt: skip
    assert out.dtype == torch.float32 and lse.shape == (49, qo_heads)
    for b in range(4):
        want_out, want_lse = _dense(inputs, b, causal)
        rows = slice(int(inputs.qo_indptr[b]), int(inputs.qo_indptr[b + 1]))
        torch.testing.assert_close(out[rows], want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[rows], want_lse, rtol=1e-5, atol=1e-5)


def test_decode_row_sees_the_whole_cache_and_keeps_the_dtype() -> None:
    """One row per request sees every cached token; the output keeps the query's dtype, the LSE is fp32."""
    inputs = make_paged_inputs([1, 17, 48])
    out, lse = paged_attention_reference(
        inputs.query, inputs.kv_cache, inputs.qo_indptr, inputs.block_tables, inputs.seq_lens, sm_scale=0.125
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    single = inputs.kv_cache[inputs.block_tables[0, 0]][1, 0].float().repeat_interleave(4, dim=0)
    torch.testing.assert_close(out[0].float(), single, atol=1e-2, rtol=0)  # one cached token: its value
