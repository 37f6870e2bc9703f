"""MLA decode (DeepSeek / Kimi geometry) planned once per step, run once per layer, on a pool's buffer.

A plan lives on its tensors' device and is used by one thread at a time. With
``use_cuda_graph=True`` its buffers never move, :meth:`MLADecodePlan.replan`
updates them in place, and it never replans during capture. Paths and sizes:
docs/kernels.md; FlashInfer's int workspace: docs/wrapper-buffers.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from wspool.errors import WorkspaceConflictError, describe_setting
from wspool.flashinfer import backends, kernels, wrapper_buffers
from wspool.flashinfer.backends import BLACKWELL_BACKENDS, DCPArgs, check_dcp, check_kernel_keywords, path_need_bytes
from wspool.flashinfer.layouts import StepConstants, check_page_table, step_constants, wrapper_metadata
from wspool.flashinfer.reference import mla_decode_reference_into
from wspool.flashinfer.refusals import MAX_RECOVERIES, grow_after_overflow
from wspool.flashinfer.wrapper_buffers import FLASHINFER_INT_DEFAULT_BYTES, PlanOwner
from wspool.memory import track_kernel_buffers
from wspool.pool import WorkspacePool
from wspool.registry import PoolRegistry, get_registry

__all__ = [
    "COUNTER_POOL",
    "COUNTER_RULE",
    "MLA_POOL",
    "MLADecodePlan",
    "MLAGeometry",
    "MLAStep",
    "counter_pool",
    "mla_decode_plan",
    "write_counts",
]

logger = logging.getLogger(__name__)

MLA_POOL = "flashinfer_mla"
#: The carves MLA planning makes in the float workspace; the others are in the int workspace.
MLA_FLOAT_CARVES = frozenset({"mla_partial_o", "mla_partial_lse"})
COUNTER_POOL = "flashinfer_mla_counters"
#: trtllm-gen's multi-CTA semaphores: FlashInfer's own formula, as a rule.
COUNTER_RULE = "round_up(max(batch_size * num_heads, sm_count), 8) * 4"


class _RulesBelowNeed(set[tuple[str, str, str]]):
    """(pool, rule, path) of a registry whose rule resolved below FlashInfer's need: warned once each."""


