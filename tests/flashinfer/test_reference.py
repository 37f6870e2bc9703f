"""Tests for wspool.flashinfer.reference: the fp32 MLA decode and paged-attention references."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.mla_inputs import make_inputs
from tests.helpers.paged_inputs import PagedInputs, make_paged_inputs
from wspool.flashinfer.reference import mla_decode_reference, paged_attention_reference


def _dense_attention(inputs, b: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over request b's tokens gathered page by page, written independently."""
    page_size = inputs.kv_cache.shape[1]
    length = int(inputs.seq_lens[b])
    rows = [inputs.kv_cache[int(inputs.block_tables[b, t // page_size]), t % page_size].float() for t in range(length)]
    keys = torch.stack(rows)
    outs, lses = [], []
    for i in range(q_len):
        visible = length - q_len + i + 1
        q = inputs.query[b, i].float()
        scores = q @ keys[:visible].T * inputs.sm_scale
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.softmax(scores, -1) @ keys[:visible, :512])
    return torch.stack(outs), torch.stack(lses)


def test_reference_matches_independent_attention() -> None:
    """The reference equals attention over pages gathered one token at a time, with ragged lengths."""
    inputs = make_inputs(3, 4, [130, 1, 64], page_size=16)
    out, lse = mla_decode_reference(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )
    assert out.shape == (3, 1, 4, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 1, 4) and lse.dtype == torch.float32
    for b in range(3):
        want_out, want_lse = _dense_attention(inputs, b, 1)
        torch.testing.assert_close(out[b].float(), want_out, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[b], want_lse, atol=1e-4, rtol=1e-5)


def test_reference_is_causal_for_several_query_tokens() -> None:
    """With q_len > 1 each query token sees the cache up to its own position."""
    inputs = make_inputs(2, 2, [40, 9], page_size=8, q_len=3)
    out, lse = mla_decode_reference(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )
    for b in range(2):
        want_out, want_lse = _dense_attention(inputs, b, 3)
        torch.testing.assert_close(lse[b], want_lse, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out[b].float(), want_out, atol=1e-2, rtol=1e-2)


def test_lse_is_natural_log() -> None:
    """The LSE is log base e: exp(scores - lse) sums to one."""
    inputs = make_inputs(1, 1, [5], page_size=8)
    _, lse = mla_decode_reference(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )
    keys = inputs.kv_cache[int(inputs.block_tables[0, 0]), :5].float()
    scores = inputs.query[0, 0, 0].float() @ keys.T * inputs.sm_scale
    assert abs(float(torch.exp(scores - lse[0, 0, 0]).sum()) - 1.0) < 1e-5


def test_request_without_cached_tokens_gets_the_merge_identity() -> None:
    """A request of length 0 (an empty context-parallel share) gets output 0 and LSE -inf; the others are unchanged."""
    inputs = make_inputs(3, 4, [70, 1, 64], page_size=16)
    inputs.seq_lens[1] = 0
    out, lse = mla_decode_reference(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert bool((lse[1] == float("-inf")).all())
    for b in (0, 2):
        want_out, want_lse = _dense_attention(inputs, b, 1)
        torch.testing.assert_close(out[b].float(), want_out, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[b], want_lse, atol=1e-4, rtol=1e-5)


# -- paged attention ---------------------------------------------------------------


def _dense_paged(inputs: PagedInputs, b: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
        want_out, want_lse = _dense_paged(inputs, b, causal)
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
