"""Tests for wspool.flashinfer.mla on the CPU: paths, checks, replans, sizing and recovery, facts and profiles."""

from __future__ import annotations

import logging

import pytest
import torch

import wspool
from tests.helpers.devices_fake import H200, HOPPER_MLA_BYTES, meta_allocator
from tests.helpers.mla_doubles import TrtllmDouble, WrapperDouble
from tests.helpers.mla_inputs import make_inputs, mla_reference, run_mla_decode
from wspool.devices import fake_device
from wspool.errors import WorkspaceFrozenError, WorkspaceLimitError
from wspool.flashinfer import MLADecodePlan, backends, mla_decode_plan
from wspool.flashinfer import kernels as fi_kernels
from wspool.flashinfer.layouts import softmax_slab_bytes
from wspool.flashinfer.mla import COUNTER_RULE
from wspool.rules import compile_rule
from wspool.settings.profiles import shipped_config
from wspool.tools.demo import run_demo
from wspool.units import MiB


@pytest.mark.parametrize("return_lse", [False, True])
def test_reference_path_draws_from_the_pool(return_lse: bool) -> None:
    """On the CPU, mla_decode computes the reference and sizes the pool by the default or lse rule."""
    inputs = make_inputs(3, 8, [70, 1, 128])
    result = run_mla_decode(inputs, return_lse=return_lse)
    want_out, want_lse = mla_reference(inputs)
    if return_lse:
        out, lse = result  # type: ignore[misc]
        torch.testing.assert_close(lse, want_lse)
    else:
        out = result
    torch.testing.assert_close(out, want_out)
    stats = wspool.get_registry().stats("flashinfer_mla", device="cpu")
    assert stats.capacity_bytes == (256 if return_lse else 128) * MiB
    assert dict(stats.requests_by_rule) == {("lse" if return_lse else "default"): 1}


def test_out_and_lse_buffers_are_filled() -> None:
    """Caller-given out and lse buffers are written and returned."""
    inputs = make_inputs(2, 4, [10, 20])
    out = torch.empty(2, 1, 4, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 1, 4)
    got_out, got_lse = run_mla_decode(inputs, return_lse=True, out=out, lse=lse)  # type: ignore[misc]
    assert got_out is out and got_lse is lse
    torch.testing.assert_close(lse, mla_reference(inputs)[1])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda i: setattr(i, "query", i.query[:, :, :2]), "query is .* but the plan is for"),
        (lambda i: setattr(i, "block_tables", i.block_tables.float()), "block_tables must be a 2-D int32 tensor"),
        (lambda i: setattr(i, "seq_lens", i.seq_lens[:1]), "block_tables has 2 rows but seq_lens has 1"),
        (lambda i: setattr(i, "max_seq_len", 0), "max_seq_len must be a positive integer"),
        (lambda i: setattr(i, "kv_cache", i.kv_cache[..., :512]), r"kv_cache must be \[pages, 64, 576\]"),
    ],
)
def test_bad_tensors_are_rejected(change: object, match: str) -> None:
    """Malformed inputs raise a ValueError naming the tensor, before any kernel runs."""
    inputs = make_inputs(2, 4, [10, 20])
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=4, sm_scale=inputs.sm_scale, page_size=64
    )
    change(inputs)  # type: ignore[operator]
    with pytest.raises(ValueError, match=match):
        if "query" in match or "kv_cache" in match:
            plan.run(inputs.query, inputs.kv_cache)
        else:
            run_mla_decode(inputs)


def test_wrapper_path_matches_reference(hopper: None) -> None:
    """On the Hopper path, the CSR metadata built on the device gives the reference result."""
    inputs = make_inputs(4, 8, [300, 1, 64, 65], q_len=1)
    out, lse = run_mla_decode(inputs, return_lse=True)  # type: ignore[misc]
    want_out, want_lse = mla_reference(inputs)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    (wrapper,) = WrapperDouble.instances
    assert wrapper.workspace.numel() == 256 * MiB
    assert wrapper.planned["lse_mode"] == "basee"  # type: ignore[index]


