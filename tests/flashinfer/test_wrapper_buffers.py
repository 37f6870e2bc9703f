"""Tests for wspool.flashinfer.wrapper_buffers on the CPU.

The rules against FlashInfer's planners' carves, the MLA constructor hook
against FlashInfer's real backend class, sharing through the CPU doubles
(which keep their plan in the int workspace, so a plan overwritten by another
shows as a wrong result), and what the statistics report.
"""

from __future__ import annotations

import gc
import inspect
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import wspool
from tests.helpers.devices_fake import A100, H200
from tests.helpers.int_plans import int_overflow_message
from tests.helpers.mla_doubles import WrapperDouble
from tests.helpers.mla_inputs import make_inputs, mla_reference
from tests.helpers.paged_doubles import DecodeWrapperDouble, PrefillWrapperDouble
from tests.helpers.paged_inputs import make_paged_inputs
from wspool.devices import DeviceDescription, fake_device
from wspool.errors import ConfigError, RuleError, WorkspaceOverflowError
from wspool.flashinfer import (
    backends,
    mla_decode_plan,
    paged_attention_reference,
    paged_decode_plan,
    paged_prefill_plan,
    wrapper_buffers,
)
from wspool.flashinfer.mla import MLA_FLOAT_CARVES
from wspool.flashinfer.refusals import grow_after_overflow
from wspool.flashinfer.wrapper_buffers import WrapperBinding, binding_of, wrapper_regions
from wspool.units import MiB, ceil_div, round_up

# -- the rules against the planners' carves (FlashInfer's scheduler.cuh) ----------------------


def _r16(n: int) -> int:
    return round_up(n, 16)


def _mla_carves(sm: int) -> int:
    """MLAPlan: 9 int32 arrays of 16384 work items and 5 of one int32 per SM, each 16-byte aligned."""
    return 9 * _r16(4 * 16384) + 5 * _r16(4 * sm)


def _decode_carves(padded: int, split: bool) -> int:
    """DecodePlan: request and tile indices (P each), o_indptr (P + 1), the chunk size, split flags (P)."""
    used = 2 * _r16(4 * padded) + 4 * (padded + 1) + 4
    return _r16(used) + padded if split else used


def _prefill_carves(padded: int, batch: int, tokens: int, split: bool, graph: bool) -> int:
    """PrefillPlan (fa2): 3 index arrays (P), o_indptr (B + 1), chunk size, [rows], [merge_indptr (T + 1)], [flags]."""
    used = 3 * _r16(4 * padded) + 4 * (batch + 1) + 4
    if graph:
        used = _r16(used) + 4
    if split:
        used = _r16(used) + 4 * (tokens + 1)
    if graph:
        used = _r16(used) + padded
    return used


@pytest.mark.parametrize(("sm", "nbytes"), [(78, 591424), (108, 591984), (114, 592144), (132, 592464),
                                            (148, 592784), (188, 593584)])  # fmt: skip
