"""GPU benchmarks of MLA decode through wspool against the same FlashInfer calls made directly.

Each runs on the current CUDA device, single-threaded, with the two variants
timed in alternating pairs; the planned wrapper only (Hopper, Ampere). Method
and figures: docs/performance.md.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from wspool.flashinfer import MLADecodePlan, backends, mla_decode, mla_decode_plan, wrapper_buffers
from wspool.flashinfer.backends import select_path
from wspool.registry import PoolRegistry
from wspool.settings.schema import VLLM_FIXED_MLA_WORKSPACE_BYTES
from wspool.tools.direct import PAGE_SIZE, SM_SCALE, DecodeInputs, DirectMLA
from wspool.tools.mla_probe import MLAWorkspaceProbe
from wspool.tools.sweep import MLAShape

__all__ = [
    "DecodeCallFigures",
    "DecodeStepFigures",
    "MemoryRow",
    "PlanSupplyFigures",
    "added_time_budget_us",
    "measure_decode_step",
    "measure_memory",
    "measure_mla_decode",
    "measure_mla_plan",
]


def added_time_budget_us(direct_us: float) -> float:
    """wspool's allowed added time: 2% of the direct call or 2 us, whichever is larger."""
    return max(0.02 * direct_us, 2.0)


@dataclass(frozen=True)
class DecodeCallFigures:
    """Median time of one step's ``mla_decode`` call (plan + run) through wspool and directly."""

    batch_size: int
    num_heads: int
    max_seq_len: int
    return_lse: bool
    wspool_us: float
    direct_us: float
    query_form: str = "4-D"
    """The query both sides were given: ``"4-D"`` or ``"packed"`` (FlashInfer's own form)."""
    paired_added_us: float | None = None
    """The median of the per-pair differences (wspool minus direct); ``None``: not measured."""
    noise_us: float | None = None
    """The same statistic for the direct calls against a second, identical direct wrapper (A/A)."""
    reshape_us: float | None = None
    """4-D rows: what the reshapes to and from FlashInfer's packed form cost the direct calls
    (direct 4-D minus direct packed, paired), which any backend holding 4-D tensors pays."""

    @property
    def added_us(self) -> float:
        """wspool's added time per call: the paired median where measured, else the difference of medians."""
        return self.paired_added_us if self.paired_added_us is not None else self.wspool_us - self.direct_us

    @property
    def ok(self) -> bool:
        """Whether the added time is within :func:`added_time_budget_us`."""
        return self.added_us <= added_time_budget_us(self.direct_us)

    def as_dict(self) -> dict[str, Any]:
        """Return the figures as plain data."""
        return {**asdict(self), "added_us": self.added_us, "ok": self.ok}


@dataclass(frozen=True)
class DecodeStepFigures:
    """One decode step of ``layers`` calls: plans per step and per-layer times."""

    batch_size: int
    num_heads: int
    max_seq_len: int
    layers: int
    plans_per_step: float
    wspool_layer_us: float
    direct_layer_us: float
    graph_step_us: float | None
    graph_note: str
    paired_added_layer_us: float | None = None
    """The median of the per-step differences, per layer; ``None``: not measured."""
    noise_layer_us: float | None = None
    """The same statistic for the direct steps against a second, identical direct wrapper (A/A)."""

    @property
    def added_us(self) -> float:
        """wspool's added time per layer: the paired median where measured, else the difference of medians."""
        if self.paired_added_layer_us is not None:
            return self.paired_added_layer_us
        return self.wspool_layer_us - self.direct_layer_us

    @property
    def ok(self) -> bool:
        """Whether one plan per step and the added time per layer is within budget."""
        return self.plans_per_step == 1 and self.added_us <= added_time_budget_us(self.direct_layer_us)

    def as_dict(self) -> dict[str, Any]:
        """Return the figures as plain data."""
        return {**asdict(self), "added_us": self.added_us, "ok": self.ok}


