"""Tests for wspool.flashinfer.mla_decode on the CPU: mla_decode's plan reuse, and decode-context parallelism.

The DCP tests run what each DCP rank runs, through ``mla_decode`` on its
reference path, so CI exercises the split and the merge;
tests/flashinfer/test_mla_decode_gpu.py runs the same with FlashInfer's kernel.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import wspool
from tests.helpers.dcp_shares import RAGGED_LENGTHS, decode_by_shares, split_into_shares
from tests.helpers.mla_doubles import WrapperDouble
from tests.helpers.mla_inputs import MLAInputs, make_inputs, mla_reference, run_mla_decode
from wspool.flashinfer import mla_decode, mla_decode_plan, mla_decode_reference
from wspool.flashinfer.mla_decode import MLAPlanCache
from wspool.units import ceil_div

PAGE = 64
#: Requests of 9 to 13 pages: every share of every request holds tokens, up to cp_world 8.
LONG = [8 * PAGE + 37 * i + 1 for i in range(8)]
LAYOUTS = {"ragged": RAGGED_LENGTHS, "long": LONG}


def test_one_plan_per_step(hopper: None) -> None:
    """Sixty-one layer calls with the same metadata plan once and share one wrapper."""
    inputs = make_inputs(2, 8, [100, 37])
    for layer in range(61):
        inputs.query = make_inputs(2, 8, [100, 37], seed=layer).query
        out = run_mla_decode(inputs)
        torch.testing.assert_close(out, mla_reference(inputs)[0])
    (wrapper,) = WrapperDouble.instances
    assert wrapper.plan_calls == 1
    assert wspool.get_registry().stats("flashinfer_mla", device="cpu").request_count == 61


def test_in_place_metadata_changes_replan(hopper: None) -> None:
    """Editing the page table or lengths in place makes the next call replan; results stay right."""
    inputs = make_inputs(2, 4, [100, 37], page_size=16)
    run_mla_decode(inputs)
    inputs.seq_lens[1] = 38  # the next decode step appends a token
    torch.testing.assert_close(run_mla_decode(inputs), mla_reference(inputs)[0])
    inputs.block_tables[0, 0], inputs.block_tables[0, 1] = (
        inputs.block_tables[0, 1].item(),
        inputs.block_tables[0, 0].item(),
    )
    torch.testing.assert_close(run_mla_decode(inputs), mla_reference(inputs)[0])
    assert WrapperDouble.instances[0].plan_calls == 3


def test_new_metadata_or_batch_replans(hopper: None) -> None:
    """New tensors, another batch size or other options plan again; wrappers are reused across steps."""
    first = make_inputs(2, 4, [50, 60])
    run_mla_decode(first)
    second = make_inputs(3, 4, [5, 6, 7], seed=1)
    torch.testing.assert_close(run_mla_decode(second), mla_reference(second)[0])
    torch.testing.assert_close(run_mla_decode(second, return_lse=True)[0], mla_reference(second)[0])  # type: ignore[index]
    assert sum(w.plan_calls for w in WrapperDouble.instances) == 3
    assert len(WrapperDouble.instances) == 2  # one per LSE mode, shared across steps


def test_mla_decode_returns_the_callers_buffers(hopper: None) -> None:
    """On the wrapper path, mla_decode fills and returns the caller's 4-D out and lse."""
    inputs = make_inputs(2, 4, [10, 20])
    out = torch.empty(2, 1, 4, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 1, 4)
    for _ in range(2):  # the first call plans, the second takes the reuse path
        got_out, got_lse = run_mla_decode(inputs, return_lse=True, out=out, lse=lse)  # type: ignore[misc]
        assert got_out is out and got_lse is lse
        torch.testing.assert_close(lse, mla_reference(inputs)[1])


def test_metadata_resized_in_place_makes_a_new_plan(hopper: None) -> None:
    """Tensors resized in place (another batch) get a new plan, never a replan of the old shapes."""
    inputs = make_inputs(3, 4, [10, 20, 30])
    run_mla_decode(inputs)
    first = MLAPlanCache.of(wspool.get_registry())[("flashinfer_mla", "main", "auto", False)]
    inputs.seq_lens.resize_(2)
    inputs.block_tables.resize_(2, inputs.block_tables.shape[1])
    inputs.query = inputs.query[:2].clone()
    torch.testing.assert_close(run_mla_decode(inputs), mla_reference(inputs)[0])
    second = MLAPlanCache.of(wspool.get_registry())[("flashinfer_mla", "main", "auto", False)]
    assert second is not first and second.step.batch_size == 2


def test_reset_forgets_the_plans(hopper: None) -> None:
    """registry.reset() drops mla_decode's remembered plans with the pools."""
    inputs = make_inputs(2, 4, [10, 20])
    run_mla_decode(inputs)
    registry = wspool.get_registry()
    assert registry.peek_state(MLAPlanCache)
    registry.reset()
    assert registry.peek_state(MLAPlanCache) is None
    torch.testing.assert_close(run_mla_decode(inputs), mla_reference(inputs)[0])