def test_mla_rule_is_the_planners_carves(sm: int, nbytes: int) -> None:
    """Rule mla is exact: 592,464 bytes on 132 SMs (the figure an H200 plan stages), whatever the batch."""
    registry = wspool.PoolRegistry()
    wrapper_buffers.declare_int_pool(registry)
    assert registry.resolve("flashinfer_int", "mla", device="cpu", sm_count=sm) == nbytes == _mla_carves(sm)


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 8192),
    num_kv_heads=st.sampled_from([1, 2, 4, 8, 16, 32]),
    sm=st.sampled_from([78, 108, 132, 148, 188]),
    blocks_per_sm=st.integers(1, 32),
    split=st.booleans(),
)
def test_decode_rule_bounds_every_decode_plan(
    batch: int, num_kv_heads: int, sm: int, blocks_per_sm: int, split: bool
) -> None:
    """Rule decode is at least what DecodePlan carves for any padded batch it can choose (eager or graph)."""
    registry = wspool.PoolRegistry()
    facts = {"batch_size": batch, "num_kv_heads": num_kv_heads, "sm_count": sm}
    bound = wrapper_buffers.int_bytes(registry, "decode", torch.device("cpu"), facts)
    grid_rows = blocks_per_sm * sm // num_kv_heads
    padded = max(batch, grid_rows) if split else batch
    assert _decode_carves(padded, split) <= bound


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.integers(1, 4096), min_size=1, max_size=64),
    group=st.sampled_from([1, 2, 4, 8, 16]),
    num_kv_heads=st.sampled_from([1, 2, 8, 32]),
    sm=st.sampled_from([108, 132]),
    cta_tile_q=st.sampled_from([16, 32, 64, 128]),
    chunks=st.integers(1, 4),
    split=st.booleans(),
    graph=st.booleans(),
)
def test_prefill_rule_bounds_every_fa2_prefill_plan(
    rows: list[int], group: int, num_kv_heads: int, sm: int, cta_tile_q: int, chunks: int, split: bool, graph: bool
) -> None:
    """Rule prefill is at least what the fa2 PrefillPlan carves: P is the grid (2 blocks per SM) or the tiles."""
    registry = wspool.PoolRegistry()
    batch, tokens = len(rows), sum(rows)
    facts = {"batch_size": batch, "num_tokens": tokens, "num_qo_heads": group * num_kv_heads,
             "num_kv_heads": num_kv_heads, "sm_count": sm}  # fmt: skip
    bound = wrapper_buffers.int_bytes(registry, "prefill", torch.device("cpu"), facts)
    tiles = sum(ceil_div(q * group, cta_tile_q) for q in rows)
    grid = 2 * sm // num_kv_heads
    if graph:
        padded = max(grid, ceil_div(tokens * group, cta_tile_q) + batch - 1)
    else:  # a split plan stays within the grid; an unsplit one is its tiles
        padded = min(tiles * chunks, max(grid, tiles)) if split else tiles
    assert _prefill_carves(padded, batch, tokens, split, graph) <= bound


def test_a_rule_missing_a_fact_names_the_setting() -> None:
    """A rule that cannot resolve says which setting to change."""
    with pytest.raises(RuleError, match="flashinfer_int"):
        wrapper_buffers.int_bytes(wspool.PoolRegistry(), "decode", torch.device("cpu"), {"batch_size": 4})


def test_configured_rules_win_over_the_declared_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """pools.flashinfer_int.rules.mla set in the environment sizes the MLA regions."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__RULES__MLA", "1MiB")
    registry = wspool.PoolRegistry()
    assert wrapper_buffers.int_bytes(registry, "mla", torch.device("cpu"), {}) == MiB


# -- the MLA backend constructor hook, on FlashInfer's real class ------------------------------


@pytest.fixture
def fresh_hook() -> Iterator[None]:
    """Each test installs (or refuses) the hook itself; FlashInfer's constructor is restored after."""
    wrapper_buffers.uninstall_mla_hook()
    yield
    wrapper_buffers.uninstall_mla_hook()


def _backend_class() -> type:
    from flashinfer.mla._batch_mla._backends import fa3_backend

    return fa3_backend._BatchMLAPagedAttentionFa3Backend  # type: ignore[no-any-return]


def _build_backend(int_buffer: torch.Tensor | None = None, pinned: torch.Tensor | None = None) -> object:
    """Build FlashInfer's fa3 MLA backend object as its plan_from_wrapper does (on the CPU)."""
    return _backend_class()(
        float_workspace_buffer=torch.zeros(64, dtype=torch.uint8), use_cuda_graph=False, qo_indptr_buf=None,
        kv_indptr_buf=None, kv_indices_buf=None, kv_len_arr_buf=None, query_split_widths=(512, 64),
        kv_split_widths=(512, 64), int_workspace_buffer=int_buffer, pin_memory_int_workspace_buffer=pinned,
    )  # fmt: skip


