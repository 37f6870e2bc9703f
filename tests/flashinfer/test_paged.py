"""Tests for wspool.flashinfer.paged on the CPU: paths, plans and shared wrappers, LSE base, overflow recovery."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import wspool
from tests.helpers.paged_doubles import DecodeWrapperDouble, PrefillWrapperDouble
from tests.helpers.paged_inputs import PagedInputs, make_paged_inputs
from wspool.errors import WorkspaceFrozenError
from wspool.flashinfer import (
    PagedAttentionPlan,
    paged_attention_reference,
    paged_decode_plan,
    paged_prefill_plan,
)
from wspool.flashinfer import kernels as fi_kernels
from wspool.flashinfer.paged import FLOAT_CARVES
from wspool.units import MiB

LENGTHS = [37, 1, 64, 100]


def _reference(inputs: PagedInputs, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return paged_attention_reference(
        inputs.query, inputs.kv_cache, inputs.qo_indptr, inputs.block_tables, inputs.seq_lens,
        sm_scale=inputs.head_dim**-0.5, causal=causal,
    )  # fmt: skip


def _heads(inputs: PagedInputs) -> dict[str, int]:
    return {
        "num_qo_heads": inputs.num_qo_heads,
        "num_kv_heads": inputs.num_kv_heads,
        "head_dim": inputs.head_dim,
        "page_size": inputs.page_size,
    }


def _decode_plan(inputs: PagedInputs, **kwargs: object) -> PagedAttentionPlan:
    return paged_decode_plan(inputs.block_tables, inputs.seq_lens, **_heads(inputs), **kwargs)  # type: ignore[arg-type]


def _prefill_plan(inputs: PagedInputs, **kwargs: object) -> PagedAttentionPlan:
    return paged_prefill_plan(
        inputs.qo_indptr,
        inputs.block_tables,
        inputs.seq_lens,
        **_heads(inputs),
        **kwargs,  # type: ignore[arg-type]
    )


def _prefill_inputs(seed: int = 0) -> PagedInputs:
    return make_paged_inputs([37, 5, 64, 100], q_lens=[10, 5, 1, 33], seed=seed)


@pytest.mark.parametrize("return_lse", [False, True])
def test_reference_decode_draws_from_the_shared_pool(return_lse: bool) -> None:
    """On the CPU, decode computes the reference and is served by flashinfer_mla's buffer with rule decode."""
    inputs = make_paged_inputs(LENGTHS)
    result = _decode_plan(inputs).run(inputs.query, inputs.kv_cache, return_lse=return_lse)
    want_out, want_lse = _reference(inputs)
    out = result[0] if return_lse else result
    torch.testing.assert_close(out, want_out)
    if return_lse:
        torch.testing.assert_close(result[1], want_lse)
    registry = wspool.get_registry()
    stats = registry.stats("flashinfer", device="cpu")
    assert stats.pool == "flashinfer_mla" and dict(stats.requests_by_rule) == {"decode": 1}
    assert stats.capacity_bytes == registry.resolve("flashinfer", "decode", sm_count=1, num_qo_heads=8, head_dim=64)