@dataclass(frozen=True)
class MemoryRow:
    """What one shape needs and what each sizing reserves for it."""

    shape: MLAShape
    minimum_bytes: int
    rule_bytes: int
    run_at_rule: str | None

    @property
    def constant_bytes(self) -> int:
        """vLLM's fixed size for this call (128 MiB, or 256 MiB with the LSE)."""
        return VLLM_FIXED_MLA_WORKSPACE_BYTES[self.shape.rule]

    def as_dict(self) -> dict[str, Any]:
        """Return the row as plain data."""
        return {
            "shape": self.shape.label,
            **self.shape.as_dict(),
            "minimum_bytes": self.minimum_bytes,
            "rule_bytes": self.rule_bytes,
            "constant_bytes": self.constant_bytes,
            "rule_over_minimum": self.rule_bytes / self.minimum_bytes,
            "run_at_rule": self.run_at_rule or "ok",
        }


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Collect once, then keep the garbage collector off for the block (as ``timeit`` does)."""
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _paired_times_ns(
    a: Callable[[], object], b: Callable[[], object], runs: int, warmup: int
) -> tuple[float, float, float]:
    """Median wall times of ``a()`` and ``b()``, synchronised, and of ``a - b`` over pairs of alternating order.

    The host drifts by more than the differences measured, hence the pairs; the
    garbage collector is paused while timing, as ``timeit`` does.
    """
    for _ in range(warmup):
        a()
        b()
    torch.cuda.synchronize()
    clock = time.perf_counter_ns
    times_a: list[int] = []
    times_b: list[int] = []
    with _gc_paused():
        for i in range(runs):
            for fn, out in ((a, times_a), (b, times_b)) if i % 2 == 0 else ((b, times_b), (a, times_a)):
                start = clock()
                fn()
                torch.cuda.synchronize()
                out.append(clock() - start)
    paired = statistics.median(x - y for x, y in zip(times_a, times_b, strict=True))
    return statistics.median(times_a), statistics.median(times_b), paired


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result  # type: ignore[no-any-return]


def _close(a: Any, b: Any, what: str) -> None:
    """Check two outputs agree (the op returns ``[batch, q_len, heads, dim]``, FlashInfer ``[tokens, heads, dim]``)."""
    x, y = _first(a).reshape(-1).float(), _first(b).reshape(-1).float()
    if x.numel() != y.numel():
        raise RuntimeError(f"{what}: outputs have {x.numel()} and {y.numel()} elements")
    diff = float((x - y).abs().max())
    if diff > 1e-2:
        raise RuntimeError(f"{what}: wspool and the direct call disagree by {diff:.3g}")


# -- the measurements ------------------------------------------------------------------


def _decode_calls(
    registry: PoolRegistry, inputs: DecodeInputs, direct: DirectMLA, return_lse: bool, query_form: str
) -> tuple[Callable[[], object], Callable[[], object]]:
    """One step's call through ``mla_decode`` and the same work done directly."""
    flat, kv, tables, lens = inputs.flat_queries[0], inputs.kv[0], inputs.block_tables, inputs.seq_lens
    query = flat if query_form == "packed" else inputs.queries[0]
    run_directly = direct.run if query_form == "packed" else direct.run_4d

    def through_wspool() -> object:
        lens.add_(0)  # the step's in-place metadata update: the op sees new metadata and plans
        return mla_decode(
            query, kv, tables, lens, inputs.max_seq_len, sm_scale=SM_SCALE, return_lse=return_lse, registry=registry
        )

    def directly() -> object:
        lens.add_(0)
        direct.plan(tables, lens)
        return run_directly(query, kv)

    return through_wspool, directly