class _Wrapper:
    """Any object wspool binds (FlashInfer's wrappers are plain objects held weakly)."""


def test_the_hooked_class_is_as_read(fresh_hook: None) -> None:
    """The installed FlashInfer is one whose MLA backend constructor wspool read, with the three keywords it fills."""
    import flashinfer

    assert flashinfer.__version__ in wrapper_buffers.READ_VERSIONS
    module, name = wrapper_buffers.MLA_BACKEND_CLASS
    cls = getattr(__import__(module, fromlist=[name]), name)
    parameters = inspect.signature(cls.__init__).parameters
    for keyword in ("float_workspace_buffer", "int_workspace_buffer", "pin_memory_int_workspace_buffer"):
        assert parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY
    assert issubclass(_backend_class(), cls)
    assert wrapper_buffers.install_mla_hook() is None
    assert "take int workspaces from pool flashinfer_int" in wrapper_buffers.mla_hook_status()


def test_a_backend_built_inside_supplying_takes_the_binding(fresh_hook: None) -> None:
    """Inside supplying(wrapper), the backend takes the wrapper's region and pinned copy; outside, what it is given."""
    registry = wspool.PoolRegistry()
    wrapper = _Wrapper()
    binding = wrapper_buffers.bind_mla_wrapper(
        wrapper, registry=registry, device=torch.device("cpu"), lane="main", facts={"sm_count": 132}
    )
    assert binding is not None and binding.pinned is not None
    with wrapper_buffers.supplying(wrapper):
        backend = _build_backend()
    assert backend._int_workspace_buffer is binding.region.tensor  # type: ignore[attr-defined]
    assert backend._pin_memory_int_workspace_buffer is binding.pinned  # type: ignore[attr-defined]
    # A graph replan passes the previous int workspace: the pinned copy still comes from the binding.
    with wrapper_buffers.supplying(wrapper):
        again = _build_backend(int_buffer=binding.region.tensor)
    assert again._pin_memory_int_workspace_buffer is binding.pinned  # type: ignore[attr-defined]
    # A larger int workspace than the binding's pinned copy keeps FlashInfer's own copy (never a smaller one).
    larger = torch.zeros(binding.region.nbytes + 16, dtype=torch.uint8)
    with wrapper_buffers.supplying(wrapper), pytest.raises(RuntimeError, match=r"pin|NVIDIA driver"):
        _build_backend(int_buffer=larger)  # FlashInfer pins its own: impossible without a GPU (either torch build)
    given = (torch.zeros(32, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8))
    outside = _build_backend(*given)
    assert outside._int_workspace_buffer is given[0]  # type: ignore[attr-defined]
    assert outside._pin_memory_int_workspace_buffer is given[1]  # type: ignore[attr-defined]


def test_an_unread_version_keeps_flashinfers_buffers(fresh_hook: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a FlashInfer version wspool has not read, nothing is hooked or bound, and show says so."""
    import flashinfer

    monkeypatch.setattr(flashinfer, "__version__", "0.7.3")
    assert "0.7.3 is not a version whose MLA backend wspool has read" in (wrapper_buffers.install_mla_hook() or "")
    module, name = wrapper_buffers.MLA_BACKEND_CLASS
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert not hasattr(cls.__init__, "__wrapped__")
    wrapper = _Wrapper()
    assert wrapper_buffers.bind_mla_wrapper(wrapper, registry=wspool.PoolRegistry(), device=torch.device("cpu"),
                                            lane="main", facts={"sm_count": 132}) is None  # fmt: skip
    assert binding_of(wrapper) is None


def test_a_changed_constructor_is_not_hooked(fresh_hook: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A constructor of other parameters is left alone, and the status says how it differs from what was read."""
    module, name = wrapper_buffers.MLA_BACKEND_CLASS
    cls = getattr(__import__(module, fromlist=[name]), name)

    def changed(self: object, *, backend: str | None = None, float_workspace_buffer: torch.Tensor) -> None:
        """A future constructor that allocates its int workspace some other way."""

    monkeypatch.setattr(cls, "__init__", changed)
    status = wrapper_buffers.install_mla_hook() or ""
    assert (
        "__init__ takes (self, backend, float_workspace_buffer), not (self, backend, float_workspace_buffer, " in status
    )
    assert cls.__init__ is changed


# -- wspool's own MLA plans (the Hopper path, on the doubles) ----------------------------------


def _plan(inputs: object, **kwargs: object) -> object:
    return mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=4,  # type: ignore[attr-defined]
        sm_scale=inputs.sm_scale, page_size=64, **kwargs,  # type: ignore[attr-defined,arg-type]
    )  # fmt: skip


