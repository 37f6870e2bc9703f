"""MLA decode (DeepSeek / Kimi style) with its workspace from a wspool pool.

An engine calls MLA decode once per layer with the same page table and lengths
for every layer of a step. :func:`mla_decode_plan` makes one
:class:`MLADecodePlan` per step (FlashInfer's ``plan()`` costs about a
millisecond of host time); :meth:`MLADecodePlan.run` is the per-layer call.
:func:`mla_decode` is the one-call form: it reuses the previous call's plan
while the page table and lengths are the same, unmodified tensors.

Kernel paths: wspool resolves ``backend="auto"`` to a concrete path first,
reports it as ``plan.path``, passes that explicit backend to FlashInfer, and
sizes the workspace for it (:mod:`~wspool.flashinfer.path_sizing`): the size
of the buffer never decides which kernel runs.

- Blackwell (SM100/SM103/SM107): ``trtllm_batch_decode_with_kv_cache_mla``
  with ``workspace_buffer`` from the pool, ``backend="trtllm-gen"`` (its
  counter buffer from the ``flashinfer_mla_counters`` pool) or ``"cute-dsl"``
  (an ``int8`` view of the buffer; the only kernel with decode-context
  parallelism), chosen by :func:`~wspool.flashinfer.blackwell.blackwell_backend`.
- Hopper (SM90): ``BatchMLAPagedAttentionWrapper`` with ``backend="fa3"``;
  other CUDA devices (Ampere SM80 and the rest): ``backend="fa2"``. The
  wrapper is built on the pool's buffer and planned from the page table
  converted to CSR on the device.
- CPU, or ``backend="reference"``: :func:`~wspool.flashinfer.reference.mla_decode_reference`.
  It is never chosen on a GPU unless asked for. It requests the workspace like
  the kernels do, so sizes and statistics behave the same everywhere.

The LSE is the natural-log log-sum-exp on every path.

Device semantics: everything runs on the device of ``block_tables``, which
must be the device of the query and the KV cache. Thread and stream
semantics: a plan and its lane's buffer serve one stream at a time; use
``lane=`` for concurrent streams. Capture semantics: ``run()`` of a plan made
with ``use_cuda_graph=True`` can be captured; the pool must not need to grow
during capture (reserve or warm up first, then freeze).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wspool.errors import describe_setting
from wspool.flashinfer import kernels, mla_paths, mla_wrappers
from wspool.flashinfer.blackwell import BLACKWELL_BACKENDS, check_kernel_keywords
from wspool.flashinfer.mla_metadata import StepConstants, graph_buffers, step_constants, wrapper_metadata
from wspool.flashinfer.mla_setup import COUNTER_POOL, COUNTER_RULE, MLAPlanArgs, counter_pool, size_workspace
from wspool.flashinfer.mla_setup import write_counts as write_counts
from wspool.flashinfer.mla_trtllm import run_trtllm
from wspool.flashinfer.path_sizing import path_need_bytes
from wspool.flashinfer.recovery import MAX_RECOVERIES, grow_after_overflow
from wspool.flashinfer.reference import mla_decode_reference_into
from wspool.kernel_buffers import track_kernel_buffers
from wspool.registry import PoolRegistry, get_registry

__all__ = [
    "COUNTER_POOL",
    "COUNTER_RULE",
    "MLA_POOL",
    "MLADecodePlan",
    "mla_decode_plan",
    "write_counts",
]

MLA_POOL = "flashinfer_mla"


class MLADecodePlan(MLAPlanArgs):
    """MLA decode planned for one page table and set of lengths: one step of an engine.

    Build with :func:`mla_decode_plan` (this class), then call ``plan.run(query,
    kv_cache)`` once per layer. :meth:`run` is the per-layer call; it
    never runs against metadata it was not planned for: a pool that grew, or a
    shared FlashInfer wrapper that another plan took over, makes it replan.
    Mutating ``block_tables`` or ``seq_lens`` after planning is the caller's
    contract to avoid (or to follow with :meth:`replan`); :func:`mla_decode`
    detects it through the tensors' version counters.

    Attributes:
        path: The concrete kernel path (``"reference"``, ``"trtllm-gen"``, ``"cute-dsl"``,
            ``"fa3"`` or ``"fa2"``), resolved before the workspace is sized; FlashInfer is
            called with it explicitly.
        need_bytes: What that path is known to need for this plan (see
            :mod:`~wspool.flashinfer.path_sizing`); the pool holds at least this and the rule.
        rule: The pool rule that sizes the workspace (``"lse"`` or ``"default"``).
        facts: The facts the rule is resolved with.
        plan_calls: How many times this plan called FlashInfer's ``plan()``.

    Args:
        block_tables: ``[batch, max_pages]`` int32 page ids, on the decode device.
        seq_lens: ``[batch]`` int32 cached lengths (the new query tokens included).
        max_seq_len: An upper bound of ``seq_lens``.
        num_heads: Query heads.
        sm_scale: Softmax scale.
        page_size: Tokens per KV-cache page.
        q_len: Query tokens per request (1 for plain decode).
        q_dtype: Query dtype; ``kv_dtype`` defaults to it.
        return_lse: Also return the natural-log LSE; sizes the workspace with rule ``lse``.
        registry: The registry; default :func:`wspool.get_registry`.
        pool: The pool to draw from.
        backend: ``"auto"``, ``"reference"``, ``"trtllm-gen"``, ``"cute-dsl"``, ``"fa3"`` or ``"fa2"``.
        lane: The pool lane (for concurrent streams).
        use_cuda_graph: Build the wrapper with fixed index buffers so ``run`` can be captured.
        kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim: The MLA geometry (DeepSeek's by default).
        facts: Extra facts for the rules (e.g. ``{"cp_world": 4}``); facts the rules read that
            neither the plan nor these give come from the pool's default facts
            (``pools.<pool>.facts``, e.g. ``cp_world: 1``), then from the device.
        enable_dcp: Decode-context parallel (Blackwell's cute-dsl kernel, as vLLM calls it);
            needs ``return_lse=True`` and ``causal_seqlens_kv_global``.
        cp_world, cp_rank: The DCP group's size and this rank (``cp_rank < cp_world``); with
            ``enable_dcp``, ``cp_world`` is also the rules' fact of that name.
        causal_seqlens_kv_global: ``[batch]`` int32 global KV lengths, with ``enable_dcp``.

    Raises:
        ValueError: A bad argument, named, before any pool grows or kernel runs.
    """

    def __init__(
        self,
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
        kv_lora_rank: int = mla_paths.KV_LORA_RANK,
        qk_rope_head_dim: int = mla_paths.QK_ROPE_HEAD_DIM,
        qk_nope_head_dim: int = 128,
        facts: Mapping[str, int] | None = None,
        enable_dcp: bool = False,
        cp_world: int = 1,
        cp_rank: int = 0,
        causal_seqlens_kv_global: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            block_tables, seq_lens, max_seq_len, num_heads=num_heads, sm_scale=sm_scale, page_size=page_size,
            q_len=q_len, q_dtype=q_dtype, kv_dtype=kv_dtype, return_lse=return_lse, backend=backend,
            use_cuda_graph=use_cuda_graph, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
            qk_nope_head_dim=qk_nope_head_dim, facts=facts, enable_dcp=enable_dcp, cp_world=cp_world,
            cp_rank=cp_rank, causal_seqlens_kv_global=causal_seqlens_kv_global,
        )  # fmt: skip
        batch_size = self.batch_size
        self._head_dim = kv_lora_rank + qk_rope_head_dim
        self._query_shape = (batch_size, q_len, num_heads, self._head_dim)
        self._packed_shape = (batch_size * q_len, num_heads, self._head_dim)
        # Packed queries on the wrapper path take run()'s fast path; None matches no query.
        self._fast_shape = self._packed_shape if self.path in ("fa3", "fa2") else None
        self._planned_workspace: torch.Tensor | None = None
        self._plan_kwargs: dict[str, Any] | None = None  # built once; only the metadata changes per plan
        self._attach_pool(registry if registry is not None else get_registry(), pool, lane)
        #: ``(query shape, query dtype, KV dtype, max_seq_len, sm_scale)`` of the 4-D calls
        #: this plan serves; ``mla_decode`` compares it in one step.
        self.call_signature = (torch.Size(self._query_shape), q_dtype, self.kv_dtype, max_seq_len, self.sm_scale)
        #: The same for packed ``[batch * q_len, heads, dim]`` queries.
        self.packed_signature = (torch.Size(self._packed_shape), q_dtype, self.kv_dtype, max_seq_len, self.sm_scale)
        self._out_shape = (batch_size, q_len, num_heads, kv_lora_rank)  # 4-D results, for view(*shape)
        self._lse_shape = (batch_size, q_len, num_heads)
        self._wrapper: Any = None
        self._generation = -1
        self._token = object()  # identifies this plan as a shared wrapper's current owner
        self._graph_buffers: tuple[torch.Tensor, ...] | None = None
        self._csr_constants: StepConstants | None = None
        self._csr_factory: Any = None  # FlashInfer's MLAPlanMetadata.csr, on the wrapper path
        self.plan_calls = 0
        self._size_workspace(pool, enable_dcp)
        self._prepare_path(lane)

    def _attach_pool(self, registry: PoolRegistry, pool: str, lane: str | None) -> None:
        """Take the plan's pool and complete its facts with the pool's default and device facts."""
        self._registry = registry
        self._pool = registry.pool(pool, self.device, lane=lane)
        # Merged once: every per-layer request passes complete facts.
        self.facts = {**self._pool.default_facts(self.rule), **self.facts}
        self._setting = describe_setting(("pools", pool, "rules", self.rule))

    def _size_workspace(self, pool: str, enable_dcp: bool) -> None:
        """Size the workspace for the rule and the path's need, and grow the pool to it now."""
        self.need_bytes = path_need_bytes(
            self.path, sm_count=self.facts["sm_count"], batch_size=self.batch_size, q_len=self.q_len,
            num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank, max_seq_len=self.max_seq_len,
            return_lse=self.return_lse, enable_dcp=enable_dcp,
        )  # fmt: skip
        #: What this plan requests: the rule, or the path's need where the rule is below it.
        self._nbytes = size_workspace(
            self._registry, self._pool, pool_name=pool, rule=self.rule, facts=self.facts, path=self.path,
            need_bytes=self.need_bytes, setting=self._setting,
        )  # fmt: skip

    def _prepare_path(self, lane: str | None) -> None:
        """Check the Blackwell kernel's keywords and take its counters, or plan the wrapper."""
        if self.path in BLACKWELL_BACKENDS:
            check_kernel_keywords(kernels.load_flashinfer_mla().trtllm_batch_decode_with_kv_cache_mla,
                                  kernels.TRTLLM_DECODE_KEYWORDS)  # fmt: skip
        if self.path == "trtllm-gen":
            self._counters = counter_pool(self._registry, self.device, lane, self.facts)
        elif self.path != "reference":
            self._csr_factory = kernels.load_flashinfer_mla().MLAPlanMetadata.csr
            self._plan_wrapper()

    @property
    def flashinfer_backend(self) -> str | None:
        """The backend FlashInfer's planned wrapper reports after planning (``None`` on other paths)."""
        wrapper = self._wrapper
        return None if wrapper is None else getattr(wrapper, "_backend", None)

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
        """Run MLA decode for one layer.

        Args:
            query: ``[batch, q_len, heads, kv_lora_rank + rope]`` as planned, or the
                packed ``[batch * q_len, heads, kv_lora_rank + rope]`` form that
                FlashInfer's wrapper takes natively (no reshapes on the call).
            kv_cache: ``[pages, page_size, kv_lora_rank + rope]``.
            out: Optional output buffer, in the query's form with ``kv_lora_rank`` features.
            lse: Optional fp32 buffer ``[batch, q_len, heads]`` (or ``[tokens, heads]``), with LSE plans.

        Returns:
            ``out``, or ``(out, lse)`` for a plan made with ``return_lse=True``, in
            the query's form.

        Raises:
            ValueError: The query or KV cache does not match the plan.
            WorkspaceFrozenError: The pool would have to grow while frozen or capturing.
            WorkspaceOverflowError: FlashInfer still overflowed after recovery.
        """
        # The per-layer fast path: a packed query on the wrapper path, the form FlashInfer
        # takes natively. Every check here is one the general path makes too.
        # (FlashInfer itself checks the KV cache's feature width against the plan.)
        if (
            query.shape == self._fast_shape
            and query.dtype is self.q_dtype
            and len(kv_shape := kv_cache.shape) == 3  # one shape read: cheaper than dim() and size(1)
            and kv_shape[1] == self.page_size
        ):
            # The size was resolved at plan time: request it, without resolving the rule again.
            workspace = self._pool.request(self._nbytes, self.rule)
            wrapper = self._wrapper
            if workspace is not self._planned_workspace or wrapper._wspool_owner is not self._token:
                self._plan_wrapper()  # the pool grew, or another plan took the shared wrapper
                wrapper = self._wrapper
            # kernels.wrapper_run_kwargs's arguments, inlined (the CPU doubles bind every
            # call to FlashInfer's real signature).
            return wrapper.run(  # type: ignore[no-any-return]
                query=query, kv_cache=kv_cache, out=out, lse=lse, return_lse=self.return_lse,
                return_lse_base_on_e=self.return_lse,
            )  # fmt: skip
        return self._run_general(query, kv_cache, out, lse)

    def run_matched(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run a 4-D query whose shape and dtype the caller matched to :attr:`call_signature`.

        ``mla_decode``'s per-call path: it skips the query checks that the
        signature comparison already made, and returns the caller's own
        ``out``/``lse`` where given.
        """
        if self._fast_shape is None or len(kv_shape := kv_cache.shape) != 3 or kv_shape[1] != self.page_size:
            return self._run_general(query, kv_cache, out, lse)
        workspace = self._pool.request(self._nbytes, self.rule)
        wrapper = self._wrapper
        if workspace is not self._planned_workspace or wrapper._wspool_owner is not self._token:
            self._plan_wrapper()
            wrapper = self._wrapper
        # view(*sizes) parses faster than view(tuple): each view is a measurable part of this path.
        tokens, heads, dim = self._packed_shape
        result = wrapper.run(
            query=query.view(tokens, heads, dim), kv_cache=kv_cache,
            out=None if out is None else out.view(tokens, heads, self.kv_lora_rank),
            lse=None if lse is None else lse.view(tokens, heads),
            return_lse=self.return_lse, return_lse_base_on_e=self.return_lse,
        )  # fmt: skip
        return self._shape_result(result, out, lse)

    def _run_general(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Validate, then run any path with either query form."""
        packed = query.dim() == 3
        if query.shape != (self._packed_shape if packed else self._query_shape) or query.dtype != self.q_dtype:
            raise ValueError(
                f"query is {tuple(query.shape)} {query.dtype}, but the plan is for {self._query_shape} "
                f"(or packed {self._packed_shape}) {self.q_dtype}; make a new plan for a new shape"
            )
        if kv_cache.dim() != 3 or kv_cache.shape[1] != self.page_size or kv_cache.shape[2] != self._head_dim:
            raise ValueError(
                f"kv_cache must be [pages, {self.page_size}, {self._head_dim}], got {tuple(kv_cache.shape)}"
            )
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
                    query, kv_cache, self.block_tables, self.seq_lens, out, lse, sm_scale=self.sm_scale,
                    kv_lora_rank=self.kv_lora_rank, return_lse=self.return_lse,
                )  # fmt: skip
            else:
                counters = self._counters.workspace("default", self.facts) if path == "trtllm-gen" else None
                result = self._shape_result(
                    run_trtllm(self, query, kv_cache, out, lse, workspace, counters, pool=self._pool,
                               setting=self._setting),
                    out, lse,
                )  # fmt: skip
            return self._packed_result(result, *given) if packed else result
        if not packed:
            return self.run_matched(query, kv_cache, out, lse)  # validated above; it requests the workspace
        # A packed query that passed these checks meets every condition of run()'s fast path.
        return self.run(query, kv_cache, out=out, lse=lse)

    def _shape_result(
        self, result: Any, out: torch.Tensor | None, lse: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Return results in the 4-D form, as the caller's own buffers where it gave them."""
        # view(*sizes), as in run_matched: these views are on the per-call path.
        if self.return_lse:
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
        if self.return_lse:
            got_out, got_lse = result
            return (
                out if out is not None else got_out.view(tokens, heads, -1),
                lse if lse is not None else got_lse.view(tokens, heads),
            )
        return out if out is not None else result.view(tokens, heads, -1)

    # -- planning (wrapper path) ----------------------------------------------

    def _plan_wrapper(self) -> None:
        """Plan FlashInfer's wrapper for the current metadata, on the pool's current buffer."""
        plan_kwargs = self._plan_kwargs
        if plan_kwargs is None:
            plan_kwargs = self._plan_kwargs = self.wrapper_plan_kwargs()
        plan_kwargs["metadata"] = self._csr_factory(*self._csr_metadata())
        for attempt in range(MAX_RECOVERIES + 1):
            workspace = self._pool.buffer
            wrapper = self._wrapper
            generation = self._generation
            # The steady state of one plan per step skips this: the plan still owns its wrapper,
            # on the buffer it was built on (which held this plan's size then, and still does).
            if wrapper is None or workspace is not self._planned_workspace or wrapper._wspool_owner is not self._token:
                if workspace is None or self._pool.capacity_bytes < self._nbytes:
                    workspace = self._pool.grow_to(self._nbytes, f"rule {self.rule}", self._setting)
                generation = self._pool.generation
                wrapper = self._acquire_wrapper(workspace, generation)
            # Nobody owns a wrapper mid-plan: if plan() fails, no plan may run on it unplanned.
            wrapper._wspool_owner = None
            try:
                self.plan_calls += 1
                wrapper.plan(**plan_kwargs)
            except (RuntimeError, ValueError) as exc:  # the C++ allocator's, or FlashInfer's Python checks
                grow_after_overflow(
                    exc, pool=self._pool, capacity=workspace.numel(), attempt=attempt,  # type: ignore[union-attr]
                    op="MLA decode", rule=self.rule, setting=self._setting, path=self.path,
                )  # fmt: skip
                continue
            wrapper._wspool_owner = self._token
            self._wrapper = wrapper
            self._planned_workspace = workspace
            self._generation = generation
            return

    def _csr_metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convert the page table to FlashInfer's CSR form, on the device (one host sync)."""
        constants = self._csr_constants
        if constants is None:
            constants = step_constants(self.block_tables, self.batch_size, self.q_len, self.device)
            self._csr_constants = constants
        capacity = None if self._graph_buffers is None else self._graph_buffers[2].numel()
        return wrapper_metadata(self.block_tables, self.seq_lens, self.page_size, constants, capacity)

    def _acquire_wrapper(self, workspace: torch.Tensor, generation: int) -> Any:
        if self.use_cuda_graph:
            if self._wrapper is not None and self._generation == generation:
                return self._wrapper
            self._graph_buffers = graph_buffers(self.batch_size, self.block_tables.numel(), self.device)
            wrapper = mla_wrappers.make_wrapper(workspace, self.path, self._graph_buffers)  # type: ignore[arg-type]
        else:
            wrapper = mla_wrappers.shared_wrapper(self._pool, workspace, self.path, self.return_lse)
        track_kernel_buffers(self._registry, self._pool, wrapper, self._graph_buffers or ())
        return wrapper


#: Plan MLA decode for one step (the documented entry point; the class is the plan).
mla_decode_plan = MLADecodePlan