def test_pool_growth_replans_on_the_new_buffer(hopper: None) -> None:
    """When another caller grows the pool, the plan's next run replans on the new buffer."""
    inputs = make_inputs(2, 4, [50, 60])
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=4, sm_scale=inputs.sm_scale, page_size=64
    )
    old = WrapperDouble.instances[-1]
    wspool.get_registry().reserve("flashinfer_mla", device="cpu", nbytes="200MiB")
    torch.testing.assert_close(plan.run(inputs.query, inputs.kv_cache), mla_reference(inputs)[0])
    new = WrapperDouble.instances[-1]
    assert new is not old and new.workspace.numel() == 200 * MiB and plan.plan_calls == 2


def test_plan_taken_over_by_another_plan_replans(hopper: None) -> None:
    """Two live plans sharing a wrapper never run on each other's metadata."""
    a = make_inputs(2, 4, [50, 60], seed=1)
    b = make_inputs(2, 4, [7, 90], seed=2)
    kwargs = {"num_heads": 4, "sm_scale": a.sm_scale, "page_size": 64}
    plan_a = mla_decode_plan(a.block_tables, a.seq_lens, a.max_seq_len, **kwargs)  # type: ignore[arg-type]
    plan_b = mla_decode_plan(b.block_tables, b.seq_lens, b.max_seq_len, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(plan_a.run(a.query, a.kv_cache), mla_reference(a)[0])
    torch.testing.assert_close(plan_b.run(b.query, b.kv_cache), mla_reference(b)[0])
    assert len(WrapperDouble.instances) == 1


def test_no_attribute_is_set_on_flashinfers_wrappers(hopper: None) -> None:
    """Which plan owns a shared wrapper is recorded beside it: FlashInfer's object gains no wspool attribute."""
    a = make_inputs(2, 4, [50, 60], seed=1)
    b = make_inputs(2, 4, [7, 90], seed=2)
    kwargs = {"num_heads": 4, "sm_scale": a.sm_scale, "page_size": 64}
    plan_a = mla_decode_plan(a.block_tables, a.seq_lens, a.max_seq_len, **kwargs)  # type: ignore[arg-type]
    plan_b = mla_decode_plan(b.block_tables, b.seq_lens, b.max_seq_len, **kwargs)  # type: ignore[arg-type]
    plan_a.run(a.query, a.kv_cache)
    plan_b.run(b.query, b.kv_cache)
    (wrapper,) = WrapperDouble.instances
    assert [name for name in vars(wrapper) if "wspool" in name] == []
    assert fi_kernels.ownership(wrapper).owner is not None  # plan_b's, recorded in wspool's side table


def test_undersized_rule_recovers_once_with_a_warning(hopper: None, caplog: pytest.LogCaptureFixture) -> None:
    """An 8MiB rule overflows FlashInfer's plan; the pool grows once, with one warning naming the key."""
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer_mla": {"rules": {"default": "8MiB"}}})
    inputs = make_inputs(2, 4, [50, 60])
    with caplog.at_level(logging.WARNING, logger="wspool"):
        out = run_mla_decode(inputs, registry=registry)
    torch.testing.assert_close(out, mla_reference(inputs)[0])
    stats = registry.stats("flashinfer_mla", device="cpu")
    assert stats.grow_count == 2 and stats.capacity_bytes >= WrapperDouble.partial_bytes
    assert stats.last_grow_reason.startswith("overflow recovery (mla_partial_o)")  # type: ignore[union-attr]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "WSPOOL_POOLS__FLASHINFER_MLA__RULES__DEFAULT" in warnings[0].getMessage()
    run_mla_decode(inputs, registry=registry)
    assert registry.stats("flashinfer_mla", device="cpu").grow_count == 2


def test_overflow_while_frozen_raises_with_the_key(hopper: None) -> None:
    """A frozen pool does not grow on overflow: the error names the bytes needed and the key."""
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer_mla": {"rules": {"default": "8MiB"}}})
    inputs = make_inputs(2, 4, [50, 60])
    registry.reserve("flashinfer_mla", device="cpu", nbytes="8MiB")
    with (
        registry.frozen(),
        pytest.raises(
            WorkspaceFrozenError, match=r"overflow recovery \(mla_partial_o\) needs \d+ bytes.*RULES__DEFAULT"
        ),
    ):
        run_mla_decode(inputs, registry=registry)
    assert registry.stats("flashinfer_mla", device="cpu").capacity_bytes == 8 * MiB


def test_trtllm_path_uses_pool_buffers(blackwell: TrtllmDouble) -> None:
    """On Blackwell, the kernel gets the pool's workspace, the counter pool's buffer and basee LSE."""
    inputs = make_inputs(2, 16, [50, 60])
    _out, lse = run_mla_decode(inputs, return_lse=True)  # type: ignore[misc]
    torch.testing.assert_close(lse, mla_reference(inputs)[1])
    call = blackwell.calls[-1]
    registry = wspool.get_registry()
    assert call["workspace_buffer"].data_ptr() == registry.pool("flashinfer_mla", "cpu").buffer.data_ptr()  # type: ignore[union-attr]
    assert call["multi_ctas_kv_counter_buffer"].numel() == 2 * 16 * 4  # round_up(max(B*H, sm_count=1), 8) * 4
    assert call["return_lse_base"] == "basee" and call["backend"] == "trtllm-gen"


def test_vllms_fixed_128mib_fails_and_the_default_serves(blackwell: TrtllmDouble) -> None:
    """vLLM's fixed 128 MiB crashes an LSE call at 128 heads x 512 requests; the default configuration serves it."""
    inputs = make_inputs(512, 128, [1] * 512, page_size=64)
    vllm_fixed_size = wspool.PoolRegistry.from_config(
        pools={"flashinfer_mla": {"rules": {"default": "128MiB", "lse": "128MiB"}, "max_bytes": "128MiB"}}
    )
    # The path's need (a 129MiB slab and the scratch) is known before the kernel runs.
    with pytest.raises(
        WorkspaceLimitError,
        match=r"for the trtllm-gen kernel path.*above max_bytes = 134217728 bytes \(128MiB\); "
        r"raise pools\.flashinfer_mla\.max_bytes",
    ):
        run_mla_decode(inputs, return_lse=True, registry=vllm_fixed_size)
    assert blackwell.calls == [] and vllm_fixed_size.stats("flashinfer_mla", "cpu").capacity_bytes == 0
    _out, lse = run_mla_decode(inputs, return_lse=True)  # type: ignore[misc]
    torch.testing.assert_close(lse, mla_reference(inputs)[1])
    stats = wspool.get_registry().stats("flashinfer_mla", device="cpu")
    assert (stats.capacity_bytes, stats.grow_count) == (256 * MiB, 1)


def test_plan_object_is_the_explicit_form(hopper: None) -> None:
    """mla_decode_plan + run per layer gives the same results with one plan."""
    inputs = make_inputs(3, 8, [20, 30, 40])
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=8, sm_scale=inputs.sm_scale,
        page_size=64, return_lse=True,
    )  # fmt: skip
    assert isinstance(plan, MLADecodePlan) and plan.rule == "lse" and plan.facts["batch_size"] == 3
    for _ in range(5):
        _out, lse = plan.run(inputs.query, inputs.kv_cache)  # type: ignore[misc]
    torch.testing.assert_close(lse, mla_reference(inputs)[1])
    assert plan.plan_calls == 1