@dataclass(frozen=True)
class MLAGeometry:
    """The MLA shape a plan's kernel is built for; ``kv_lora_rank`` is also the output's features per head."""

    num_heads: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_lora_rank: int = backends.KV_LORA_RANK
    qk_rope_head_dim: int = backends.QK_ROPE_HEAD_DIM
    qk_nope_head_dim: int = 128

    @property
    def head_dim(self) -> int:
        """Features per query and KV-cache row: the latent and the rope widths."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, eq=False)
class MLAStep:
    """One engine step as a plan serves it: the checked metadata (the caller's tensors, held by reference)."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    q_len: int
    sm_scale: float
    return_lse: bool
    batch_size: int
    device: torch.device


def mla_decode_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    num_heads: int,
    sm_scale: float,
    page_size: int,
    q_len: int = 1,
    q_dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    return_lse: bool = False,
    registry: PoolRegistry | None = None,
    pool: str = MLA_POOL,
    backend: str = "auto",
    lane: str | None = None,
    use_cuda_graph: bool = False,
    kv_lora_rank: int = backends.KV_LORA_RANK,
    qk_rope_head_dim: int = backends.QK_ROPE_HEAD_DIM,
    qk_nope_head_dim: int = 128,
    facts: Mapping[str, int] | None = None,
    enable_dcp: bool = False,
    cp_world: int = 1,
    cp_rank: int = 0,
    causal_seqlens_kv_global: torch.Tensor | None = None,
    int_group: str | None = None,
) -> MLADecodePlan:
    """Plan MLA decode for one step; then call ``plan.run(query, kv_cache)`` once per layer.

    Args:
        block_tables: ``[batch, max_pages]`` int32 page ids, on the decode device.
        seq_lens: ``[batch]`` int32 cached lengths, the new query tokens included.
        return_lse: Also return the natural-log LSE; sizes the workspace with rule ``lse``.
        backend: ``"auto"``, ``"reference"``, ``"trtllm-gen"``, ``"cute-dsl"``, ``"fa3"`` or ``"fa2"``.
        use_cuda_graph: Build the wrapper with fixed index buffers so ``run`` can be captured.
        facts: Extra facts for the rules; missing ones come from the pool's default facts, then the device.
        enable_dcp: Decode-context parallel (cute-dsl); needs ``return_lse`` and ``causal_seqlens_kv_global``
            (``[batch]`` int32 global KV lengths); ``cp_world`` is then also a rule fact (docs/multi-gpu.md).
        int_group: Graph plans of one name on one pool, device and lane share one int workspace
            region; only for plans never live at once, each replanned before :meth:`MLADecodePlan.replay`.

    Raises:
        ValueError: A bad argument, named, before any pool grows or kernel runs.
    """
    device, batch_size = check_page_table(
        block_tables, seq_lens, num_heads=num_heads, page_size=page_size, q_len=q_len, max_seq_len=max_seq_len
    )
    dcp = check_dcp(
        enable_dcp,
        cp_world,
        cp_rank,
        causal_seqlens_kv_global,
        backend=backend,
        return_lse=return_lse,
        batch_size=batch_size,
        device=device,
    )
    path = backends.select_path(device, backend, num_heads=num_heads, page_size=page_size, enable_dcp=enable_dcp)
    geometry = MLAGeometry(
        num_heads, page_size, q_dtype, kv_dtype or q_dtype, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim
    )
    step = MLAStep(block_tables, seq_lens, max_seq_len, q_len, float(sm_scale), return_lse, batch_size, device)
    if int_group is not None and not use_cuda_graph:
        raise ValueError("int_group is for CUDA-graph plans (use_cuda_graph=True); eager plans share their wrapper")
    return MLADecodePlan(
        step, geometry, dcp, path=path, use_cuda_graph=use_cuda_graph, facts=facts,
        registry=registry if registry is not None else get_registry(), pool=pool, lane=lane, int_group=int_group,
    )  # fmt: skip