def test_an_eager_plans_wrapper_plans_into_its_region(hopper: None) -> None:
    """The shared eager wrapper's backend holds a region of rule mla's size, not FlashInfer's 8 MiB."""
    inputs = make_inputs(2, 4, [50, 60])
    plan = _plan(inputs)
    torch.testing.assert_close(plan.run(inputs.query, inputs.kv_cache), mla_reference(inputs)[0])  # type: ignore[attr-defined]
    (wrapper,) = WrapperDouble.instances
    binding = binding_of(wrapper)
    assert binding is not None
    assert wrapper._int_workspace_buffer is binding.region.tensor
    assert binding.region.nbytes == _mla_carves(backends.sm_count(torch.device("cpu")))
    assert binding.region.nbytes < MiB


def test_graph_plans_have_regions_of_their_own_unless_grouped(hopper: None) -> None:
    """Graph plans get a region each; plans of one int_group share one."""
    inputs = [make_inputs(2, 4, [50, 60], seed=s) for s in range(3)]
    own = [_plan(i, use_cuda_graph=True) for i in inputs]
    grouped = [_plan(i, use_cuda_graph=True, int_group="decode") for i in inputs]
    assert len({id(binding_of(p._wrapper).region) for p in own}) == 3  # type: ignore[attr-defined,union-attr]
    assert len({id(binding_of(p._wrapper).region) for p in grouped}) == 1  # type: ignore[attr-defined,union-attr]
    with pytest.raises(ValueError, match="int_group is for CUDA-graph plans"):
        _plan(inputs[0], int_group="decode")


def test_grouped_plans_run_interleaved_replan_and_stay_right(hopper: None) -> None:
    """Two plans of one group, both planned, run in turn: each sees the other took the region and replans."""
    a, b = make_inputs(2, 4, [50, 60], seed=1), make_inputs(2, 4, [7, 90], seed=2)
    plan_a, plan_b = _plan(a, use_cuda_graph=True, int_group="g"), _plan(b, use_cuda_graph=True, int_group="g")
    for _ in range(3):
        torch.testing.assert_close(plan_a.run(a.query, a.kv_cache), mla_reference(a)[0])  # type: ignore[attr-defined]
        torch.testing.assert_close(plan_b.run(b.query, b.kv_cache), mla_reference(b)[0])  # type: ignore[attr-defined]
    assert plan_a.plan_calls == 4 and plan_b.plan_calls == 4  # type: ignore[attr-defined]
    # What the record guards against: FlashInfer's wrapper run directly reads the other plan's metadata.
    direct = plan_a._wrapper.run(query=a.query.view(2, 4, 576), kv_cache=a.kv_cache, out=None, lse=None,  # type: ignore[attr-defined]
                                 return_lse=False, return_lse_base_on_e=False)  # fmt: skip
    assert not torch.allclose(direct.view(2, 1, 4, 512).float(), mla_reference(a)[0].float(), atol=1e-2)