@pytest.mark.parametrize("path", ["hopper", "reference"])
def test_packed_query_form(path: str, request: pytest.FixtureRequest) -> None:
    """A packed [tokens, heads, dim] query returns packed results equal to the 4-D form's."""
    if path == "hopper":
        request.getfixturevalue("hopper")
    inputs = make_inputs(3, 4, [20, 30, 40])
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=4, sm_scale=inputs.sm_scale,
        page_size=64, return_lse=True,
    )  # fmt: skip
    out = torch.empty(3, 4, 512, dtype=torch.bfloat16)
    got_out, got_lse = plan.run(inputs.query.view(3, 4, 576), inputs.kv_cache, out=out)  # type: ignore[misc]
    want_out, want_lse = mla_reference(inputs)
    assert got_out is out and got_lse.shape == (3, 4)
    torch.testing.assert_close(got_out, want_out.view(3, 4, 512))
    torch.testing.assert_close(got_lse, want_lse.view(3, 4))
    with pytest.raises(ValueError, match=r"or packed \(3, 4, 576\)"):
        plan.run(inputs.query.view(12, 1, 576), inputs.kv_cache)


def test_bad_kv_cache_on_the_fast_path(hopper: None) -> None:
    """A packed query with a KV cache of the wrong rank or page size gets a clear ValueError."""
    inputs = make_inputs(2, 4, [10, 20])
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=4, sm_scale=inputs.sm_scale, page_size=64
    )
    packed = inputs.query.view(2, 4, 576)
    for bad in (inputs.kv_cache.view(-1), inputs.kv_cache.view(-1, 32, 576)):
        with pytest.raises(ValueError, match=r"kv_cache must be \[pages, 64, 576\]"):
            plan.run(packed, bad)