class MLADecodePlan:
    """MLA decode planned for one step's page table and lengths; :meth:`run` is the per-layer call.

    A pool that grew, or a shared wrapper another plan took, makes it replan;
    metadata edited in place needs :meth:`replan` (docs/kernels.md). ``path`` is
    the concrete kernel path; the pool holds at least its ``need_bytes`` and the rule.
    """

    def __init__(
        self,
        step: MLAStep,
        geometry: MLAGeometry,
        dcp: DCPArgs,
        *,
        path: str,
        use_cuda_graph: bool,
        facts: Mapping[str, int] | None,
        registry: PoolRegistry,
        pool: str,
        lane: str | None,
        int_group: str | None = None,
    ) -> None:
        """Size the workspace and prepare the kernel for arguments :func:`mla_decode_plan` checked."""
        self.step, self.geometry, self.dcp, self.path = step, geometry, dcp, path
        self.use_cuda_graph = use_cuda_graph
        self.int_group = int_group
        self.rule = "lse" if step.return_lse else "default"
        self.plan_calls = 0
        self._versions = write_counts(step.block_tables, step.seq_lens)
        #: The shapes of ``block_tables`` and ``seq_lens`` this plan was made for.
        self.planned_shapes = (step.block_tables.shape, step.seq_lens.shape)
        self._wrapper: Any = None
        self._ownership = PlanOwner()  # the record of the int workspace this plan planned last
        self._token = object()  # this plan, as a shared wrapper's owner
        self._planned_workspace: torch.Tensor | None = None
        self._generation = -1
        self._graph_buffers: tuple[torch.Tensor, ...] | None = None
        self._csr_constants: StepConstants | None = None
        self._csr_factory: Any = None  # FlashInfer's MLAPlanMetadata.csr, on the wrapper path
        self._plan_kwargs: dict[str, Any] | None = None  # built once; only the metadata changes per plan
        self._set_call_shapes()
        self._attach_pool(registry, pool, lane, facts)
        self._size_workspace(pool)
        self._prepare_path(lane)

    def _set_call_shapes(self) -> None:
        """Fix the query and result shapes the per-layer call compares and views to."""
        step, geometry = self.step, self.geometry
        batch, q_len, heads, dim = step.batch_size, step.q_len, geometry.num_heads, geometry.head_dim
        self._query_shape = (batch, q_len, heads, dim)
        self._packed_shape = (batch * q_len, heads, dim)
        # Packed queries on the wrapper path take run()'s fast path; None matches no query.
        self._fast_shape = self._packed_shape if self.path in ("fa3", "fa2") else None
        self._out_shape = (batch, q_len, heads, geometry.kv_lora_rank)  # 4-D results, for view(*shape)
        self._lse_shape = (batch, q_len, heads)
        options = (geometry.q_dtype, geometry.kv_dtype, step.max_seq_len, step.sm_scale)
        self.call_signature = (torch.Size(self._query_shape), *options)
        self.packed_signature = (torch.Size(self._packed_shape), *options)

    def _attach_pool(
        self, registry: PoolRegistry, pool: str, lane: str | None, facts: Mapping[str, int] | None
    ) -> None:
        """Take the plan's pool; merge its facts: the pool's defaults, then the call's, then the caller's."""
        step, geometry = self.step, self.geometry
        self._registry = registry
        self._pool = registry.pool(pool, step.device, lane=lane)
        call = backends.call_facts(
            batch_size=step.batch_size,
            q_len=step.q_len,
            num_heads=geometry.num_heads,
            max_seq_len=step.max_seq_len,
            page_size=geometry.page_size,
            kv_lora_rank=geometry.kv_lora_rank,
            qk_rope_head_dim=geometry.qk_rope_head_dim,
            dtype_bytes=geometry.q_dtype.itemsize,
            sm_count=backends.sm_count(step.device),
            cp_world=self.dcp.cp_world if self.dcp.enable_dcp else None,
        )
        # Merged once: every per-layer request passes complete facts.
        self.facts: dict[str, int] = {**self._pool.default_facts(self.rule), **call, **(facts or {})}
        self._setting = describe_setting(("pools", pool, "rules", self.rule))

    def _size_workspace(self, pool: str) -> None:
        """Size the workspace (the rule, or the path's need above it) and grow the pool now, outside any capture."""
        step, geometry = self.step, self.geometry
        self.need_bytes = path_need_bytes(
            self.path,
            sm_count=self.facts["sm_count"],
            batch_size=step.batch_size,
            q_len=step.q_len,
            num_heads=geometry.num_heads,
            kv_lora_rank=geometry.kv_lora_rank,
            max_seq_len=step.max_seq_len,
            return_lse=step.return_lse,
            enable_dcp=self.dcp.enable_dcp,
        )
        rule_bytes = self._pool.resolve(self.rule, self.facts)
        self._nbytes = max(rule_bytes, self.need_bytes)
        if self.need_bytes > rule_bytes:
            # Said once per registry, pool, rule and path.
            warned = self._registry.state(_RulesBelowNeed)
            if (pool, self.rule, self.path) not in warned:
                warned.add((pool, self.rule, self.path))
                logger.warning(
                    "wspool: rule %s of pool %s resolves to %d bytes, below the %d bytes FlashInfer's %s MLA decode "
                    "needs here; requesting %d bytes. Raise %s to at least that to silence this",
                    self.rule,
                    pool,
                    rule_bytes,
                    self.need_bytes,
                    self.path,
                    self._nbytes,
                    self._setting,
                )
        reason = f"rule {self.rule}" if self._nbytes == rule_bytes else f"the {self.path} kernel path"
        self._pool.grow_to(self._nbytes, reason, self._setting, self.facts)

    def _prepare_path(self, lane: str | None) -> None:
        """Check the Blackwell kernel's keywords and take its counters, or plan the wrapper."""
        if self.path in BLACKWELL_BACKENDS:
            check_kernel_keywords(
                kernels.load_flashinfer_mla().trtllm_batch_decode_with_kv_cache_mla, kernels.TRTLLM_DECODE_KEYWORDS
            )
        if self.path == "trtllm-gen":
            self._counters = counter_pool(self._registry, self.step.device, lane, self.facts)
        elif self.path != "reference":
            self._csr_factory = kernels.load_flashinfer_mla().MLAPlanMetadata.csr
            self._plan_wrapper()

    @property
    def flashinfer_backend(self) -> str | None:
        """The backend FlashInfer's planned wrapper reports after planning (``None`` on other paths)."""
        wrapper = self._wrapper
        return None if wrapper is None else kernels.wrapper_backend(wrapper)

    # -- the metadata it is planned for ------------------------------------------

    def is_current_for(self, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> bool:
        """Whether these are the very tensors this plan was made for, unmodified since (never for inference tensors)."""
        return (
            block_tables is self.step.block_tables
            and seq_lens is self.step.seq_lens
            and self._versions is not None
            and write_counts(block_tables, seq_lens) == self._versions
        )

    def metadata_resized(self) -> bool:
        """Whether ``block_tables`` or ``seq_lens`` were resized in place since planning."""
        return (self.step.block_tables.shape, self.step.seq_lens.shape) != self.planned_shapes

    @property
    def metadata_versions(self) -> tuple[int, int] | None:
        """The metadata's write counts this plan was made for; ``None`` for inference tensors (they count none)."""
        return self._versions

    def replan(self) -> None:
        """Plan again for the current contents of ``block_tables`` and ``seq_lens`` (``ValueError`` if resized)."""
        step = self.step
        if self.metadata_resized():
            raise ValueError(
                f"block_tables/seq_lens were resized to {tuple(step.block_tables.shape)}/"
                f"{tuple(step.seq_lens.shape)} after planning for {tuple(self.planned_shapes[0])}/"
                f"{tuple(self.planned_shapes[1])}; make a new plan"
            )
        self.replan_for(write_counts(step.block_tables, step.seq_lens))

    def replan_for(self, versions: tuple[int, int] | None) -> None:
        """:meth:`replan` for metadata whose shapes the caller checked, with its write counts read."""
        self._versions = versions
        self.plan_metadata()

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        """Replay ``graph`` (captured from :meth:`run`), replanning if another ``int_group`` plan took its region."""
        if self._ownership.owner is not self._token:
            self.plan_metadata()
        graph.replay()

    def plan_metadata(self) -> None:
        """Plan the wrapper for the current metadata; the other paths read it at run time."""
        if self._fast_shape is not None:
            self._plan_wrapper()

    # -- the per-layer call ----------------------------------------------------

    def run(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run MLA decode for one layer; return ``out``, or ``(out, lse)`` with ``return_lse``, in the query's form.

        ``query`` is ``[batch, q_len, heads, kv_lora_rank + rope]`` or the packed
        ``[batch * q_len, ...]`` form FlashInfer's wrapper takes without reshapes;
        ``kv_cache`` is ``[pages, page_size, kv_lora_rank + rope]``.

        Raises:
            ValueError: The query or KV cache does not match the plan.
            WorkspaceFrozenError: The pool would have to grow while frozen or capturing.
            WorkspaceOverflowError: FlashInfer still overflowed after recovery.
        """
        # The fast path (a packed query on the wrapper path) makes a subset of the general path's checks.
        geometry = self.geometry
        if (
            query.shape == self._fast_shape
            and query.dtype is geometry.q_dtype
            and len(kv_shape := kv_cache.shape) == 3  # one shape read: cheaper than dim() and size(1)
            and kv_shape[1] == geometry.page_size
        ):
            # The size was resolved at plan time: request it, without resolving the rule again.
            workspace = self._pool.request(self._nbytes, self.rule)
            if workspace is not self._planned_workspace or self._ownership.owner is not self._token:
                self._plan_wrapper()  # the pool grew, or another plan took the shared wrapper
            return_lse = self.step.return_lse
            # kernels.wrapper_run_kwargs's arguments, inlined (the CPU doubles bind every
            # call to FlashInfer's real signature).
            return self._wrapper.run(  # type: ignore[no-any-return]
                query=query,
                kv_cache=kv_cache,
                out=out,
                lse=lse,
                return_lse=return_lse,
                return_lse_base_on_e=return_lse,
            )
        return self._run_general(query, kv_cache, out, lse)

    def run_matched(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run a 4-D query whose shape and dtype the caller matched to :attr:`call_signature`."""
        if self._fast_shape is None or len(kv_shape := kv_cache.shape) != 3 or kv_shape[1] != self.geometry.page_size:
            return self._run_general(query, kv_cache, out, lse)
        workspace = self._pool.request(self._nbytes, self.rule)
        if workspace is not self._planned_workspace or self._ownership.owner is not self._token:
            self._plan_wrapper()
        return_lse = self.step.return_lse
        # view(*sizes) parses faster than view(tuple): each view is a measurable part of this path.
        tokens, heads, dim = self._packed_shape
        result = self._wrapper.run(
            query=query.view(tokens, heads, dim),
            kv_cache=kv_cache,
            out=None if out is None else out.view(tokens, heads, self.geometry.kv_lora_rank),
            lse=None if lse is None else lse.view(tokens, heads),
            return_lse=return_lse,
            return_lse_base_on_e=return_lse,
        )
        return self._shape_result(result, out, lse)

    def _run_general(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Validate, then run any path with either query form."""
        step, geometry = self.step, self.geometry
        packed = query.dim() == 3
        if query.shape != (self._packed_shape if packed else self._query_shape) or query.dtype != geometry.q_dtype:
            raise ValueError(
                f"query is {tuple(query.shape)} {query.dtype}, but the plan is for {self._query_shape} "
                f"(or packed {self._packed_shape}) {geometry.q_dtype}; make a new plan for a new shape"
            )
        page_size, head_dim = geometry.page_size, geometry.head_dim
        if kv_cache.dim() != 3 or kv_cache.shape[1] != page_size or kv_cache.shape[2] != head_dim:
            raise ValueError(f"kv_cache must be [pages, {page_size}, {head_dim}], got {tuple(kv_cache.shape)}")
        path = self.path
        if path == "reference" or path in BLACKWELL_BACKENDS:
            workspace = self._pool.request(self._nbytes, self.rule)
            given = (out, lse)
            if packed:  # these paths take the 4-D form
                query = query.view(self._query_shape)
                out = None if out is None else out.view(*self._query_shape[:3], -1)
                lse = None if lse is None else lse.view(self._query_shape[:3])
            if path == "reference":
                result = mla_decode_reference_into(
                    query, kv_cache, step.block_tables, step.seq_lens, out, lse, sm_scale=step.sm_scale,
                    kv_lora_rank=geometry.kv_lora_rank, return_lse=step.return_lse,
                )  # fmt: skip
            else:
                result = self._shape_result(self._run_blackwell(query, kv_cache, out, lse, workspace), out, lse)
            return self._packed_result(result, *given) if packed else result
        if not packed:
            return self.run_matched(query, kv_cache, out, lse)  # validated above; it requests the workspace
        # A packed query that passed these checks meets every condition of run()'s fast path.
        return self.run(query, kv_cache, out=out, lse=lse)

    def _run_blackwell(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor | None,
        lse: torch.Tensor | None,
        workspace: torch.Tensor,
    ) -> Any:
        """Run the Blackwell kernel on a 4-D query with the pool's buffer; return what the kernel returns."""
        kernel = kernels.load_flashinfer_mla().trtllm_batch_decode_with_kv_cache_mla
        # trtllm-gen's counters come from their own pool; cute-dsl takes none.
        counters = self._counters.workspace("default", self.facts) if self.path == "trtllm-gen" else None
        step, geometry = self.step, self.geometry
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                return kernel(
                    **kernels.trtllm_decode_kwargs(
                        query=query, kv_cache=kv_cache, workspace=workspace, backend=self.path, dcp=self.dcp,
                        counters=counters, block_tables=step.block_tables, seq_lens=step.seq_lens,
                        max_seq_len=step.max_seq_len, sm_scale=step.sm_scale, out=out,
                        lse=None if lse is None else lse.view(*self._packed_shape[:2]),  # trtllm's native LSE form
                        return_lse=step.return_lse, kv_lora_rank=geometry.kv_lora_rank,
                        qk_rope_head_dim=geometry.qk_rope_head_dim, qk_nope_head_dim=geometry.qk_nope_head_dim,
                    )
                )  # fmt: skip
            except (RuntimeError, ValueError) as exc:  # the C++ allocator's, or FlashInfer's Python checks
                workspace = grow_after_overflow(
                    exc,
                    pool=self._pool,
                    capacity=workspace.numel(),
                    attempt=attempt,
                    op="MLA decode",
                    rule=self.rule,
                    setting=self._setting,
                    path=self.path,
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _shape_result(
        self, result: Any, out: torch.Tensor | None, lse: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Return results in the 4-D form, as the caller's own buffers where it gave them."""
        # view(*sizes), as in run_matched: these views are on the per-call path.
        if self.step.return_lse:
            got_out, got_lse = result
            return (
                out if out is not None else got_out.view(*self._out_shape),
                lse if lse is not None else got_lse.view(*self._lse_shape),
            )
        return out if out is not None else result.view(*self._out_shape)

    def _packed_result(
        self, result: Any, out: torch.Tensor | None, lse: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Return results in the packed form, as the caller's own buffers where it gave them."""
        tokens, heads = self._packed_shape[:2]
        if self.step.return_lse:
            got_out, got_lse = result
            return (
                out if out is not None else got_out.view(tokens, heads, -1),
                lse if lse is not None else got_lse.view(tokens, heads),
            )
        return out if out is not None else result.view(tokens, heads, -1)

    # -- planning (wrapper path) ----------------------------------------------

    def wrapper_plan_kwargs(self) -> dict[str, Any]:
        """The arguments of FlashInfer's wrapper ``plan()`` for this plan, without the metadata."""
        geometry, step = self.geometry, self.step
        return kernels.wrapper_plan_kwargs(
            metadata=None, num_heads=geometry.num_heads, kv_lora_rank=geometry.kv_lora_rank,
            qk_rope_head_dim=geometry.qk_rope_head_dim, page_size=geometry.page_size, causal=step.q_len > 1,
            sm_scale=step.sm_scale, q_dtype=geometry.q_dtype, kv_dtype=geometry.kv_dtype, return_lse=step.return_lse,
        )  # fmt: skip

    def _plan_wrapper(self) -> None:
        """Plan FlashInfer's wrapper for the current metadata, on the pool's current buffer."""
        plan_kwargs = self._plan_kwargs
        if plan_kwargs is None:
            plan_kwargs = self._plan_kwargs = self.wrapper_plan_kwargs()
        if self.step.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise self._conflict()
        plan_kwargs["metadata"] = self._csr_factory(*self._csr_metadata())
        for attempt in range(MAX_RECOVERIES + 1):
            workspace = self._pool.buffer
            wrapper, record, generation = self._wrapper, self._ownership, self._generation
            # The steady state of one plan per step skips this: the plan still owns its wrapper,
            # on the buffer it was built on (which held this plan's size then, and still does).
            if wrapper is None or workspace is not self._planned_workspace or record.owner is not self._token:
                if workspace is None or self._pool.capacity_bytes < self._nbytes:
                    workspace = self._pool.grow_to(self._nbytes, f"rule {self.rule}", self._setting, self.facts)
                generation = self._pool.generation
                wrapper = self._acquire_wrapper(workspace, generation)
                record = kernels.ownership(wrapper)
            # Nobody owns a wrapper mid-plan: if plan() fails, no plan may run on it unplanned.
            record.owner = None
            try:
                self.plan_calls += 1
                with wrapper_buffers.supplying(wrapper):  # FlashInfer's MLA backends take the wrapper's region
                    wrapper.plan(**plan_kwargs)
            except (RuntimeError, ValueError) as exc:  # the C++ allocator's, or FlashInfer's Python checks
                grow_after_overflow(
                    exc, pool=self._pool, capacity=workspace.numel(), attempt=attempt,  # type: ignore[union-attr]
                    op="MLA decode", rule=self.rule, setting=self._setting, path=self.path,
                    float_carves=MLA_FLOAT_CARVES, int_setting=wrapper_buffers.int_setting_of(wrapper),
                )  # fmt: skip
                continue
            record.owner = self._token
            self._wrapper, self._ownership = wrapper, record
            self._planned_workspace, self._generation = workspace, generation
            return

    def _csr_metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convert the page table to FlashInfer's CSR form, on the device (one host sync)."""
        step = self.step
        constants = self._csr_constants
        if constants is None:
            constants = self._csr_constants = step_constants(
                step.block_tables, step.batch_size, step.q_len, step.device
            )
        capacity = None if self._graph_buffers is None else self._graph_buffers[2].numel()
        return wrapper_metadata(step.block_tables, step.seq_lens, self.geometry.page_size, constants, capacity)

    def _acquire_wrapper(self, workspace: torch.Tensor, generation: int) -> Any:
        """Return the wrapper to plan: the plan's own in graph mode (remade when the pool grew), else the shared one."""
        if self.use_cuda_graph:
            if self._wrapper is not None and self._generation == generation:
                return self._wrapper
            step = self.step
            self._graph_buffers = kernels.graph_buffers(step.batch_size, step.block_tables.numel(), step.device)
            wrapper = kernels.make_wrapper(workspace, self.path, self._graph_buffers)  # type: ignore[arg-type]
        else:
            wrapper = kernels.shared_wrapper(self._pool, workspace, self.path, self.step.return_lse)
        group = None if self.int_group is None else (self._pool.spec.name, self.int_group)
        wrapper_buffers.bind_mla_wrapper(
            wrapper,
            registry=self._registry,
            device=self.step.device,
            lane=self._pool.lane,
            group=group,
            facts={"sm_count": self.facts["sm_count"]},
        )
        track_kernel_buffers(
            self._registry,
            self._pool,
            wrapper,
            self._graph_buffers or (),
            default_int_bytes=FLASHINFER_INT_DEFAULT_BYTES,
        )
        return wrapper

    def _conflict(self) -> WorkspaceConflictError:
        """The error for a plan that would have to replan during capture."""
        step = self.step
        shared = (
            f"its int workspace (int_group {self.int_group!r}) holds another plan's metadata"
            if self.int_group is not None and self._ownership.owner is not self._token
            else "its wrapper or buffer changed since it planned"
        )
        return WorkspaceConflictError(
            f"MLA decode plan (batch {step.batch_size}, lane {self._pool.lane}) would replan during CUDA-graph "
            f"capture: {shared}. Replan it right before capture"
            + (", or give it an int workspace of its own (int_group=None)" if self.int_group is not None else "")
        )


def counter_pool(
    registry: PoolRegistry, device: torch.device, lane: str | None, facts: dict[str, int]
) -> WorkspacePool:
    """trtllm-gen's counter pool (declared on first use), grown for ``facts``."""
    registry.declare_pool(COUNTER_POOL, {"default": COUNTER_RULE})
    counters = registry.pool(COUNTER_POOL, device, lane=lane)
    counters.ensure("default", facts)
    return counters


def write_counts(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int] | None:
    """torch's in-place write counters of the metadata; ``None`` for inference tensors, which keep none."""
    if block_tables.is_inference() or seq_lens.is_inference():
        return None
    return block_tables._version, seq_lens._version