def measure_mla_decode(
    registry: PoolRegistry,
    device: torch.device,
    *,
    batches: Sequence[int] = (1, 128),
    num_heads: int = 128,
    max_seq_len: int = 4096,
    runs: int = 1000,
    warmup: int = 20,
    query_forms: Sequence[str] = ("4-D", "packed"),
) -> list[DecodeCallFigures]:
    """Time one decode step's ``mla_decode`` (plan + run) through wspool and directly, per query form and LSE mode.

    Each row carries the A/A noise of two identical direct wrappers.
    """
    rows = []
    path = select_path(device)  # the backend wspool's op asks FlashInfer for, so both run the same kernel
    for batch in batches:
        inputs = DecodeInputs(batch, num_heads, max_seq_len, device, layers=1)
        for return_lse in (False, True):
            shape = MLAShape(batch, num_heads, max_seq_len, return_lse=return_lse)
            nbytes = registry.resolve("flashinfer_mla", shape.rule, **shape.facts(backends.sm_count(device)))
            direct, twin = (
                DirectMLA(torch.zeros(nbytes, dtype=torch.uint8, device=device), path, num_heads, return_lse)
                for _ in range(2)
            )
            _, packed_directly = _decode_calls(registry, inputs, direct, return_lse, "packed")
            _, twin_directly = _decode_calls(registry, inputs, twin, return_lse, "packed")
            noise = _paired_times_ns(twin_directly, packed_directly, runs, warmup)[2] / 1e3
            for form in query_forms:
                through_wspool, directly = _decode_calls(registry, inputs, direct, return_lse, form)
                _close(through_wspool(), directly(), "mla_decode")
                reshape = None
                if form != "packed":
                    reshape = _paired_times_ns(directly, packed_directly, runs, warmup)[2] / 1e3
                a, b, added = _paired_times_ns(through_wspool, directly, runs, warmup)
                figures = (a / 1e3, b / 1e3, form, added / 1e3, noise, reshape)
                rows.append(DecodeCallFigures(batch, num_heads, max_seq_len, return_lse, *figures))
            del direct, twin
    return rows


def _layer_calls(
    plan: MLADecodePlan, direct: DirectMLA, inputs: DecodeInputs, layers: int
) -> tuple[Callable[[], object], Callable[[], object]]:
    """A step's ``layers`` calls through the plan and on the direct wrapper, both on the packed query."""
    n = inputs.distinct

    def through_wspool() -> object:
        for layer in range(layers):
            plan.run(inputs.flat_queries[layer % n], inputs.kv[layer % n])
        return None

    def directly() -> object:
        for layer in range(layers):
            direct.run(inputs.flat_queries[layer % n], inputs.kv[layer % n])
        return None

    return through_wspool, directly


def measure_decode_step(
    registry: PoolRegistry,
    device: torch.device,
    *,
    batches: Sequence[int] = (1, 32, 128),
    num_heads: int = 128,
    max_seq_len: int = 4096,
    layers: int = 61,
    runs: int = 50,
    warmup: int = 5,
) -> list[DecodeStepFigures]:
    """Time a decode step of ``layers`` calls (with LSE) per layer, through a plan and directly, and replayed."""
    measured = []
    for batch in batches:
        inputs = DecodeInputs(batch, num_heads, max_seq_len, device, layers=layers)
        tables, lens = inputs.block_tables, inputs.seq_lens
        plan = mla_decode_plan(
            tables,
            lens,
            max_seq_len,
            num_heads=num_heads,
            sm_scale=SM_SCALE,
            page_size=PAGE_SIZE,
            return_lse=True,
            registry=registry,
        )
        nbytes = registry.resolve("flashinfer_mla", "lse", **plan.facts)
        direct, twin = (
            DirectMLA(torch.zeros(nbytes, dtype=torch.uint8, device=device), plan.path, num_heads, True)
            for _ in range(2)
        )
        direct.plan(tables, lens)
        twin.plan(tables, lens)
        flat, kv = inputs.flat_queries[0], inputs.kv[0]
        _close(plan.run(flat, kv), direct.run(flat, kv), "decode step")
        through_wspool, directly = _layer_calls(plan, direct, inputs, layers)
        _, twin_directly = _layer_calls(plan, twin, inputs, layers)
        plans = []
        for _ in range(3):  # whole steps: new metadata, the step's plan, then its layers
            before = plan.plan_calls
            lens.add_(0)
            plan.replan()
            through_wspool()
            plans.append(plan.plan_calls - before)
        noise = _paired_times_ns(twin_directly, directly, runs, warmup)[2] / 1e3 / layers
        a, b, added = _paired_times_ns(through_wspool, directly, runs, warmup)
        measured.append(
            (batch, statistics.mean(plans), a / 1e3 / layers, b / 1e3 / layers, added / 1e3 / layers, noise)
        )
        del inputs, plan, direct, twin, through_wspool, directly, twin_directly, flat, kv
    # Graph capture last, once the eager figures are in: a failed capture may leave the device unusable.
    rows = []
    failed = False
    for batch, plans_per_step, wspool_us, direct_us, added_us, noise_us in measured:
        graph_us: float | None = None
        note = "skipped: graph mode failed for an earlier batch"
        if not failed:
            inputs = DecodeInputs(batch, num_heads, max_seq_len, device, layers=layers)
            graph_us, note = _graph_step_us(inputs, registry, num_heads, layers, runs)
            failed = graph_us is None
            del inputs
        figures = (plans_per_step, wspool_us, direct_us, graph_us, note, added_us, noise_us)
        rows.append(DecodeStepFigures(batch, num_heads, max_seq_len, layers, *figures))
    return rows