def test_overflow_on_a_steady_state_replan_recovers(hopper: None, caplog: pytest.LogCaptureFixture) -> None:
    """A later step whose plan() overflows the buffer it has run on grows the pool once and replans on the new one."""
    inputs = make_inputs(2, 4, [50, 60])
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer_mla": {"rules": {"default": "20MiB"}}})
    run_mla_decode(inputs, registry=registry)
    (first,) = WrapperDouble.instances
    first.partial_bytes = 24 * MiB  # this step's metadata needs more than the rule gave
    inputs.seq_lens[0] = 51
    with caplog.at_level(logging.WARNING, logger="wspool"):
        out = run_mla_decode(inputs, registry=registry)
    torch.testing.assert_close(out, mla_reference(inputs)[0])
    stats = registry.stats("flashinfer_mla", device="cpu")
    assert stats.grow_count == 2 and stats.capacity_bytes >= 24 * MiB
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    second = WrapperDouble.instances[-1]
    assert second is not first and second.workspace.numel() == stats.capacity_bytes
    assert first.plan_calls == 2 and second.plan_calls == 1


def test_explicit_replan_refuses_resized_metadata(hopper: None) -> None:
    """plan.replan() after an in-place resize says to make a new plan instead of planning the wrong shapes."""
    inputs = make_inputs(3, 4, [10, 20, 30])
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=4, sm_scale=inputs.sm_scale, page_size=64
    )
    inputs.seq_lens.resize_(2)
    with pytest.raises(ValueError, match=r"resized to \(3, 1\)/\(2,\) after planning for \(3, 1\)/\(3,\)"):
        plan.replan()
    assert plan.plan_calls == 1


def test_plan_reports_the_concrete_path_and_flashinfer_gets_it(hopper: None) -> None:
    """On Hopper 'auto' is planned as fa3: plan.path says so and the wrapper is built with backend='fa3'."""
    inputs = make_inputs(2, 4, [50, 60])
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=4, sm_scale=inputs.sm_scale, page_size=64
    )
    assert plan.path == "fa3" and WrapperDouble.instances[-1].backend == "fa3"
    assert plan.flashinfer_backend is None or plan.flashinfer_backend == "fa3"