def test_replay_replans_a_plan_whose_region_another_took(hopper: None) -> None:
    """plan.replay(graph) replans first when another plan of its group planned since, then replays."""
    a, b = make_inputs(2, 4, [50, 60], seed=1), make_inputs(2, 4, [7, 90], seed=2)
    plan_a, plan_b = _plan(a, use_cuda_graph=True, int_group="g"), _plan(b, use_cuda_graph=True, int_group="g")
    replays: list[int] = []

    class Graph:
        def replay(self) -> None:
            replays.append(plan_a.plan_calls)  # type: ignore[attr-defined]

    plan_a.replay(Graph())  # type: ignore[attr-defined]
    plan_a.replay(Graph())  # type: ignore[attr-defined]
    assert replays == [2, 2]  # replanned once (b had planned last), then owner: no replan
    assert plan_b.plan_calls == 1  # type: ignore[attr-defined]


def test_keep_flashinfer_buffers_leaves_the_wrappers_alone(hopper: None) -> None:
    """A registry that keeps FlashInfer's buffers binds nothing: the double's backend has its own 8 MiB."""
    registry = wspool.PoolRegistry()
    wrapper_buffers.keep_flashinfer_buffers(registry)
    inputs = make_inputs(2, 4, [50, 60])
    plan = _plan(inputs, registry=registry)
    torch.testing.assert_close(plan.run(inputs.query, inputs.kv_cache), mla_reference(inputs)[0])  # type: ignore[attr-defined]
    (wrapper,) = WrapperDouble.instances
    assert binding_of(wrapper) is None and wrapper._int_workspace_buffer.numel() == 8 * MiB


def test_a_wrapper_bound_before_keep_flashinfer_buffers_is_answered_with_its_region() -> None:
    """keep_flashinfer_buffers leaves a bound wrapper its region: binding calls return that binding, never None
    (which says "FlashInfer's buffers"), and a larger need still grows it; an unbound wrapper keeps its 8 MiB."""
    registry = wspool.PoolRegistry()
    float_ws = torch.zeros(MiB, dtype=torch.uint8)
    bound, kept = PrefillWrapperDouble(float_ws, backend="fa2"), PrefillWrapperDouble(float_ws, backend="fa2")
    facts = {"batch_size": 4, "num_tokens": 64, "num_qo_heads": 8, "num_kv_heads": 2, "sm_count": 132}

    def bind(wrapper: object, batch: int) -> object:
        return wrapper_buffers.bind_paged_wrapper(
            wrapper, float_ws, registry=registry, rule="prefill", facts={**facts, "batch_size": batch}, lane="main",
            kind="prefill",
        )  # fmt: skip

    first = bind(bound, 4)
    wrapper_buffers.keep_flashinfer_buffers(registry)
    assert bind(bound, 4) is first is binding_of(bound)
    grown = bind(bound, 4096)
    assert grown is binding_of(bound) and grown.region.nbytes > first.region.nbytes  # type: ignore[union-attr]
    assert bound._int_workspace_buffer is grown.region.tensor  # type: ignore[union-attr]
    assert bind(kept, 4) is None and binding_of(kept) is None and kept._int_workspace_buffer.numel() == 8 * MiB
    assert wrapper_buffers.int_setting_of(kept) is None
    ((stats,),) = [registry.memory_stats()["int_regions"]]
    assert (stats["wrappers"], stats["regions"], stats["region_bytes"]) == (1, 1, grown.region.nbytes)  # type: ignore[union-attr]