def test_reference_prefill_is_causal_over_ragged_rows() -> None:
    """Prefill with ragged query rows matches the causal reference; out and lse buffers are filled."""
    inputs = _prefill_inputs()
    out = torch.empty_like(inputs.query)
    lse = torch.empty(inputs.query.shape[:2])
    got_out, got_lse = _prefill_plan(inputs).run(inputs.query, inputs.kv_cache, out=out, lse=lse, return_lse=True)
    want_out, want_lse = _reference(inputs)
    assert got_out is out and got_lse is lse
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_kv_heads": 3}, r"num_qo_heads \(8\) must be a multiple of num_kv_heads \(3\)"),
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        ({"backend": "flash"}, "unknown paged attention backend 'flash'"),
        ({"backend": "fa2"}, "backend 'fa2' needs a CUDA device, got cpu; use backend='reference'"),
        ({"seq_lens": torch.tensor([37, 0, 64, 100], dtype=torch.int32)}, "seq_lens must be at least 1"),
        ({"seq_lens": torch.tensor([37, 1, 64, 200], dtype=torch.int32)}, "needs 13 pages .* block_tables has 7"),
        ({"block_tables": torch.zeros(3, 7, dtype=torch.int32)}, "block_tables has 3 rows but seq_lens has 4"),
        ({"seq_lens": torch.ones(4)}, "seq_lens must be a 1-D int32 tensor"),
    ],
)
def test_bad_decode_input_is_rejected(change: dict[str, object], match: str) -> None:
    """Malformed metadata or options raise a ValueError naming them, before anything is planned."""
    inputs = make_paged_inputs(LENGTHS)
    kwargs: dict[str, object] = {"block_tables": inputs.block_tables, "seq_lens": inputs.seq_lens, **_heads(inputs)}
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        paged_decode_plan(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("qo_indptr", "match"),
    [
        (torch.tensor([0, 10, 15], dtype=torch.int32), "qo_indptr must have batch \\+ 1 = 5 entries, got 3"),
        (torch.tensor([0, 10, 16, 17, 50], dtype=torch.int32), "more query rows than its seq_lens"),
        (torch.tensor([0, 10, 5, 6, 40], dtype=torch.int32), "qo_indptr must not decrease"),
    ],
)
def test_bad_prefill_rows_are_rejected(qo_indptr: torch.Tensor, match: str) -> None:
    """qo_indptr must have one entry per request plus one, never decrease, and fit the cache when causal."""
    inputs = _prefill_inputs()
    with pytest.raises(ValueError, match=match):
        paged_prefill_plan(qo_indptr, inputs.block_tables, inputs.seq_lens, **_heads(inputs))


def test_run_rejects_what_the_plan_was_not_made_for() -> None:
    """A query of another shape or dtype, or a KV cache of another layout, raises before any kernel runs."""
    inputs = make_paged_inputs(LENGTHS)
    plan = _decode_plan(inputs)
    with pytest.raises(ValueError, match=r"query is \(4, 8, 32\) .* plan is for \(4, 8, 64\)"):
        plan.run(inputs.query[..., :32], inputs.kv_cache)
    with pytest.raises(ValueError, match=r"query is .*float32.*make a new plan"):
        plan.run(inputs.query.float(), inputs.kv_cache)
    with pytest.raises(ValueError, match=r"kv_cache must be \[pages, 2, 16, 2, 64\] \(NHD\), got \(\d+, 16, 2, 2"):
        plan.run(inputs.query, inputs.kv_cache.transpose(1, 2))


def test_wrapper_decode_converts_the_lse_to_natural_log(h200_wrapper_doubles: None) -> None:
    """FlashInfer's decode LSE is base 2; the plan returns the natural log, in the caller's buffer too."""
    inputs = make_paged_inputs(LENGTHS)
    plan = _decode_plan(inputs)
    lse = torch.empty(4, 8)
    out, got = plan.run(inputs.query, inputs.kv_cache, lse=lse, return_lse=True)  # type: ignore[misc]
    want_out, want_lse = _reference(inputs)
    torch.testing.assert_close(out, want_out)
    assert got is lse
    torch.testing.assert_close(lse, want_lse)
    (wrapper,) = DecodeWrapperDouble.instances
    assert wrapper.init_kwargs["use_tensor_cores"] is False  # group 4: CUDA cores
    assert wrapper.workspace.data_ptr() == wspool.get_registry().pool("flashinfer", "cpu").buffer.data_ptr()  # type: ignore[union-attr]


def test_wrapper_prefill_asks_for_natural_log(h200_wrapper_doubles: None) -> None:
    """Prefill plans causal CSR metadata and asks FlashInfer for lse_base='ln'."""
    inputs = _prefill_inputs()
    out, lse = _prefill_plan(inputs).run(inputs.query, inputs.kv_cache, return_lse=True)  # type: ignore[misc]
    want_out, want_lse = _reference(inputs)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    (wrapper,) = PrefillWrapperDouble.instances
    assert wrapper.planned["causal"] is True and wrapper.planned["head_dim_qk"] == 64  # type: ignore[index]


def test_large_gqa_groups_use_tensor_cores(h200_wrapper_doubles: None) -> None:
    """GQA groups above 4 default to FlashInfer's tensor-core decode; the caller can choose either."""
    inputs = make_paged_inputs(LENGTHS, num_qo_heads=16, num_kv_heads=2)
    assert _decode_plan(inputs).use_tensor_cores is True
    assert _decode_plan(inputs, use_tensor_cores=False).use_tensor_cores is False
    assert [w.init_kwargs["use_tensor_cores"] for w in DecodeWrapperDouble.instances] == [True, False]