def test_undersized_rule_is_raised_to_the_paths_need_up_front(
    hopper: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An 8MiB rule on an H200-sized device is raised to fa3's 17369088 bytes before plan(): no overflow, 1 warning."""
    monkeypatch.setattr(backends, "sm_count", lambda device: 132)
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer_mla": {"rules": {"default": "8MiB"}}})
    inputs = make_inputs(2, 4, [50, 60])
    with caplog.at_level(logging.WARNING, logger="wspool"):
        out = run_mla_decode(inputs, registry=registry)
        run_mla_decode(make_inputs(2, 4, [70, 80], seed=1), registry=registry)  # the next step: no second warning
    torch.testing.assert_close(out, mla_reference(inputs)[0])
    stats = registry.stats("flashinfer_mla", device="cpu")
    assert stats.grow_count == 1 and stats.capacity_bytes >= 17369088
    assert stats.last_grow_reason.startswith("the fa3 kernel path")  # type: ignore[union-attr]
    assert [w.plan_calls for w in WrapperDouble.instances] == [2]  # planned twice, never refused
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "below the 17369088 bytes FlashInfer's fa3 MLA decode needs" in warnings[0]
    assert "WSPOOL_POOLS__FLASHINFER_MLA__RULES__DEFAULT" in warnings[0]


def test_cute_dsl_dcp_plan_calls_as_vllm_does(blackwell: TrtllmDouble) -> None:
    """A DCP plan on Blackwell runs cute-dsl: int8 workspace view, DCP arguments, no counters, FlashInfer's size."""
    from wspool.flashinfer.backends import cute_dsl_workspace_bytes

    inputs = make_inputs(2, 16, [50, 60])
    global_lengths = inputs.seq_lens * 4
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=16, sm_scale=inputs.sm_scale,
        page_size=64, return_lse=True, enable_dcp=True, cp_world=4, cp_rank=2, causal_seqlens_kv_global=global_lengths,
    )  # fmt: skip
    _out, lse = plan.run(inputs.query, inputs.kv_cache)  # type: ignore[misc]
    torch.testing.assert_close(lse, mla_reference(inputs)[1])
    call = blackwell.calls[-1]
    assert plan.path == call["backend"] == "cute-dsl"
    assert call["workspace_buffer"].dtype is torch.int8 and call["multi_ctas_kv_counter_buffer"] is None
    assert (call["enable_dcp"], call["cp_world"], call["cp_rank"]) == (True, 4, 2)
    assert call["causal_seqlens_kv_global"] is global_lengths
    assert plan.need_bytes == cute_dsl_workspace_bytes(
        batch_size=2, q_len=1, num_heads=16, kv_lora_rank=512, sm_count=1, max_seq_len=inputs.max_seq_len,
        enable_dcp=True,
    )  # fmt: skip
    assert plan.facts["cp_world"] == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "flash"}, r"unknown MLA decode backend 'flash'"),
        ({"enable_dcp": True, "cp_world": 2, "cp_rank": 2}, r"cp_rank must be below cp_world, got cp_rank=2"),
        ({"cp_world": 2}, r"cp_world=2 given without enable_dcp=True"),
        ({"enable_dcp": True, "cp_world": 2, "backend": "trtllm-gen"}, r"backend='trtllm-gen'"),
    ],
)
def test_bad_blackwell_arguments_fail_before_anything_runs(
    blackwell: TrtllmDouble, kwargs: dict[str, object], match: str
) -> None:
    """An unknown backend or bad DCP arguments are a ValueError naming them; no pool grows, no kernel runs."""
    inputs = make_inputs(2, 16, [50, 60])
    registry = wspool.PoolRegistry.from_config()
    with pytest.raises(ValueError, match=match):
        mla_decode_plan(
            inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=16, sm_scale=inputs.sm_scale,
            page_size=64, return_lse=True, registry=registry, causal_seqlens_kv_global=inputs.seq_lens
            if kwargs.get("enable_dcp") else None, **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
    assert blackwell.calls == [] and registry.stats("flashinfer_mla", device="cpu").capacity_bytes == 0


def test_a_074_refusal_recovers_on_the_same_backend(
    hopper: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """FlashInfer 0.7.4's ValueError naming the whole need is recovered like 0.7.2.post1's carve, on fa3 again."""
    monkeypatch.setattr(WrapperDouble, "preflight_074", True)
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer_mla": {"rules": {"default": "8MiB"}}})
    inputs = make_inputs(2, 4, [50, 60])
    with caplog.at_level(logging.WARNING, logger="wspool"):
        out = run_mla_decode(inputs, registry=registry)
    torch.testing.assert_close(out, mla_reference(inputs)[0])
    stats = registry.stats("flashinfer_mla", device="cpu")
    assert stats.grow_count == 2 and stats.capacity_bytes >= WrapperDouble.partial_bytes
    assert stats.last_grow_reason.startswith("overflow recovery (fa3)")  # type: ignore[union-attr]
    assert {w.backend for w in WrapperDouble.instances} == {"fa3"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "WSPOOL_POOLS__FLASHINFER_MLA__RULES__DEFAULT" in warnings[0]


# -- the plan's facts: the device's, the pool's defaults, the profile's rules ------------


def test_a_plan_on_a_faked_h200_sizes_with_the_hopper_profile() -> None:
    """The plan reads sm_count from the device and kv_lora_rank from its geometry: 17369088 bytes."""
    inputs = make_inputs(4, 16, [100, 200, 300, 400])
    with fake_device("cpu", H200):
        registry = wspool.PoolRegistry(allocator=meta_allocator)
        plan = mla_decode_plan(
            inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=16, sm_scale=inputs.sm_scale,
            page_size=64, return_lse=True, registry=registry,
        )  # fmt: skip
        assert plan.facts["sm_count"] == 132
        assert registry.stats("flashinfer_mla", "cpu").capacity_bytes == HOPPER_MLA_BYTES


def test_a_plan_takes_cp_world_from_the_default_facts() -> None:
    """Without cp_world in the call, configs/kimi_dcp.yaml's default (8) sizes the LSE slab; a call's own wins."""
    inputs = make_inputs(4, 8, [64, 64, 64, 64])
    registry = wspool.PoolRegistry(wspool.load_settings(shipped_config("kimi_dcp")), allocator=meta_allocator)
    kwargs = {"num_heads": 8, "sm_scale": inputs.sm_scale, "page_size": 64, "return_lse": True, "registry": registry}
    plan = mla_decode_plan(inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, **kwargs)  # type: ignore[arg-type]
    assert plan.facts["cp_world"] == 8  # the file's default fact, merged into the plan's
    nbytes = registry.resolve("flashinfer_mla", "lse", device="cpu", **plan.facts)
    assert nbytes == softmax_slab_bytes(8 * 8, 4, 1) + 32 * MiB
    assert registry.stats("flashinfer_mla", "cpu").capacity_bytes >= nbytes
    own = mla_decode_plan(
        inputs.block_tables,
        inputs.seq_lens,
        inputs.max_seq_len,
        facts={"cp_world": 2},
        **kwargs,  # type: ignore[arg-type]
    )
    nbytes = registry.resolve("flashinfer_mla", "lse", device="cpu", **own.facts)
    assert nbytes == softmax_slab_bytes(8 * 2, 4, 1) + 32 * MiB


def test_demo_on_a_faked_h200_reports_the_hopper_size() -> None:
    """wspool demo on the embedded default, on a CPU standing in for an H200, reports 16.56MiB through hopper."""
    lines: list[str] = []
    with fake_device("cpu", H200):
        registry = wspool.PoolRegistry()
        assert run_demo(registry, "cpu", batch=2, heads=4, max_len=128, layers=1, echo=lines.append)
    assert "profile hopper on cpu: auto: compute capability 9.0 (NVIDIA H200) is hopper's" in lines
    assert sum("workspace 16.56MiB" in line for line in lines) == 2, lines


def test_counter_rule_matches_flashinfer() -> None:
    """The counter pool's rule gives exactly FlashInfer's counter size."""
    utils = pytest.importorskip("flashinfer.utils", reason="flashinfer-python is not installed")
    get_trtllm_gen_multi_ctas_kv_counter_bytes = utils.get_trtllm_gen_multi_ctas_kv_counter_bytes
    rule = compile_rule(COUNTER_RULE)
    for batch, heads, sms in [(1, 16, 148), (512, 128, 148), (3, 5, 132), (64, 128, 160)]:
        want = get_trtllm_gen_multi_ctas_kv_counter_bytes(batch, heads, sms)
        assert rule.resolve({"batch_size": batch, "num_heads": heads, "sm_count": sms}) == want
