"""GPU tests for wspool.flashinfer.mla: FlashInfer's MLA decode with the pool's buffer, on a real device."""

from __future__ import annotations

import logging

import pytest
import torch

import wspool
from tests.helpers.mla_inputs import MLAInputs, make_inputs
from wspool.errors import WorkspaceFrozenError
from wspool.flashinfer import mla as mla_module
from wspool.flashinfer import mla_decode, mla_decode_plan, mla_decode_reference
from wspool.flashinfer.backends import BLACKWELL_ARCHS, device_arch
from wspool.units import MiB, format_size

pytestmark = pytest.mark.gpu

# (batch, heads, lengths): batch 1, 32 and 128; heads 16 and 128; ragged lengths up to 8192.
SHAPES = [
    (1, 16, [1024]),
    (1, 128, [8192]),
    (32, 16, [64 * (i + 1) + i for i in range(32)]),
    (32, 128, [8192 - 250 * i for i in range(32)]),
    (128, 16, [(37 * i) % 2048 + 1 for i in range(128)]),
    (128, 128, [4096 + (97 * i) % 4096 for i in range(128)]),
]


def _inputs(batch: int, heads: int, lengths: list[int], seed: int = 0) -> MLAInputs:
    return make_inputs(batch, heads, lengths, page_size=64, dtype=torch.bfloat16, device="cuda", seed=seed)


