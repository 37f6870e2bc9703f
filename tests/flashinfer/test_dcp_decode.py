"""Decode context parallelism on the CPU: MLA decode (the reference path) per KV share, merged by the LSEs.

The CPU runs what each DCP rank runs, through ``mla_decode`` on its reference
path, so CI exercises the split and the merge; tests/flashinfer/test_dcp_decode_gpu.py
runs the same with FlashInfer's kernel.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dcp_shares import RAGGED_LENGTHS, decode_by_shares, split_into_shares
from tests.helpers.mla_inputs import MLAInputs, make_inputs
from wspool.flashinfer import mla_decode_reference

PAGE = 64
#: Requests of 9 to 13 pages: every share of every request holds tokens, up to cp_world 8.
LONG = [8 * PAGE + 37 * i + 1 for i in range(8)]
LAYOUTS = {"ragged": RAGGED_LENGTHS, "long": LONG}


def _inputs(lengths: list[int], dtype: torch.dtype, heads: int = 16) -> MLAInputs:
    return make_inputs(len(lengths), heads, lengths, page_size=PAGE, dtype=dtype, seed=len(lengths))


def _whole(inputs: MLAInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_decode_reference(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("cp_world", [2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shares_partition_every_request(layout: str, cp_world: int) -> None:
    """The shares' pages, in rank order, are each request's pages, and their lengths add up to its length."""
    inputs = _inputs(LAYOUTS[layout], torch.bfloat16)
    shares = split_into_shares(inputs, cp_world)
    for b, length in enumerate(inputs.seq_lens.tolist()):
        pages = -(-length // PAGE)
        lengths = [int(s.seq_lens[b]) for s in shares]
        joined = torch.cat([s.block_tables[b, : -(-n // PAGE)] for s, n in zip(shares, lengths, strict=True)])
        assert sum(lengths) == length
        assert torch.equal(joined, inputs.block_tables[b, :pages])
        assert all(n % PAGE == 0 for n in lengths[:-1] if n)  # only the share with the last page is partial
    lengths = [[int(n) for n in s.seq_lens] for s in shares]
    if layout == "ragged":  # what the merge must handle: empty shares and shares shorter than a page
        assert any(n == 0 for share in lengths for n in share)
        assert any(0 < n < PAGE for share in lengths for n in share)
    else:
        assert all(n > 0 for share in lengths for n in share)


@pytest.mark.parametrize("cp_world", [2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_merged_fp32_shares_equal_the_whole_cache(layout: str, cp_world: int) -> None:
    """With fp32 inputs, merged per-share decodes equal the whole cache's decode to fp32 rounding."""
    inputs = _inputs(LAYOUTS[layout], torch.float32)
    out, lse, partials = decode_by_shares(inputs, cp_world)
    want_out, want_lse = _whole(inputs)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape and len(partials) == cp_world
    assert _rel_err(out, want_out) < 1e-5
    assert float((lse - want_lse).abs().max()) < 1e-4


@pytest.mark.parametrize("cp_world", [2, 4, 8])
def test_merged_bf16_shares_stay_within_bf16_rounding(cp_world: int) -> None:
    """With bf16 inputs, merged decodes are within two bf16 roundings of the whole cache's fp32 result.

    Each share's output is rounded to bf16 once (relative error at most 2**-8
    per element) and the fp32 merge is rounded once more, so the merged output
    is within 2 * 2**-8 (7.8e-3) of the whole cache's fp32 attention, norm-wise;
    the LSEs never leave fp32.
    """
    inputs = _inputs(RAGGED_LENGTHS, torch.bfloat16)
    out, lse, _ = decode_by_shares(inputs, cp_world)
    whole_out, whole_lse = _whole(inputs)  # rounded to bf16 once
    fp32_out = _fp32_whole(inputs)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert _rel_err(out, fp32_out) < 2 * 2**-8
    assert _rel_err(whole_out, fp32_out) < 2**-8
    assert float((lse - whole_lse).abs().max()) < 1e-4


def _fp32_whole(inputs: MLAInputs) -> torch.Tensor:
    """The whole cache's attention output in fp32 (the reference computes in fp32, then rounds to the query's dtype)."""
    return mla_decode_reference(
        inputs.query.float(), inputs.kv_cache.float(), inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )[0]