def test_one_plan_per_step_and_one_wrapper_across_steps(h200_wrapper_doubles: None) -> None:
    """Thirty-two layer runs plan once; the next step's plan reuses the wrapper and plans it again."""
    inputs = make_paged_inputs(LENGTHS)
    plan = _decode_plan(inputs)
    for layer in range(32):
        inputs.query = make_paged_inputs(LENGTHS, seed=layer).query
        torch.testing.assert_close(plan.run(inputs.query, inputs.kv_cache), _reference(inputs)[0])
    assert plan.plan_calls == 1
    step2 = make_paged_inputs([5, 6, 7, 8], seed=9)
    torch.testing.assert_close(_decode_plan(step2).run(step2.query, step2.kv_cache), _reference(step2)[0])
    (wrapper,) = DecodeWrapperDouble.instances
    assert wrapper.plan_calls == 2
    assert wspool.get_registry().stats("flashinfer", "cpu").requests_by_rule["decode"] == 33


def test_plan_taken_over_by_another_plan_replans(h200_wrapper_doubles: None) -> None:
    """Two live plans sharing a wrapper never run on each other's metadata."""
    a = make_paged_inputs(LENGTHS, seed=1)
    b = make_paged_inputs([90, 3, 17, 2], seed=2)
    plan_a, plan_b = _decode_plan(a), _decode_plan(b)
    torch.testing.assert_close(plan_a.run(a.query, a.kv_cache), _reference(a)[0])
    torch.testing.assert_close(plan_b.run(b.query, b.kv_cache), _reference(b)[0])
    assert len(DecodeWrapperDouble.instances) == 1 and (plan_a.plan_calls, plan_b.plan_calls) == (2, 2)


def test_no_attribute_is_set_on_flashinfers_wrappers(h200_wrapper_doubles: None) -> None:
    """Which plan owns a cached wrapper is recorded beside it: FlashInfer's object gains no wspool attribute."""
    a = make_paged_inputs(LENGTHS, seed=1)
    b = make_paged_inputs([90, 3, 17, 2], seed=2)
    plan_a, plan_b = _decode_plan(a), _decode_plan(b)
    torch.testing.assert_close(plan_a.run(a.query, a.kv_cache), _reference(a)[0])
    (wrapper,) = DecodeWrapperDouble.instances
    assert [name for name in vars(wrapper) if "wspool" in name] == []
    assert fi_kernels.ownership(wrapper).owner is not None  # plan_a's, in wspool's side table
    assert plan_b.plan_calls == 1 and plan_a.plan_calls == 2  # plan_b took the wrapper; plan_a took it back


def test_no_cached_wrapper_outlives_its_buffer(h200_wrapper_doubles: None) -> None:
    """When the pool grows, its cached wrappers go with the old buffer; the plan replans on the new one."""
    inputs = make_paged_inputs(LENGTHS)
    registry = wspool.get_registry()
    plan = _decode_plan(inputs)
    pool = registry.pool("flashinfer", "cpu")
    old = DecodeWrapperDouble.instances[-1]
    assert list(pool.buffer_cache.values()) == [old]
    registry.reserve("flashinfer_mla", device="cpu", nbytes="300MiB")  # another backend grows the shared buffer
    assert pool.buffer_cache == {}
    torch.testing.assert_close(plan.run(inputs.query, inputs.kv_cache), _reference(inputs)[0])
    new = DecodeWrapperDouble.instances[-1]
    assert new is not old and new.workspace.numel() == 300 * MiB and list(pool.buffer_cache.values()) == [new]