@pytest.mark.parametrize("path", ["hopper", "reference"])
def test_mla_decode_takes_packed_queries(path: str, request: pytest.FixtureRequest) -> None:
    """mla_decode accepts [batch * q_len, heads, dim] and answers in that form, sharing the 4-D call's plan."""
    if path == "hopper":
        request.getfixturevalue("hopper")
    inputs = make_inputs(3, 4, [20, 30, 140], q_len=2)
    want_out, want_lse = mla_reference(inputs)
    packed = inputs.query.view(6, 4, 576)
    got_out, got_lse = mla_decode(  # type: ignore[misc]
        packed, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
        sm_scale=inputs.sm_scale, return_lse=True,
    )  # fmt: skip
    torch.testing.assert_close(got_out, want_out.view(6, 4, 512))
    torch.testing.assert_close(got_lse, want_lse.view(6, 4))
    plans = MLAPlanCache.of(wspool.get_registry())
    (plan,) = plans.values()
    assert plan.step.q_len == 2
    four_d_out, _ = run_mla_decode(inputs, return_lse=True)  # type: ignore[misc]
    torch.testing.assert_close(four_d_out, want_out)
    assert list(plans.values()) == [plan]  # the same plan serves both forms
    if path == "hopper":
        assert plan.plan_calls == 1


def test_packed_query_must_split_evenly_over_the_batch(hopper: None) -> None:
    """A packed query whose tokens do not divide over the batch is refused before anything is allocated."""
    inputs = make_inputs(2, 4, [10, 20])
    registry = wspool.PoolRegistry.from_config()
    with pytest.raises(ValueError, match=r"packed query has 3 tokens for a batch of 2 \(seq_lens\)"):
        mla_decode(
            torch.zeros(3, 4, 576, dtype=torch.bfloat16), inputs.kv_cache, inputs.block_tables, inputs.seq_lens,
            inputs.max_seq_len, sm_scale=inputs.sm_scale, registry=registry,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"query must be \[batch, q_len, heads, dim\] or packed"):
        mla_decode(
            inputs.query[0, 0], inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
            sm_scale=inputs.sm_scale, registry=registry,
        )  # fmt: skip
    assert all(s.capacity_bytes == 0 for s in registry.all_stats())
    assert WrapperDouble.instances == []


def test_inference_tensor_metadata_plans_every_call(
    hopper: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Metadata made under inference_mode has no write counter: each call replans (right results) and warns once."""
    monkeypatch.setattr(sys.modules["wspool.flashinfer.mla_decode"], "_warned_unversioned", False)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="wspool"):
        inputs = make_inputs(2, 4, [50, 60])
        assert inputs.seq_lens.is_inference()
        torch.testing.assert_close(run_mla_decode(inputs), mla_reference(inputs)[0])
        inputs.seq_lens[1] = 61  # an edit torch cannot report
        torch.testing.assert_close(run_mla_decode(inputs), mla_reference(inputs)[0])
        torch.testing.assert_close(run_mla_decode(inputs), mla_reference(inputs)[0])
        plan = mla_decode_plan(
            inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=4, sm_scale=inputs.sm_scale,
            page_size=64,
        )  # fmt: skip
        assert not plan.is_current_for(inputs.block_tables, inputs.seq_lens)
        torch.testing.assert_close(plan.run(inputs.query, inputs.kv_cache), mla_reference(inputs)[0])
    (wrapper,) = WrapperDouble.instances
    assert wrapper.plan_calls == 4  # three mla_decode calls, one explicit plan
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "inference_mode" in warnings[0] and "mla_decode_plan" in warnings[0]


def test_the_plan_cache_is_keyed_by_the_lane_in_effect() -> None:
    """The same metadata under wspool.lane("b") plans again and draws lane b's buffer, not lane a's."""
    reg = wspool.get_registry()
    inputs = make_inputs(2, 8, [70, 1])
    with wspool.lane("a"):
        run_mla_decode(inputs)
    with wspool.lane("b"):
        run_mla_decode(inputs)
    lanes = {s.lane: s.request_count for s in reg.all_stats() if s.pool == "flashinfer_mla"}
    assert lanes == {"a": 1, "b": 1}
    plans = MLAPlanCache.of(reg)
    assert {key[1] for key in plans} == {"a", "b"}


def test_other_facts_make_a_new_plan() -> None:
    """A call whose facts differ from the remembered plan's plans again; the same facts reuse it."""
    inputs = make_inputs(2, 4, [10, 20])
    run_mla_decode(inputs, facts={"cp_world": 2})
    plans = MLAPlanCache.of(wspool.get_registry())
    (first,) = plans.values()
    run_mla_decode(inputs, facts={"cp_world": 2})
    assert list(plans.values()) == [first]
    run_mla_decode(inputs, facts={"cp_world": 4})
    (second,) = plans.values()
    assert second is not first and second.facts["cp_world"] == 4


# -- decode context parallelism: shares decoded one by one, merged by their LSEs ----------


def _dcp_inputs(lengths: list[int], dtype: torch.dtype, heads: int = 16) -> MLAInputs:
    return make_inputs(len(lengths), heads, lengths, page_size=PAGE, dtype=dtype, seed=len(lengths))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("cp_world", [2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shares_partition_every_request(layout: str, cp_world: int) -> None:
    """The shares' pages, in rank order, are each request's pages, and their lengths add up to its length."""
    inputs = _dcp_inputs(LAYOUTS[layout], torch.bfloat16)
    shares = split_into_shares(inputs, cp_world)
    for b, length in enumerate(inputs.seq_lens.tolist()):
        pages = ceil_div(length, PAGE)
        lengths = [int(s.seq_lens[b]) for s in shares]
        joined = torch.cat([s.block_tables[b, : ceil_div(n, PAGE)] for s, n in zip(shares, lengths, strict=True)])
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
    inputs = _dcp_inputs(LAYOUTS[layout], torch.float32)
    out, lse, partials = decode_by_shares(inputs, cp_world)
    want_out, want_lse = mla_reference(inputs)
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
    inputs = _dcp_inputs(RAGGED_LENGTHS, torch.bfloat16)
    out, lse, _ = decode_by_shares(inputs, cp_world)
    whole_out, whole_lse = mla_reference(inputs)  # rounded to bf16 once
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
