"""GPU tests for wspool.flashinfer.mla_decode: plan reuse, and decode context parallelism on one GPU.

``mla_decode`` never runs a stale plan: after in-place edits, a new batch or
a grown pool its results stay the reference's. For DCP, each KV share is
decoded as its DCP rank would decode it (the queries of all 128 heads,
``return_lse=True``), one after another on one device; the merged result is
checked against one decode of the whole cache and against the fp32 reference.

Tolerances, from bf16: the queries and the cache are bf16 on every side. The
kernel rounds the attention probabilities to bf16 for the PV product and its
output to bf16 (relative error up to 2**-8 = 3.9e-3 per element each), which
is why a single decode is held to a norm-wise relative error below 1e-2
against the fp32 reference (tests/flashinfer/test_mla_gpu.py). The merge adds
one bf16 rounding of each share's output and one of the merged output, at most
2 * 2**-8 more, norm-wise; the measured errors stay well inside the same 1e-2
bound, which the merged output must meet against both the reference and the
whole-cache decode. The LSE never leaves fp32 (the kernel's base-2 LSE is
converted to the natural log, the merge's exp and log run in fp32): it is held
to 1e-3 absolute, as a single decode's is.
"""

from __future__ import annotations

import pytest
import torch

import wspool
from tests.helpers.dcp_shares import RAGGED_LENGTHS, decode_by_shares, split_into_shares
from tests.helpers.mla_inputs import MLAInputs, make_inputs, mla_reference, run_mla_decode
from wspool.flashinfer import mla_decode, mla_decode_reference, select_path
from wspool.flashinfer.reference import merge_lse_partials

pytestmark = pytest.mark.gpu

HEADS = 128
#: Requests of 65 to 69 pages: every share of every request holds tokens, up to cp_world 8.
LONG = [4096 + 37 * i + 1 for i in range(8)]
LAYOUTS = {"ragged": RAGGED_LENGTHS, "long": LONG}
OUT_REL, LSE_ABS = 1e-2, 1e-3


def _inputs(lengths: list[int], seed: int = 0) -> MLAInputs:
    return make_inputs(len(lengths), HEADS, lengths, page_size=64, dtype=torch.bfloat16, device="cuda", seed=seed)


def _decode(inputs: MLAInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_decode(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
        sm_scale=inputs.sm_scale, return_lse=True,
    )  # fmt: skip


def _fp32_reference(inputs: MLAInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole cache's attention in fp32, output unrounded (the bf16 inputs are exact in fp32)."""
    return mla_decode_reference(
        inputs.query.float(), inputs.kv_cache.float(), inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_plan_reuse_is_never_stale() -> None:
    """In-place edits of lengths and pages, a new batch and a grown pool all give reference results."""
    inputs = make_inputs(8, 16, [1000 + 10 * i for i in range(8)], device="cuda")
    run_mla_decode(inputs)
    inputs.seq_lens[3] -= 500
    assert _rel_err(run_mla_decode(inputs), mla_reference(inputs)[0]) < 1e-2  # type: ignore[arg-type]
    inputs.block_tables[0] = inputs.block_tables[0].flip(0)
    assert _rel_err(run_mla_decode(inputs), mla_reference(inputs)[0]) < 1e-2  # type: ignore[arg-type]
    wspool.get_registry().reserve("flashinfer_mla", device="cuda", nbytes="300MiB")
    assert _rel_err(run_mla_decode(inputs), mla_reference(inputs)[0]) < 1e-2  # type: ignore[arg-type]
    other = make_inputs(3, 16, [5, 600, 70], device="cuda", seed=3)
    assert _rel_err(run_mla_decode(other), mla_reference(other)[0]) < 1e-2  # type: ignore[arg-type]


def test_request_without_tokens_gets_the_merge_identity() -> None:
    """FlashInfer's decode of a request with no cached tokens (an empty share) gives LSE -inf (and output 0)."""
    inputs = _inputs([70, 1000, 5])
    inputs.seq_lens[1] = 0
    out, lse = _decode(inputs)
    want_out, want_lse = _fp32_reference(inputs)
    torch.cuda.synchronize()
    print(f"\nempty request: LSE {lse[1].unique().tolist()}, output max |x| {float(out[1].abs().max())}", end="")
    assert bool((lse[1] == float("-inf")).all()), "an empty share's LSE must be -inf for the merge to ignore it"
    if select_path(inputs.block_tables.device) != "trtllm-gen":  # trtllm-gen leaves such output rows unwritten
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 2]
    assert _rel_err(out[keep], want_out[keep]) < OUT_REL
    assert float((lse[keep] - want_lse[keep]).abs().max()) < LSE_ABS


@pytest.mark.parametrize("cp_world", [2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_merged_shares_match_one_decode_and_the_fp32_reference(layout: str, cp_world: int) -> None:
    """Shares decoded with their LSEs and merged match one decode of the whole cache and the fp32 reference."""
    inputs = _inputs(LAYOUTS[layout], seed=cp_world)
    shares = split_into_shares(inputs, cp_world)
    lengths = [int(n) for share in shares for n in share.seq_lens]
    if layout == "ragged":  # the cases the merge must get right, present in this very run
        assert 0 in lengths and any(0 < n < 64 for n in lengths)
    out, lse, partials = decode_by_shares(inputs, cp_world)
    whole_out, whole_lse = _decode(inputs)
    want_out, want_lse = _fp32_reference(inputs)
    for share, (_, share_lse) in zip(shares, partials, strict=True):
        empty = share.seq_lens == 0
        assert bool((share_lse[empty] == float("-inf")).all())  # what makes an empty share weigh nothing
    errors = {
        "merged vs fp32": _rel_err(out, want_out),
        "merged vs one decode": _rel_err(out, whole_out),
        "one decode vs fp32": _rel_err(whole_out, want_out),
    }
    lse_errors = {
        "merged vs fp32": float((lse - want_lse).abs().max()),
        "merged vs one decode": float((lse - whole_lse).abs().max()),
    }
    shown = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    shown_lse = ", ".join(f"{k} {v:.2e}" for k, v in lse_errors.items())
    print(f"\nDCP cp_world={cp_world} {layout}: out rel err {shown}; LSE abs err {shown_lse}", end="")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == whole_out.shape
    assert errors["merged vs fp32"] < OUT_REL and errors["merged vs one decode"] < OUT_REL
    assert lse_errors["merged vs fp32"] < LSE_ABS and lse_errors["merged vs one decode"] < LSE_ABS


def test_merge_replays_in_a_cuda_graph() -> None:
    """merge_lse_partials captured in a CUDA graph replays to the eager result for new partials in place."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    outs = torch.randn(4, 8, 1, HEADS, 512, device="cuda", generator=generator).bfloat16()
    lses = torch.randn(4, 8, 1, HEADS, device="cuda", generator=generator) * 4
    lses[1, :3] = float("-inf")  # empty shares for some requests
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        merge_lse_partials(outs, lses)  # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out, captured_lse = merge_lse_partials(outs, lses)
    outs.copy_(torch.randn(outs.shape, device="cuda", generator=generator).bfloat16())
    lses.copy_(torch.randn(lses.shape, device="cuda", generator=generator) * 4)
    lses[2, 5:] = float("-inf")
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = merge_lse_partials(outs, lses)
    assert torch.equal(captured_out, eager_out) and torch.equal(captured_lse, eager_lse)