def _graph_step_us(
    inputs: DecodeInputs, registry: PoolRegistry, heads: int, layers: int, runs: int
) -> tuple[float | None, str]:
    """Capture a step's layer calls of a ``use_cuda_graph=True`` plan and time its replay."""
    try:
        plan = mla_decode_plan(
            inputs.block_tables,
            inputs.seq_lens,
            inputs.max_seq_len,
            num_heads=heads,
            sm_scale=SM_SCALE,
            page_size=PAGE_SIZE,
            return_lse=True,
            registry=registry,
            use_cuda_graph=True,
        )
        n = inputs.distinct
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager = [plan.run(inputs.flat_queries[i % n], inputs.kv[i % n]) for i in range(layers)]
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = [plan.run(inputs.flat_queries[i % n], inputs.kv[i % n]) for i in range(layers)]
        graph.replay()
        torch.cuda.synchronize()
        _close(captured[-1], eager[-1], "graph replay")
        samples = []
        for i in range(runs + 3):
            start = time.perf_counter_ns()
            graph.replay()
            torch.cuda.synchronize()
            if i >= 3:
                samples.append(time.perf_counter_ns() - start)
        return statistics.median(samples) / 1e3, "replayed"
    except Exception as exc:  # graph mode is optional: report why it did not run
        return None, f"skipped: graph mode failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


def measure_memory(registry: PoolRegistry, shapes: Sequence[MLAShape], probe: MLAWorkspaceProbe) -> list[MemoryRow]:
    """Per shape: the true minimum (searched), the rule's size (run and checked), vLLM's fixed size."""
    rows = []
    for shape in shapes:
        minimum = probe.search(shape).min_bytes
        rule = registry.resolve("flashinfer_mla", shape.rule, **shape.facts(probe.sm_count))
        rows.append(MemoryRow(shape, minimum, rule, probe.verify(shape, rule)))
    return rows


@dataclass(frozen=True)
class PlanSupplyFigures:
    """One eager MLA ``plan()`` per step as SGLang's decode updater makes it: FlashInfer's own buffers against wspool's.

    ``own_us`` plans with FlashInfer unhooked, allocating its int workspace and
    pinned copy per plan; ``wspool_us`` plans through SGLang's wrapped
    ``call_begin_forward`` shape on a wrapper bound to a region. Medians over
    rounds that alternate the two (the hook is installed and removed between them).
    """

    batch_size: int
    num_heads: int
    max_seq_len: int
    own_us: float
    wspool_us: float
    noise_us: float
    """The spread of FlashInfer's own side: the largest minus the smallest round median."""

    @property
    def added_us(self) -> float:
        """What wspool's supply adds per plan (negative: it saves)."""
        return self.wspool_us - self.own_us

    def as_dict(self) -> dict[str, Any]:
        """Return the figures as plain data."""
        return {**asdict(self), "added_us": self.added_us}