def _reference(inputs: MLAInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_decode_reference(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _decode(inputs: MLAInputs, **kwargs: object) -> object:
    return mla_decode(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
        sm_scale=inputs.sm_scale, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("return_lse", [False, True], ids=["plain", "lse"])
@pytest.mark.parametrize(("batch", "heads", "lengths"), SHAPES, ids=[f"b{b}-h{h}" for b, h, _ in SHAPES])
def test_matches_fp32_reference(batch: int, heads: int, lengths: list[int], return_lse: bool) -> None:
    """FlashInfer's MLA decode through the pool matches the fp32 reference (out rel < 1e-2, LSE abs < 1e-3)."""
    inputs = _inputs(batch, heads, lengths)
    result = _decode(inputs, return_lse=return_lse)
    want_out, want_lse = _reference(inputs)
    out = result[0] if return_lse else result  # type: ignore[index]
    err = _rel_err(out, want_out)  # type: ignore[arg-type]
    print(f"\nMLA b={batch} h={heads} max_len={max(lengths)} lse={return_lse}: out rel err {err:.2e}", end="")
    assert err < 1e-2
    if return_lse:
        lse_err = float((result[1] - want_lse).abs().max())  # type: ignore[index]
        print(f", lse abs err {lse_err:.2e}", end="")
        assert lse_err < 1e-3


def test_pool_holds_the_rule_size_and_reuses_it() -> None:
    """The pool holds exactly what the device's lse rule resolved; later calls reuse the same buffer."""
    registry = wspool.get_registry()
    inputs = _inputs(32, 128, [4096] * 32)
    _decode(inputs, return_lse=True)
    stats = registry.stats("flashinfer_mla", device="cuda")
    assert stats.capacity_bytes == registry.resolve("flashinfer_mla", rule="lse", device="cuda")
    assert stats.last_grow_reason == f"rule lse: {format_size(stats.capacity_bytes)}"  # the rule, no recovery
    pointer = registry.pool("flashinfer_mla", "cuda").buffer.data_ptr()  # type: ignore[union-attr]
    _decode(_inputs(32, 128, [4000] * 32, seed=1), return_lse=True)
    after = registry.stats("flashinfer_mla", device="cuda")
    assert registry.pool("flashinfer_mla", "cuda").buffer.data_ptr() == pointer  # type: ignore[union-attr]
    assert after.grow_count == stats.grow_count == 1
    assert after.request_count == 2


def _wrapper_path() -> str:
    """The planned-wrapper backend wspool resolves 'auto' to on this GPU; skip on Blackwell."""
    arch = device_arch(torch.device("cuda", torch.cuda.current_device()))
    if arch in BLACKWELL_ARCHS:
        pytest.skip("this GPU takes the trtllm-gen / cute-dsl path, not the planned wrapper")
    return "fa3" if arch == (9, 0) else "fa2"


def test_undersized_rule_recovers_once(caplog: pytest.LogCaptureFixture) -> None:
    """An 8MiB rule is raised to the path's known need before plan(): one grow, one warning, the same kernel."""
    path = _wrapper_path()
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer_mla": {"rules": {"default": "8MiB"}}})
    inputs = _inputs(64, 128, [4096] * 64)
    with caplog.at_level(logging.WARNING, logger="wspool"):
        plan = mla_decode_plan(
            inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=128, sm_scale=inputs.sm_scale,
            page_size=64, registry=registry,
        )  # fmt: skip
        out = plan.run(inputs.query, inputs.kv_cache)
    assert _rel_err(out, _reference(inputs)[0]) < 1e-2  # type: ignore[arg-type]
    stats = registry.stats("flashinfer_mla", device="cuda")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("wspool")]
    print(f"\nsized up front: {stats.last_grow_reason}, capacity {stats.capacity_bytes}, path {plan.path}, "
          f"FlashInfer planned {plan.flashinfer_backend}; warning: {warnings}", end="")  # fmt: skip
    assert plan.path == plan.flashinfer_backend == path
    assert stats.grow_count == 1 and stats.capacity_bytes >= plan.need_bytes > 8 * MiB
    assert plan.plan_calls == 1  # FlashInfer never refused
    assert len(warnings) == 1 and "WSPOOL_POOLS__FLASHINFER_MLA__RULES__DEFAULT" in warnings[0]


def test_refusal_recovery_keeps_the_path(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With no known need, FlashInfer's refusal (either version's form) is parsed and the pool grows; fa3 still runs."""
    path = _wrapper_path()
    monkeypatch.setattr(mla_module, "path_need_bytes", lambda *args, **kwargs: 0)  # the safety net alone
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer_mla": {"rules": {"default": "8MiB"}}})
    inputs = _inputs(64, 128, [4096] * 64)
    with caplog.at_level(logging.WARNING, logger="wspool"):
        plan = mla_decode_plan(
            inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=128, sm_scale=inputs.sm_scale,
            page_size=64, registry=registry,
        )  # fmt: skip
        out = plan.run(inputs.query, inputs.kv_cache)
    assert _rel_err(out, _reference(inputs)[0]) < 1e-2  # type: ignore[arg-type]
    stats = registry.stats("flashinfer_mla", device="cuda")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("wspool")]
    print(f"\nrecovered: {stats.last_grow_reason}, capacity {stats.capacity_bytes}, FlashInfer planned "
          f"{plan.flashinfer_backend}; warning: {warnings}", end="")  # fmt: skip
    assert plan.path == plan.flashinfer_backend == path
    assert stats.grow_count == 2 and plan.plan_calls == 2  # the 8MiB buffer, then one recovery
    assert stats.last_grow_reason.startswith("overflow recovery (")  # type: ignore[union-attr]
    assert len(warnings) == 1 and "WSPOOL_POOLS__FLASHINFER_MLA__RULES__DEFAULT" in warnings[0]


@pytest.mark.parametrize("return_lse", [False, True], ids=["plain", "lse"])
def test_cuda_graph_capture_and_replay(return_lse: bool) -> None:
    """A per-layer run captured in a CUDA graph replays with the eager output; new lengths replan in place."""
    registry = wspool.get_registry()
    inputs = _inputs(16, 128, [2048 + 37 * i for i in range(16)])
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=128, sm_scale=inputs.sm_scale,
        page_size=64, return_lse=return_lse, use_cuda_graph=True,
    )  # fmt: skip
    out = torch.empty(16, 1, 128, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(16, 1, 128, device="cuda")
    eager = plan.run(inputs.query, inputs.kv_cache, out=out, lse=lse if return_lse else None)
    eager_out = (eager[0] if return_lse else eager).clone()  # type: ignore[index]
    registry.freeze()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            plan.run(
                inputs.query, inputs.kv_cache, out=out, lse=lse if return_lse else None
            )  # warm-up on the side stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan.run(inputs.query, inputs.kv_cache, out=out, lse=lse if return_lse else None)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out)
        # The next step: one more token for every request, same tensors, replanned in place.
        inputs.seq_lens += 1
        plan.replan()
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, _reference(inputs)[0]) < 1e-2
        if return_lse:
            assert float((lse - _reference(inputs)[1]).abs().max()) < 1e-3
    finally:
        registry.unfreeze()


def test_capture_that_would_grow_raises_and_first_graph_survives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture needing growth (fixed profile: lse 256MiB over default 128MiB) raises; the first graph replays."""
    monkeypatch.setenv("WSPOOL_PROFILE", "fixed")  # rules lse and default differ on every device
    registry = wspool.get_registry()
    assert registry.resolve("flashinfer_mla", rule="lse", device="cuda") > registry.resolve(
        "flashinfer_mla", rule="default", device="cuda"
    )
    inputs = _inputs(8, 16, [1500] * 8)
    plan = mla_decode_plan(
        inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=16, sm_scale=inputs.sm_scale,
        page_size=64, use_cuda_graph=True,
    )  # fmt: skip
    out = torch.empty(8, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
    plan.run(inputs.query, inputs.kv_cache, out=out)
    want = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(inputs.query, inputs.kv_cache, out=out)
    pointer = registry.pool("flashinfer_mla", "cuda").buffer.data_ptr()  # type: ignore[union-attr]
    capacity = registry.stats("flashinfer_mla", device="cuda").capacity_bytes
    second = torch.cuda.CUDAGraph()
    with (
        pytest.raises(WorkspaceFrozenError, match=r"would have to grow during CUDA-graph capture.*RULES__LSE"),
        torch.cuda.graph(second),
    ):
        registry.workspace("flashinfer_mla", device="cuda", rule="lse")
    assert registry.pool("flashinfer_mla", "cuda").buffer.data_ptr() == pointer  # type: ignore[union-attr]
    assert registry.stats("flashinfer_mla", device="cuda").capacity_bytes == capacity
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_trtllm_gen_on_blackwell_only() -> None:
    """The trtllm-gen path runs where FlashInfer supports it (SM100/103/107); elsewhere it skips with the reason."""
    arch = device_arch(torch.device("cuda", torch.cuda.current_device()))
    if arch not in BLACKWELL_ARCHS:
        pytest.skip(f"trtllm-gen MLA decode needs Blackwell (SM100/103/107); this GPU is SM{arch[0]}{arch[1]}")  # type: ignore[index]
    inputs = _inputs(32, 128, [4096] * 32)
    out, lse = _decode(inputs, return_lse=True, backend="trtllm-gen")  # type: ignore[misc]
    want_out, want_lse = _reference(inputs)
    assert _rel_err(out, want_out) < 1e-2
    assert float((lse - want_lse).abs().max()) < 1e-3


def test_two_lanes_on_two_streams_match_serial() -> None:
    """MLA decode on two lanes from two concurrent streams gives the serial results; lanes never alias."""
    registry = wspool.get_registry()
    batches = [_inputs(32, 128, [4096 - 64 * i for i in range(32)], seed=s) for s in (11, 12)]
    plans = [
        mla_decode_plan(
            t.block_tables,
            t.seq_lens,
            t.max_seq_len,
            num_heads=128,
            sm_scale=t.sm_scale,
            page_size=64,
            return_lse=True,
            lane=lane,
        )
        for t, lane in zip(batches, ("ubatch0", "ubatch1"), strict=True)
    ]
    serial = [plan.run(t.query, t.kv_cache) for plan, t in zip(plans, batches, strict=True)]
    serial = [(o.clone(), lse.clone()) for o, lse in serial]  # type: ignore[misc]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results: list[object] = [None, None]
    for _ in range(10):
        for k in range(2):
            streams[k].wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(streams[k]):
                results[k] = plans[k].run(batches[k].query, batches[k].kv_cache)
    torch.cuda.synchronize()
    for (out, lse), (want_out, want_lse) in zip(results, serial, strict=True):  # type: ignore[misc]
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    pointers = {registry.pool("flashinfer_mla", "cuda", lane=lane).buffer.data_ptr() for lane in ("ubatch0", "ubatch1")}  # type: ignore[union-attr]
    assert len(pointers) == 2


def test_packed_queries_and_inference_mode() -> None:
    """Packed queries give the 4-D results; a pool and wrapper made under inference_mode serve calls outside it."""
    registry = wspool.PoolRegistry.from_config()
    with torch.inference_mode():
        inference = _inputs(4, 128, [300, 4096, 1, 2048], seed=5)
        out, lse = _decode(inference, return_lse=True, registry=registry)  # type: ignore[misc]
        want_out, want_lse = _reference(inference)
        assert _rel_err(out, want_out) < 1e-2 and float((lse - want_lse).abs().max()) < 1e-3
    inputs = _inputs(4, 128, [300, 4096, 1, 2048], seed=5)  # normal tensors, outside inference mode
    packed = inputs.query.view(4, 128, 576)
    got_out, got_lse = mla_decode(  # type: ignore[misc]
        packed, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
        sm_scale=inputs.sm_scale, return_lse=True, registry=registry,
    )  # fmt: skip
    assert got_out.shape == (4, 128, 512) and got_lse.shape == (4, 128)
    assert _rel_err(got_out, want_out.view(4, 128, 512)) < 1e-2
    assert float((got_lse - want_lse.view(4, 128)).abs().max()) < 1e-3
    assert registry.stats("flashinfer_mla", device="cuda").grow_count == 1