def test_undersized_rule_recovers_once_with_a_warning(
    h200_wrapper_doubles: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1MiB decode rule overflows the plan; the shared buffer grows once, the warning names the key."""
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer": {"rules": {"decode": "1MiB"}}})
    inputs = make_paged_inputs(LENGTHS)
    with caplog.at_level(logging.WARNING, logger="wspool"):
        out = _decode_plan(inputs, registry=registry).run(inputs.query, inputs.kv_cache)
    torch.testing.assert_close(out, _reference(inputs)[0])
    stats = registry.stats("flashinfer", device="cpu")
    assert stats.grow_count == 2 and stats.capacity_bytes >= DecodeWrapperDouble.partial_bytes
    assert stats.last_grow_reason.startswith("overflow recovery (batch_decode_tmp_v)")  # type: ignore[union-attr]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "paged decode overflowed pool flashinfer_mla" in warning.getMessage()
    assert "WSPOOL_POOLS__FLASHINFER__RULES__DECODE" in warning.getMessage()


def test_int_workspace_overflow_is_not_the_pools(h200_wrapper_doubles: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An overflow of FlashInfer's own int workspace is raised as it is; the pool does not grow for it."""
    monkeypatch.setattr(PrefillWrapperDouble, "int_overflow", True)
    inputs = _prefill_inputs()
    with pytest.raises(RuntimeError, match="batch_prefill_sm90_qo_tile_indices with size 9437184"):
        _prefill_plan(inputs)
    assert wspool.get_registry().stats("flashinfer", "cpu").grow_count == 1


def test_overflow_while_frozen_names_the_key(h200_wrapper_doubles: None) -> None:
    """A frozen registry does not grow on overflow: the error names the bytes needed and the key."""
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer": {"rules": {"prefill": "1MiB"}}})
    inputs = _prefill_inputs()
    registry.reserve("flashinfer", device="cpu", nbytes="1MiB")
    with (
        registry.frozen(),
        pytest.raises(
            WorkspaceFrozenError,
            match=r"recovery \(batch_prefill_tmp_v\) needs \d+ bytes.*WSPOOL_POOLS__FLASHINFER__RULES__PREFILL",
        ),
    ):
        _prefill_plan(inputs, registry=registry)
    assert registry.stats("flashinfer", device="cpu").capacity_bytes == MiB


def test_mla_and_paged_attention_hold_one_buffer() -> None:
    """With the default configuration, MLA decode and paged decode and prefill share one buffer of the largest need."""
    from tests.helpers.mla_inputs import make_inputs
    from wspool.flashinfer import mla_decode

    registry = wspool.PoolRegistry.from_config(pools={"flashinfer": {"rules": {"prefill": "300MiB"}}})
    mla = make_inputs(2, 4, [10, 20])
    mla_decode(mla.query, mla.kv_cache, mla.block_tables, mla.seq_lens, mla.max_seq_len, sm_scale=mla.sm_scale,
               return_lse=True, registry=registry)  # fmt: skip
    decode = make_paged_inputs(LENGTHS)
    _decode_plan(decode, registry=registry).run(decode.query, decode.kv_cache)
    prefill = _prefill_inputs()
    _prefill_plan(prefill, registry=registry).run(prefill.query, prefill.kv_cache)
    (stats,) = registry.all_stats()
    assert stats.pool == "flashinfer_mla" and stats.capacity_bytes == 300 * MiB  # the largest need
    (buffer,) = registry.memory_stats()["buffers"]
    assert buffer["backends"] == {"flashinfer": {"decode": 1, "prefill": 1}, "flashinfer_mla": {"lse": 1}}
    assert registry.memory_stats()["held_bytes"] == 300 * MiB


def test_separate_buffer_and_lanes_when_asked() -> None:
    """shared_with empty gives paged attention its own buffer; another lane gets another buffer too."""
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer": {"shared_with": ""}})
    inputs = make_paged_inputs(LENGTHS)
    _decode_plan(inputs, registry=registry).run(inputs.query, inputs.kv_cache)
    registry.workspace("flashinfer_mla", "cpu")
    _decode_plan(inputs, registry=registry, lane="ubatch1").run(inputs.query, inputs.kv_cache)
    assert sorted((s.pool, s.lane) for s in registry.all_stats()) == [
        ("flashinfer", "main"), ("flashinfer", "ubatch1"), ("flashinfer_mla", "main"),
    ]  # fmt: skip


def test_paged_float_carves_are_flashinfers() -> None:
    """The carve names wspool recovers from are the float-workspace carves in FlashInfer's scheduler."""
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    scheduler = Path(flashinfer.__file__).parent / "data" / "include" / "flashinfer" / "attention" / "scheduler.cuh"
    if not scheduler.is_file():
        pytest.skip("this FlashInfer build ships no scheduler source")
    text = scheduler.read_text()
    for name in FLOAT_CARVES:
        assert f'"{name}"' in text