def measure_mla_plan(
    gpu: torch.device, *, rounds: int = 15, plans: int = 200, batch_size: int = 64, num_heads: int = 128,
    max_seq_len: int = 1024,
) -> PlanSupplyFigures:  # fmt: skip
    """Time SGLang's per-step eager MLA plan with and without wspool's int workspace supply (see the class)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    from wspool.integrations.sglang.wrappers import supplying_mla_decode

    why = wrapper_buffers.install_mla_hook()
    if why is not None:
        raise RuntimeError(why)
    float_workspace = torch.zeros(VLLM_FIXED_MLA_WORKSPACE_BYTES["default"], dtype=torch.uint8, device=gpu)
    lengths = torch.full((batch_size,), max_seq_len, dtype=torch.int32, device=gpu)
    q_indptr = torch.arange(batch_size + 1, dtype=torch.int32, device=gpu)
    kv_indptr = q_indptr * max_seq_len
    kv_indices = torch.arange(batch_size * max_seq_len, dtype=torch.int32, device=gpu)
    kv_lora_rank, rope = backends.KV_LORA_RANK, backends.QK_ROPE_HEAD_DIM

    def call_begin_forward(
        _updater: object, wrapper: Any, lens: Any, _lens_sum: int, qo: Any, kv: Any, _replay: bool = False,
        _spec_info: Any = None, *, plan: Any, req_pool_indices: Any, **_fast_decode_kwargs: Any,
    ) -> None:  # fmt: skip
        # SGLang's eager decode plan: page size 1, twelve positional arguments.
        del plan, req_pool_indices  # SGLang's keywords, which the plan does not read here
        wrapper.plan(qo, kv, kv_indices, lens, num_heads, kv_lora_rank, rope, 1, False, SM_SCALE,
                     torch.bfloat16, torch.bfloat16)  # fmt: skip

    wrapped = supplying_mla_decode(call_begin_forward)
    registry = PoolRegistry()
    own = BatchMLAPagedAttentionWrapper(float_workspace, backend="auto")
    mine = BatchMLAPagedAttentionWrapper(float_workspace, backend="auto")
    if wrapper_buffers.bind_mla_wrapper(mine, registry=registry, device=gpu, lane="main") is None:
        raise RuntimeError("the registry keeps FlashInfer's buffers: nothing to compare")
    args = (lengths, batch_size * max_seq_len, q_indptr, kv_indptr)

    def timed(fn: Callable[..., object], wrapper: Any) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(plans):
            fn(None, wrapper, *args, plan=None, req_pool_indices=None)
        torch.cuda.synchronize()
        return (time.perf_counter_ns() - start) / plans / 1000

    own_rounds: list[float] = []
    mine_rounds: list[float] = []
    sides = (
        (wrapper_buffers.uninstall_mla_hook, call_begin_forward, own, own_rounds),
        (wrapper_buffers.install_mla_hook, wrapped, mine, mine_rounds),
    )
    try:
        with _gc_paused():
            for i in range(rounds + 1):  # the first round warms both up
                for hook, fn, wrapper, out in sides if i % 2 == 0 else sides[::-1]:
                    hook()
                    took = timed(fn, wrapper)
                    if i:
                        out.append(took)
    finally:
        wrapper_buffers.install_mla_hook()
    return PlanSupplyFigures(
        batch_size=batch_size, num_heads=num_heads, max_seq_len=max_seq_len,
        own_us=statistics.median(own_rounds), wspool_us=statistics.median(mine_rounds),
        noise_us=max(own_rounds) - min(own_rounds),
    )  # fmt: skip
