"""GPU tests for wspool.flashinfer.wrapper_buffers: FlashInfer's int workspaces from wspool, on a real device.

Each result is compared bit for bit with the same plan on FlashInfer's own
buffers (a registry that keeps them), including replays after other sizes
were replanned.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import wspool
from tests.helpers.mla_inputs import MLAInputs, make_inputs
from wspool.errors import WorkspaceConflictError, WorkspaceLimitError
from wspool.flashinfer import mla_decode_plan, mla_decode_reference, wrapper_buffers
from wspool.flashinfer.kernels import load_flashinfer_attention
from wspool.flashinfer.wrapper_buffers import WrapperBinding, binding_of, wrapper_regions
from wspool.tools.graph_plans import BATCH_SIZES, measure_graph_plans
from wspool.units import MiB

pytestmark = pytest.mark.gpu

HEADS = 128


class _Wrapper:
    """Any object wspool binds (kernel wrappers are plain objects held weakly)."""


def _mla_int_bytes() -> int:
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    return 9 * 65536 + 5 * -(-4 * sm // 16) * 16


def _inputs(batch: int, seed: int, max_len: int = 1024) -> MLAInputs:
    lengths = [random.Random(seed * 1000 + i).randint(1, max_len) for i in range(batch)]
    return make_inputs(batch, HEADS, lengths, page_size=64, dtype=torch.bfloat16, device="cuda", seed=seed)


def _graph_plan(registry: wspool.PoolRegistry, inputs: MLAInputs, group: str | None = None) -> object:
    return mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=HEADS, sm_scale=inputs.sm_scale,
        page_size=64, return_lse=True, registry=registry, use_cuda_graph=True, int_group=group,
    )  # fmt: skip


def _capture(plan: object, inputs: MLAInputs, out: torch.Tensor, lse: torch.Tensor) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.run(inputs.query, inputs.kv_cache, out=out, lse=lse)  # type: ignore[attr-defined]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(inputs.query, inputs.kv_cache, out=out, lse=lse)  # type: ignore[attr-defined]
    return graph


def _outputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(batch, 1, HEADS, 512, dtype=torch.bfloat16, device="cuda"),
        torch.empty(batch, 1, HEADS, dtype=torch.float32, device="cuda"),
    )


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_mla_backends_take_the_bound_region_and_pinned_copy(graph: bool) -> None:
    """After plan(), FlashInfer's backend object holds wspool's region and pinned copy, sized by rule mla."""
    assert wrapper_buffers.install_mla_hook() is None, wrapper_buffers.mla_hook_status()
    registry = wspool.PoolRegistry()
    inputs = _inputs(8, seed=1)
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=HEADS, sm_scale=inputs.sm_scale,
        page_size=64, return_lse=True, registry=registry, use_cuda_graph=graph,
    )  # fmt: skip
    for _ in range(2):
        plan.replan()
        wrapper = plan._wrapper
        binding = binding_of(wrapper)
        assert binding is not None and binding.pinned is not None
        backend = wrapper._planned_backend
        assert backend._int_workspace_buffer is binding.region.tensor
        assert backend._pin_memory_int_workspace_buffer is binding.pinned
        assert binding.pinned.is_pinned()
        assert binding.region.nbytes == binding.pinned.numel() == _mla_int_bytes()
        assert backend._staged_int_workspace_bytes == _mla_int_bytes()  # the planner used every byte


@pytest.mark.parametrize("mode", ["pooled", "shared"])
def test_twenty_graph_plans_are_bit_identical_to_flashinfers_buffers(mode: str) -> None:
    """20 graph plans (batch 1..256, 128 heads, LSE): outputs and LSE equal FlashInfer's own buffers' bit for bit.

    Then three steps of new lengths: every size is replanned (others after it), and each graph replays
    through plan.replay(), which replans a plan whose shared region another plan took.
    """
    own, pooled = wspool.PoolRegistry(), wspool.PoolRegistry()
    wrapper_buffers.keep_flashinfer_buffers(own)
    group = "decode" if mode == "shared" else None
    sizes = BATCH_SIZES
    rows = []
    for i, batch in enumerate(sizes):
        inputs = _inputs(batch, seed=i)
        variants = []
        for registry, grp in ((own, None), (pooled, group)):
            plan = _graph_plan(registry, inputs, grp)
            out, lse = _outputs(batch)
            variants.append((plan, _capture(plan, inputs, out, lse), out, lse))
        rows.append((inputs, variants))
    regions = {id(binding_of(v[1][0]._wrapper).region) for _, v in rows}  # type: ignore[union-attr]
    assert len(regions) == (1 if mode == "shared" else len(sizes))
    assert all(binding_of(v[0][0]._wrapper) is None for _, v in rows)
    for step in range(3):
        for inputs, _ in rows:
            new = torch.randint(1, inputs.max_seq_len + 1, inputs.seq_lens.shape, generator=None, device="cuda")
            inputs.seq_lens.copy_(new.to(torch.int32))
        order = list(range(len(rows)))
        random.Random(step).shuffle(order)
        for index in order:  # replan every size, in a new order each step, before any replay
            for plan, *_ in rows[index][1]:
                plan.replan()
        for index in order:
            inputs, ((own_plan, own_graph, own_out, own_lse), (plan, graph, out, lse)) = rows[index]
            own_plan.replay(own_graph)
            plan.replay(graph)
            torch.cuda.synchronize()
            assert torch.equal(out, own_out), f"batch {inputs.seq_lens.numel()} step {step}: outputs differ"
            assert torch.equal(lse, own_lse), f"batch {inputs.seq_lens.numel()} step {step}: LSE differs"
        want_out, _ = mla_decode_reference(
            rows[-1][0].query, rows[-1][0].kv_cache, rows[-1][0].block_tables, rows[-1][0].seq_lens,
            sm_scale=rows[-1][0].sm_scale,
        )  # fmt: skip
        got = rows[-1][1][1][2].float()
        assert float((got - want_out.float()).norm() / want_out.float().norm()) < 1e-2


def test_a_shared_region_without_wspools_check_replays_the_other_plan() -> None:
    """Why sharing needs the record: a raw replay after another plan of the group planned reads that plan's metadata."""
    registry = wspool.PoolRegistry()
    a_in = _inputs(16, seed=3)
    # b's requests are shorter: a's graph, replaying b's schedule, stays inside a's pages.
    shorter = [max(1, n // 2) for n in a_in.seq_lens.tolist()]
    b_in = make_inputs(16, HEADS, shorter, page_size=64, dtype=torch.bfloat16, device="cuda", seed=4)
    a, b = _graph_plan(registry, a_in, "g"), _graph_plan(registry, b_in, "g")
    a_out, a_lse = _outputs(16)
    a.replan()  # type: ignore[attr-defined]
    graph = _capture(a, a_in, a_out, a_lse)
    want = a_out.clone()
    b.replan()  # type: ignore[attr-defined]
    graph.replay()  # not a.replay(graph): nothing replans a
    torch.cuda.synchronize()
    assert not torch.equal(a_out, want)
    a.replay(graph)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    assert torch.equal(a_out, want)


def test_two_plans_that_must_not_share_run_interleaved_correctly() -> None:
    """Two graph plans of one group, both planned, run layer by layer in turn: each replans and is right.

    Capture of one while the other holds the region is refused, and nothing is captured; plans with
    regions of their own, captured together, replay interleaved with no replan.
    """
    registry = wspool.PoolRegistry()
    a_in, b_in = _inputs(8, seed=5), _inputs(24, seed=6)
    want_a = mla_decode_reference(a_in.query, a_in.kv_cache, a_in.block_tables, a_in.seq_lens, sm_scale=a_in.sm_scale)
    want_b = mla_decode_reference(b_in.query, b_in.kv_cache, b_in.block_tables, b_in.seq_lens, sm_scale=b_in.sm_scale)
    a, b = _graph_plan(registry, a_in, "g"), _graph_plan(registry, b_in, "g")
    results = []
    for _ in range(3):
        results.append((a.run(a_in.query, a_in.kv_cache), b.run(b_in.query, b_in.kv_cache)))  # type: ignore[attr-defined]
    for (out_a, _), (out_b, _) in results:
        assert torch.equal(out_a, results[0][0][0]) and torch.equal(out_b, results[0][1][0])
        assert float((out_a.float() - want_a[0].float()).norm() / want_a[0].float().norm()) < 1e-2
        assert float((out_b.float() - want_b[0].float()).norm() / want_b[0].float().norm()) < 1e-2
    assert a.plan_calls >= 4 and b.plan_calls >= 4  # type: ignore[attr-defined]
    out, lse = _outputs(8)
    a.replan()  # type: ignore[attr-defined]
    b.replan()  # type: ignore[attr-defined]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(WorkspaceConflictError, match=r"int_group 'g'.*int_group=None"), torch.cuda.graph(graph):
        a.run(a_in.query, a_in.kv_cache, out=out, lse=lse)  # type: ignore[attr-defined]
    own_a, own_b = _graph_plan(registry, a_in), _graph_plan(registry, b_in)
    outs = [_outputs(8), _outputs(24)]
    graphs = [_capture(own_a, a_in, *outs[0]), _capture(own_b, b_in, *outs[1])]
    firsts = [o.clone() for o, _ in outs]
    for _ in range(3):
        for graph_i, (o, _), first in zip(graphs, outs, firsts, strict=True):
            graph_i.replay()
            torch.cuda.synchronize()
            assert torch.equal(o, first)
    assert torch.equal(firsts[0], results[0][0][0].view_as(firsts[0]))


def test_twenty_graph_plans_fit_the_memory_aims() -> None:
    """20 CUDA-graph MLA plans: at most 40 MiB beyond the caller's tensors on the device, 16 MiB pinned.

    Pinned: the page-locked chunks wspool's copies are cut from, with 1 MiB left for the staging block
    FlashInfer's plan takes from PyTorch's pinned allocator (one, reused by every plan).
    """
    for mode in ("pooled", "shared"):
        figures = measure_graph_plans(wspool.PoolRegistry(), int_workspace=mode)
        assert figures["beyond_caller_bytes"] <= 40 * MiB, figures
        assert figures["kernel_device_bytes"] == 0, figures
        assert figures["kernel_pinned_host_bytes"] <= figures["wspool_pinned_chunk_bytes"] <= 15 * MiB, figures


# -- paged wrappers ----------------------------------------------------------------------


def _paged_case(batch: int, length: int, hq: int, hkv: int, page: int = 16) -> tuple[torch.Tensor, ...]:
    per = -(-length // page)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * per
    indices = torch.randperm(batch * per, device="cuda").to(torch.int32)
    last = torch.full((batch,), length - (per - 1) * page, dtype=torch.int32, device="cuda")
    return indptr, indices, last


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_paged_decode_rules_bound_the_plan_and_results_are_bit_identical(tensor_cores: bool, graph: bool) -> None:
    """Over batches, lengths and head counts: workspace_size()'s int bytes never exceed the rule; a wrapper
    bound to a region of exactly the rule's size plans and gives the same bits as one on FlashInfer's buffers."""
    flashinfer = load_flashinfer_attention()
    registry = wspool.PoolRegistry()
    float_ws = torch.zeros(256 * MiB, dtype=torch.uint8, device="cuda")
    rule = wrapper_buffers.paged_int_rule("decode", use_tensor_cores=tensor_cores, backend="auto",
                                          dtypes=(torch.bfloat16,))  # fmt: skip
    assert rule is not None
    dim, page = 128, 16
    for batch, length, hq, hkv in [(1, 100, 32, 8), (7, 4000, 32, 8), (64, 3000, 64, 8), (512, 300, 8, 8),
                                   (256, 8000, 128, 1), (4096, 200, 32, 4)]:  # fmt: skip
        if not tensor_cores and hq // hkv > 8:
            continue  # FlashInfer's CUDA-core decode takes GQA groups up to 8
        indptr, indices, last = _paged_case(batch, length, hq, hkv)
        facts = {"batch_size": batch, "num_tokens": batch, "num_qo_heads": hq, "num_kv_heads": hkv}
        bound = wrapper_buffers.int_bytes(registry, rule, torch.device("cuda", 0), facts)
        kv = torch.randn(int(indices.numel()), 2, page, hkv, dim, device="cuda").to(torch.bfloat16)
        query = torch.randn(batch, hq, dim, device="cuda").to(torch.bfloat16)
        outs = []
        for bind in (False, True):
            kwargs = {"use_tensor_cores": tensor_cores}
            if graph:
                kwargs.update(
                    use_cuda_graph=True, paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
                    paged_kv_last_page_len_buffer=last.clone(),
                )  # fmt: skip
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(float_ws, "NHD", **kwargs)
            size = wrapper.workspace_size(indptr, indices, last, hq, hkv, dim, page, q_data_type=torch.bfloat16)
            assert size[1] <= bound, (batch, length, hq, hkv, size, bound)
            if bind:
                binding = wrapper_buffers.bind_paged_wrapper(
                    wrapper, float_ws, registry=registry, rule=rule, facts=facts, lane="main", kind="decode"
                )
                assert binding is not None and wrapper._int_workspace_buffer is binding.region.tensor
                assert wrapper._pin_memory_int_workspace_buffer.numel() == binding.region.nbytes
            wrapper.plan(indptr, indices, last, hq, hkv, dim, page, q_data_type=torch.bfloat16)
            outs.append(wrapper.run(query, kv))
        assert torch.equal(outs[0], outs[1]), (batch, length, hq, hkv)


def test_paged_prefill_rule_bounds_the_fa2_planner() -> None:
    """fa2 prefill: workspace_size()'s int bytes never exceed rule prefill; the bound wrapper's bits match."""
    flashinfer = load_flashinfer_attention()
    registry = wspool.PoolRegistry()
    float_ws = torch.zeros(256 * MiB, dtype=torch.uint8, device="cuda")
    dim, page = 128, 16
    for rows, length, hq, hkv in [([100] * 4, 2000, 32, 8), ([7] * 64, 500, 32, 8), ([1, 2000, 33], 4000, 64, 8),
                                  ([8192], 8192, 32, 8), ([300] * 27, 1000, 8, 1)]:  # fmt: skip
        batch = len(rows)
        qo_indptr = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        indptr, indices, last = _paged_case(batch, length, hq, hkv)
        tokens = sum(rows)
        facts = {"batch_size": batch, "num_tokens": tokens, "num_qo_heads": hq, "num_kv_heads": hkv}
        bound = wrapper_buffers.int_bytes(registry, "prefill", torch.device("cuda", 0), facts)
        kv = torch.randn(int(indices.numel()), 2, page, hkv, dim, device="cuda").to(torch.bfloat16)
        query = torch.randn(tokens, hq, dim, device="cuda").to(torch.bfloat16)
        outs = []
        for bind in (False, True):
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_ws, "NHD", backend="fa2")
            args = (qo_indptr, indptr, indices, last, hq, hkv, dim, page)
            size = wrapper.workspace_size(*args, causal=True, q_data_type=torch.bfloat16)
            assert size[1] <= bound, (rows, length, hq, hkv, size, bound)
            if bind:
                wrapper_buffers.bind_paged_wrapper(
                    wrapper, float_ws, registry=registry, rule="prefill", facts=facts, lane="main", kind="prefill"
                )
            wrapper.plan(*args, causal=True, q_data_type=torch.bfloat16)
            outs.append(wrapper.run(query, kv))
        assert torch.equal(outs[0], outs[1]), rows


def test_paged_decode_graph_plans_shrink_the_wrappers_buffers() -> None:
    """20 graph-mode paged decode wrappers: int regions of a few KiB each instead of 8 MiB + 8 MiB pinned."""
    own = measure_graph_plans(wspool.PoolRegistry(), kind="paged", int_workspace="flashinfer")
    pooled = measure_graph_plans(wspool.PoolRegistry(), kind="paged")
    assert own["kernel_device_bytes"] >= 20 * 8 * MiB and own["region_bytes"] == 0
    # What stays the wrappers' own is their small length buffers, not an int workspace.
    assert pooled["kernel_device_bytes"] < 20 * 4096 and 0 < pooled["region_bytes"] < 2 * MiB
    assert pooled["kernel_pinned_host_bytes"] == pooled["region_bytes"]


def test_a_failed_reseat_keeps_the_int_workspace_and_its_pinned_copy_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real decode wrapper whose move to a larger region fails (its pinned copy cannot be allocated) keeps its
    region, a pinned copy of that size and its plan; the retry moves it whole, and it plans as FlashInfer's own."""
    flashinfer = load_flashinfer_attention()
    registry = wspool.PoolRegistry()
    float_ws = torch.zeros(256 * MiB, dtype=torch.uint8, device="cuda")
    hq, hkv, dim, page = 32, 8, 128, 16

    def bind(wrapper: Any, batch: int) -> WrapperBinding | None:
        facts = {"batch_size": batch, "num_tokens": batch, "num_qo_heads": hq, "num_kv_heads": hkv}
        return wrapper_buffers.bind_paged_wrapper(
            wrapper, float_ws, registry=registry, rule="decode", facts=facts, lane="main", kind="decode"
        )

    def run(wrapper: Any, batch: int, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        indptr, indices, last = _paged_case(batch, 32, hq, hkv)
        kv = torch.randn(int(indices.numel()), 2, page, hkv, dim, device="cuda").to(torch.bfloat16)
        query = torch.randn(batch, hq, dim, device="cuda").to(torch.bfloat16)
        wrapper.plan(indptr, indices, last, hq, hkv, dim, page, q_data_type=torch.bfloat16)
        out: torch.Tensor = wrapper.run(query, kv)
        return out

    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(float_ws, "NHD")
    first = bind(wrapper, 8)  # rule decode on 132 SMs: about 7 KB; at batch 4096, about 53 KB
    assert first is not None
    small = run(wrapper, 8, seed=1)
    empty = torch.empty

    def no_pinned_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory")
        return empty(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", no_pinned_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            bind(wrapper, 4096)
    assert binding_of(wrapper) is first and wrapper._int_workspace_buffer is first.region.tensor
    pinned = wrapper._pin_memory_int_workspace_buffer
    assert pinned.is_pinned() and pinned.numel() == first.region.nbytes
    assert torch.equal(run(wrapper, 8, seed=1), small)
    second = bind(wrapper, 4096)
    assert second is not None and second is binding_of(wrapper) and second.region.nbytes > first.region.nbytes
    assert wrapper._int_workspace_buffer is second.region.tensor
    assert wrapper._pin_memory_int_workspace_buffer.numel() == second.region.nbytes
    own = flashinfer.BatchDecodeWithPagedKVCacheWrapper(float_ws, "NHD")
    assert torch.equal(run(wrapper, 4096, seed=2), run(own, 4096, seed=2))


def test_the_regions_cap_counts_cuda_however_it_is_spelt(monkeypatch: pytest.MonkeyPatch) -> None:
    """pools.flashinfer_int.max_bytes counts cuda:0's regions whether a wrapper names torch.device("cuda") or
    "cuda:0": a second MLA-sized region does not fit under 1 MiB either way."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__MAX_BYTES", "1MiB")
    registry = wspool.PoolRegistry()
    wrapper_buffers.declare_int_pool(registry)
    regions = wrapper_regions(registry)
    torch.cuda.set_device(0)
    first, second = _Wrapper(), _Wrapper()
    binding = regions.bind(first, device=torch.device("cuda"), nbytes=_mla_int_bytes(), kind="mla", lane="main")
    assert binding.region.device == "cuda:0"
    held = 2 * binding.region.nbytes
    for spelt in (torch.device("cuda"), torch.device("cuda", 0)):
        with pytest.raises(WorkspaceLimitError, match=rf"on cuda:0 lane main would hold {held} bytes, over max_bytes"):
            regions.bind(second, device=spelt, nbytes=_mla_int_bytes(), kind="mla", lane="main")
    ((stats,),) = [regions.stats()]
    assert (stats["device"], stats["regions"]) == ("cuda:0", 1)