def test_bind_recorded_says_what_was_done_with_each_wrapper_for_as_long_as_it_lives(
    fresh_hook: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's wrapper is recorded with its rule, or why it keeps FlashInfer's buffers, while it lives."""
    import flashinfer

    float_ws = torch.zeros(MiB, dtype=torch.uint8)
    facts = {"batch_size": 4, "num_tokens": 64, "num_qo_heads": 8, "num_kv_heads": 2, "sm_count": 132}
    bound, kept, mla = PrefillWrapperDouble(float_ws, backend="fa2"), _Wrapper(), _Wrapper()

    def bind(wrapper: object, rule: str) -> wrapper_buffers.WrapperRecord:
        return wrapper_buffers.bind_recorded(
            wrapper, float_ws, kind=rule, rule=rule, facts=facts, lane="main", label=f"engine-{rule}"
        )

    record = bind(bound, "prefill")
    assert wrapper_buffers.wrapper_record(bound) is record and (record.rule, record.why) == ("prefill", None)
    assert binding_of(bound).kind == "engine-prefill"  # type: ignore[union-attr]
    monkeypatch.setattr(flashinfer, "__version__", "9.9")
    unread = bind(mla, "mla")
    assert unread.rule is None and "FlashInfer 9.9 is not a version whose MLA backend wspool has read" in str(
        unread.why
    )
    wrapper_buffers.keep_flashinfer_buffers(wspool.get_registry())
    left = bind(kept, "prefill")
    assert (left.rule, left.why) == (None, "the registry keeps FlashInfer's buffers") and binding_of(kept) is None
    assert wrapper_buffers.wrapper_record(kept) is left and wrapper_buffers.wrapper_record(_Wrapper()) is None
    gone = weakref.ref(left)
    del kept, left
    gc.collect()
    assert gone() is None and wrapper_buffers.wrapper_record(mla) is unread


# -- wspool's own paged plans (the doubles) --------------------------------------------------


def _decode(lengths: list[int], seed: int = 0, registry: wspool.PoolRegistry | None = None) -> tuple[object, object]:
    inputs = make_paged_inputs(lengths, q_lens=[1] * len(lengths), seed=seed)
    plan = paged_decode_plan(
        inputs.block_tables, inputs.seq_lens, num_qo_heads=inputs.num_qo_heads, num_kv_heads=inputs.num_kv_heads,
        head_dim=inputs.head_dim, page_size=inputs.page_size, registry=registry,
    )  # fmt: skip
    return inputs, plan


def test_a_paged_wrapper_plans_into_a_region_that_grows_with_the_batch(h200_wrapper_doubles: None) -> None:
    """reset_workspace_buffer gives the wrapper a region of rule decode's size; a larger batch gets a larger one."""
    small_in, small = _decode([37, 1, 64, 100], seed=1)
    (wrapper,) = DecodeWrapperDouble.instances
    first = binding_of(wrapper)
    assert first is not None and wrapper._int_workspace_buffer is first.region.tensor
    hkv = small_in.num_kv_heads  # type: ignore[attr-defined]
    assert first.region.nbytes == round_up(13 * max(4, ceil_div(32 * 132, hkv)) + 64, 16)
    assert wrapper._pin_memory_int_workspace_buffer.numel() == first.region.nbytes
    big_in, big = _decode([2] * 5000, seed=2)  # more requests than the grid's rows: a larger bound
    second = binding_of(wrapper)
    assert second is not None and second.region is not first.region and second.region.nbytes > first.region.nbytes
    # The small plan's record was cleared: it replans (into the new region) and is right.
    before = small.plan_calls  # type: ignore[attr-defined]
    got = small.run(small_in.query, small_in.kv_cache)  # type: ignore[attr-defined]
    want = paged_attention_reference(
        small_in.query, small_in.kv_cache, small_in.qo_indptr, small_in.block_tables,  # type: ignore[attr-defined]
        small_in.seq_lens, sm_scale=small_in.head_dim**-0.5, causal=False,  # type: ignore[attr-defined]
    )[0]  # fmt: skip
    torch.testing.assert_close(got, want)
    assert small.plan_calls == before + 1  # type: ignore[attr-defined]
    assert binding_of(wrapper) is second  # the bigger region holds the small plan too
    del big_in, big


def test_a_failed_reseat_leaves_the_previous_binding_whole(
    h200_wrapper_doubles: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reset_workspace_buffer that fails (its pinned copy cannot be made) records nothing: the wrapper keeps its
    region and a copy of that size, its plan stays valid, and a retry asks FlashInfer again."""
    small_in, small = _decode([37, 1, 64, 100], seed=1)
    (wrapper,) = DecodeWrapperDouble.instances
    first = binding_of(wrapper)
    assert first is not None
    monkeypatch.setattr(DecodeWrapperDouble, "pinned_failures", 1)
    with pytest.raises(RuntimeError, match=r"^CUDA error: out of memory \(a pinned host copy\)$"):
        _decode([2] * 5000, seed=2)
    assert binding_of(wrapper) is first and wrapper_regions(wspool.get_registry()).binding(wrapper) is first
    assert wrapper._int_workspace_buffer is first.region.tensor
    assert wrapper._pin_memory_int_workspace_buffer.numel() == first.region.nbytes
    before = small.plan_calls  # type: ignore[attr-defined]
    got = small.run(small_in.query, small_in.kv_cache)  # type: ignore[attr-defined]
    assert small.plan_calls == before  # type: ignore[attr-defined]  # its region still holds its plan
    want = paged_attention_reference(
        small_in.query, small_in.kv_cache, small_in.qo_indptr, small_in.block_tables,  # type: ignore[attr-defined]
        small_in.seq_lens, sm_scale=small_in.head_dim**-0.5, causal=False,  # type: ignore[attr-defined]
    )[0]  # fmt: skip
    torch.testing.assert_close(got, want)
    big_in, big = _decode([2] * 5000, seed=2)
    second = binding_of(wrapper)
    assert second is not None and second.region.nbytes > first.region.nbytes
    assert wrapper._int_workspace_buffer is second.region.tensor
    assert wrapper._pin_memory_int_workspace_buffer.numel() == second.region.nbytes
    del big_in, big


@pytest.mark.parametrize(("gpu", "bound"), [(A100, True), (H200, False)], ids=["a100", "h200"])
def test_an_auto_prefill_binds_where_its_planner_is_fa2(
    h200_wrapper_doubles: None, gpu: DeviceDescription, bound: bool
) -> None:
    """Prefill on backend auto plans with fa2 off SM90 (a region of rule prefill); on SM90 fa3 may plan it (none)."""
    inputs = make_paged_inputs([37, 5, 64, 100], q_lens=[10, 5, 1, 33], seed=3)
    with fake_device("cpu", gpu):
        registry = wspool.PoolRegistry()
        plan = paged_prefill_plan(
            inputs.qo_indptr, inputs.block_tables, inputs.seq_lens, num_qo_heads=inputs.num_qo_heads,
            num_kv_heads=inputs.num_kv_heads, head_dim=inputs.head_dim, page_size=inputs.page_size, registry=registry,
        )  # fmt: skip
    (wrapper,) = PrefillWrapperDouble.instances
    binding = binding_of(wrapper)
    assert (binding is not None) is bound and plan.int_rule == ("prefill" if bound else None)
    assert wrapper._int_workspace_buffer.numel() == (binding.region.nbytes if binding else 8 * MiB)
    got = plan.run(inputs.query, inputs.kv_cache)
    want = paged_attention_reference(
        inputs.query, inputs.kv_cache, inputs.qo_indptr, inputs.block_tables, inputs.seq_lens,
        sm_scale=inputs.head_dim**-0.5, causal=True,
    )[0]  # fmt: skip
    torch.testing.assert_close(got, want)


def test_statistics_report_regions_and_flashinfers_defaults(h200_wrapper_doubles: None) -> None:
    """memory_summary names the regions, the wrappers on them, and what FlashInfer's defaults would hold."""
    registry = wspool.PoolRegistry()
    inputs, plan = _decode([37, 1, 64, 100], registry=registry)
    summary = registry.memory_summary()
    assert "int workspace regions on cpu lane main: 1 region(s) of " in summary
    assert "for 1 wrapper(s) (decode 1)" in summary
    assert "1 wrapper(s) (1 on wspool int regions, " in summary
    assert "(FlashInfer's defaults: 8MiB + 8MiB pinned)" in summary
    (kernel,) = registry.memory_stats()["kernel_buffers"]
    assert kernel["bound_wrappers"] == 1 and 0 < kernel["region_bytes"] < 64 * 1024
    del inputs, plan


# -- bad configuration of the int rules ----------------------------------------------------


def test_an_mla_rule_below_the_planners_carves_is_refused_before_any_region(
    hopper: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pools.flashinfer_int.rules.mla below what the MLA planner carves is refused naming the key; no region is made."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__RULES__MLA", "1KiB")
    registry = wspool.PoolRegistry()
    inputs = make_inputs(2, 4, [50, 60])
    with pytest.raises(
        ConfigError,
        match=r"^pools\.flashinfer_int\.rules\.mla / WSPOOL_POOLS__FLASHINFER_INT__RULES__MLA resolves to 1024 bytes "
        r"on cpu, below the 589904 bytes FlashInfer's MLA planner carves there .*; raise it to at least 589904$",
    ):
        _plan(inputs, registry=registry)
    assert wrapper_regions(registry).stats() == []
    assert all(binding_of(w) is None for w in WrapperDouble.instances)


def test_an_int_carve_overflow_names_the_int_rule_and_leaves_the_pool(
    h200_wrapper_doubles: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A region too small for a plan (a configured decode rule) raises WorkspaceOverflowError naming that rule;
    the float pool does not grow for it."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__RULES__DECODE", "16")
    registry = wspool.PoolRegistry()
    with pytest.raises(
        WorkspaceOverflowError,
        match=r"^FlashInfer paged decode overflowed its int workspace \(a region of pool flashinfer_int\): "
        r"batch_decode_request_indices needs \d+ bytes with 16 left; raise pools\.flashinfer_int\.rules\.decode / "
        r"WSPOOL_POOLS__FLASHINFER_INT__RULES__DECODE$",
    ):
        _decode([37, 1, 64, 100], registry=registry)
    assert registry.stats("flashinfer", "cpu").grow_count == 1


def test_an_unbound_wrappers_int_overflow_is_raised_as_it_is() -> None:
    """Without a wspool region, an int carve's overflow is FlashInfer's own error, unchanged."""
    pool = wspool.PoolRegistry().pool("flashinfer", "cpu")
    error = RuntimeError(int_overflow_message("mla_work_indptr", 65536, 65520))
    with pytest.raises(RuntimeError) as info:
        grow_after_overflow(error, pool=pool, capacity=1 << 20, attempt=0, op="MLA decode", rule="lse",
                            setting="x", float_carves=MLA_FLOAT_CARVES)  # fmt: skip
    assert info.value is error


def test_call_supplying_supplies_the_binding_on_its_thread_for_the_call_only() -> None:
    """The plan call sees its binding on its own thread; a nested call's is restored after; other threads see none."""
    outer, inner = (WrapperBinding(None, None, "mla") for _ in range(2))  # type: ignore[arg-type]
    supplied = wrapper_buffers.SUPPLIED_BY_THREAD
    seen: list[object] = []

    def elsewhere() -> None:
        seen.append(supplied.get(threading.get_ident()))

    def plan() -> None:
        seen.append(supplied.get(threading.get_ident()))
        wrapper_buffers.call_supplying(inner, lambda: seen.append(supplied.get(threading.get_ident())))
        seen.append(supplied.get(threading.get_ident()))
        other = threading.Thread(target=elsewhere)
        other.start()
        other.join()

    wrapper_buffers.call_supplying(outer, plan)
    assert seen == [outer, inner, outer, None]
    assert supplied.get(threading.get_ident()) is None
