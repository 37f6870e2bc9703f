"""MLA decode (DeepSeek / Kimi geometry) planned once per step, run once per layer, on a pool's buffer.

:func:`mla_decode_plan` checks the step's metadata, sizes the workspace for
its kernel path and prepares the kernel; :meth:`MLADecodePlan.run` calls it
per layer. Device semantics: a plan lives on the device of its tensors.
Capture semantics: with ``use_cuda_graph=True`` the plan's buffers never move
and :meth:`MLADecodePlan.replan` updates them in place. Thread semantics: a
plan is used by one thread at a time. Paths and sizes: docs/kernels.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from wspool.devices import resolve_device
from wspool.errors import describe_setting
from wspool.flashinfer import backends, kernels
from wspool.flashinfer.backends import BLACKWELL_BACKENDS, check_dcp, check_kernel_keywords, path_need_bytes
from wspool.flashinfer.layouts import CSRConstants, csr_parts
from wspool.flashinfer.reference import mla_decode_reference_into
from wspool.flashinfer.refusals import MAX_RECOVERIES, grow_after_overflow
from wspool.memory import track_kernel_buffers
from wspool.pool import WorkspacePool
from wspool.registry import PoolRegistry, get_registry

__all__ = [
    "COUNTER_POOL",
    "COUNTER_RULE",
    "MLA_POOL",
    "MLADecodePlan",
    "MLAPlanArgs",
    "StepConstants",
    "check_plan_args",
    "counter_pool",
    "graph_buffers",
    "mla_decode_plan",
    "run_trtllm",
    "size_workspace",
    "step_constants",
    "wrapper_metadata",
    "write_counts",
]


#: The page-table constants and the ``[batch + 1]`` query offsets of one plan.
StepConstants = tuple[CSRConstants, torch.Tensor]


def step_constants(block_tables: torch.Tensor, batch_size: int, q_len: int, device: torch.device) -> StepConstants:
    """Make what the conversion needs that the plan's shapes fix: made once, never written.

    FlashInfer may keep a reference to the query offsets until the step's last run.
    """
    with torch.inference_mode(False):
        offsets = torch.arange(0, (batch_size + 1) * q_len, q_len, dtype=torch.int32, device=device)
    return CSRConstants.for_table(block_tables), offsets


def wrapper_metadata(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    constants: StepConstants,
    graph_capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert the page table to FlashInfer's ``(qo_indptr, kv_indptr, kv_indices, lengths)``, on the device.

    Args:
        graph_capacity: The page capacity of a CUDA-graph plan's fixed buffers; ``None`` for eager plans.

    Raises:
        ValueError: The live pages exceed ``graph_capacity``.
    """
    kv_indptr, kv_indices, lengths, _ = csr_parts(block_tables, seq_lens, page_size, constants[0])
    if graph_capacity is not None and kv_indices.numel() > graph_capacity:
        # Graph mode: FlashInfer copies the metadata into the fixed buffers at plan time.
        raise ValueError(
            f"the page table holds {kv_indices.numel()} live pages, more than the {graph_capacity} "
            f"this CUDA-graph plan was made for; make a new plan"
        )
    return constants[1], kv_indptr, kv_indices, lengths


def graph_buffers(
    batch_size: int, max_pages: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CUDA-graph wrapper's fixed index buffers: ``(qo_indptr, kv_indptr, kv_indices, kv_len)``.

    Normal tensors (never inference tensors): FlashInfer copies into them at every plan, in any mode.
    """
    with torch.inference_mode(False):
        return (
            torch.empty(batch_size + 1, dtype=torch.int32, device=device),
            torch.empty(batch_size + 1, dtype=torch.int32, device=device),
            torch.empty(max_pages, dtype=torch.int32, device=device),
            torch.empty(batch_size, dtype=torch.int32, device=device),
        )


logger = logging.getLogger(__name__)

COUNTER_POOL = "flashinfer_mla_counters"
#: trtllm-gen's multi-CTA semaphores: FlashInfer's own formula, as a rule.
COUNTER_RULE = "round_up(max(batch_size * num_heads, sm_count), 8) * 4"


class MLAPlanArgs:
    """An MLA decode plan's checked arguments, kernel path, rule and call facts, and the metadata it is for.

    The base of :class:`~wspool.flashinfer.mla.MLADecodePlan`, which documents
    each argument. Its attributes are fixed for the plan's life (``facts``
    gains the pool's default facts once, in the plan), but for the metadata's
    write counts, which a replan renews. Thread semantics: one thread at a time.

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
        q_len: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype | None,
        return_lse: bool,
        backend: str,
        use_cuda_graph: bool,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        qk_nope_head_dim: int,
        facts: Mapping[str, int] | None,
        enable_dcp: bool,
        cp_world: int,
        cp_rank: int,
        causal_seqlens_kv_global: torch.Tensor | None,
    ) -> None:
        device, batch_size = check_plan_args(
            block_tables, seq_lens, max_seq_len, num_heads=num_heads, page_size=page_size, q_len=q_len
        )
        self.device = device
        self.dcp = check_dcp(
            enable_dcp, cp_world, cp_rank, causal_seqlens_kv_global, backend=backend, return_lse=return_lse,
            batch_size=batch_size, device=device,
        )  # fmt: skip
        self.path = backends.select_path(
            device, backend, num_heads=num_heads, page_size=page_size, enable_dcp=enable_dcp
        )
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.q_len = q_len
        self.num_heads = num_heads
        self.page_size = page_size
        self.sm_scale = float(sm_scale)
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype or q_dtype
        self.return_lse = return_lse
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_nope_head_dim = qk_nope_head_dim
        self.use_cuda_graph = use_cuda_graph
        self.rule = "lse" if return_lse else "default"
        self.facts: dict[str, int] = {
            **backends.call_facts(
                batch_size=batch_size, q_len=q_len, num_heads=num_heads, max_seq_len=max_seq_len,
                page_size=page_size, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                dtype_bytes=q_dtype.itemsize, sm_count=backends.sm_count(device),
                cp_world=cp_world if enable_dcp else None,
            ),
            **(facts or {}),
        }  # fmt: skip
        self._versions = write_counts(block_tables, seq_lens)
        #: The shapes of ``block_tables`` and ``seq_lens`` this plan was made for.
        self.planned_shapes = (block_tables.shape, seq_lens.shape)

    def is_current_for(self, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> bool:
        """Whether these are the very tensors this plan was made for, unmodified since.

        Always ``False`` for inference tensors (made under ``torch.inference_mode``):
        torch counts no writes to them, so an edit cannot be ruled out.
        """
        return (
            block_tables is self.block_tables
            and seq_lens is self.seq_lens
            and self._versions is not None
            and write_counts(block_tables, seq_lens) == self._versions
        )

    def replan(self) -> None:
        """Plan again for the current contents of ``block_tables`` and ``seq_lens``.

        Raises:
            ValueError: They were resized in place since planning; make a new plan.
        """
        if self.metadata_resized():
            raise ValueError(
                f"block_tables/seq_lens were resized to {tuple(self.block_tables.shape)}/"
                f"{tuple(self.seq_lens.shape)} after planning for {tuple(self.planned_shapes[0])}/"
                f"{tuple(self.planned_shapes[1])}; make a new plan"
            )
        self.replan_for(write_counts(self.block_tables, self.seq_lens))

    def metadata_resized(self) -> bool:
        """Whether ``block_tables`` or ``seq_lens`` were resized in place since planning."""
        return (self.block_tables.shape, self.seq_lens.shape) != self.planned_shapes

    @property
    def metadata_versions(self) -> tuple[int, int] | None:
        """The metadata's write counts this plan was made for; ``None`` for inference tensors (they count none)."""
        return self._versions

    def replan_for(self, versions: tuple[int, int] | None) -> None:
        """:meth:`replan` for metadata whose shapes the caller checked, with its write counts read."""
        self._versions = versions
        self.plan_metadata()

    def plan_metadata(self) -> None:
        """Plan the kernel for the current metadata (the plan's; a no-op for paths that read it at run time)."""

    def wrapper_plan_kwargs(self) -> dict[str, Any]:
        """The arguments of FlashInfer's wrapper ``plan()`` for this plan, without the metadata."""
        return kernels.wrapper_plan_kwargs(
            metadata=None,
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            page_size=self.page_size,
            causal=self.q_len > 1,
            sm_scale=self.sm_scale,
            q_dtype=self.q_dtype,
            kv_dtype=self.kv_dtype,
            return_lse=self.return_lse,
        )


def check_plan_args(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, *, num_heads: int, page_size: int, q_len: int
) -> tuple[torch.device, int]:
    """Check a plan's metadata and sizes; return its device and batch size.

    Raises:
        ValueError: A bad argument, named.
    """
    device = block_tables.device if isinstance(block_tables, torch.Tensor) else resolve_device(None)
    backends.check_int_tensor("block_tables", block_tables, 2, device)
    backends.check_int_tensor("seq_lens", seq_lens, 1, device)
    batch_size: int = seq_lens.shape[0]
    if block_tables.shape[0] != batch_size:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has {batch_size} entries")
    for name, value in (("num_heads", num_heads), ("page_size", page_size), ("q_len", q_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    return device, batch_size


def size_workspace(
    registry: PoolRegistry,
    pool: WorkspacePool,
    *,
    pool_name: str,
    rule: str,
    facts: dict[str, int],
    path: str,
    need_bytes: int,
    setting: str,
) -> int:
    """Grow ``pool`` to what a plan requests, the rule or the path's need where the rule is below it; return that.

    A replan checks the pool against the returned size, not the rule. The pool
    grows here, outside the per-layer path (and outside any later capture).
    """
    rule_bytes = pool.resolve(rule, facts)
    nbytes = max(rule_bytes, need_bytes)
    if need_bytes > rule_bytes:
        _warn_rule_below_need(registry, pool_name, rule, path, rule_bytes, need_bytes, nbytes, setting)
    pool.grow_to(nbytes, f"rule {rule}" if nbytes == rule_bytes else f"the {path} kernel path", setting)
    return nbytes


def _warn_rule_below_need(
    registry: PoolRegistry,
    pool_name: str,
    rule: str,
    path: str,
    rule_bytes: int,
    need_bytes: int,
    nbytes: int,
    setting: str,
) -> None:
    """Say once per registry, pool, rule and path that the rule is below the path's need."""
    warned: set[tuple[str, str, str]] = registry.op_state.setdefault("mla_rule_below_need", set())
    key = (pool_name, rule, path)
    if key in warned:
        return
    warned.add(key)
    logger.warning(
        "wspool: rule %s of pool %s resolves to %d bytes, below the %d bytes FlashInfer's %s MLA decode needs "
        "here; requesting %d bytes. Raise %s to at least that to silence this",
        rule, pool_name, rule_bytes, need_bytes, path, nbytes, setting,
    )  # fmt: skip


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


def run_trtllm(
    plan: MLAPlanArgs,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    workspace: torch.Tensor,
    counters: torch.Tensor | None,
    *,
    pool: WorkspacePool,
    setting: str,
) -> Any:
    """Run the plan's Blackwell kernel on a 4-D query; return what the kernel returns.

    Args:
        workspace: The pool's buffer, requested for the plan's size.
        counters: trtllm-gen's counter buffer (``None`` for cute-dsl).
        pool: The pool ``workspace`` came from; it grows when FlashInfer refuses the buffer.
        setting: The rule's setting, named in recovery's messages.

    Raises:
        WorkspaceOverflowError: FlashInfer still overflowed after recovery.
    """
    kernel = kernels.load_flashinfer_mla().trtllm_batch_decode_with_kv_cache_mla
    tokens = plan.batch_size * plan.q_len
    for attempt in range(MAX_RECOVERIES + 1):
        try:
            return kernel(
                **kernels.trtllm_decode_kwargs(
                    query=query,
                    kv_cache=kv_cache,
                    workspace=workspace,
                    backend=plan.path,
                    dcp=plan.dcp,
                    counters=counters,
                    block_tables=plan.block_tables,
                    seq_lens=plan.seq_lens,
                    max_seq_len=plan.max_seq_len,
                    sm_scale=plan.sm_scale,
                    out=out,
                    lse=None if lse is None else lse.view(tokens, plan.num_heads),  # trtllm's native LSE form
                    return_lse=plan.return_lse,
                    kv_lora_rank=plan.kv_lora_rank,
                    qk_rope_head_dim=plan.qk_rope_head_dim,
                    qk_nope_head_dim=plan.qk_nope_head_dim,
                )
            )
        except (RuntimeError, ValueError) as exc:  # the C++ allocator's, or FlashInfer's Python checks
            workspace = grow_after_overflow(
                exc, pool=pool, capacity=workspace.numel(), attempt=attempt, op="MLA decode", rule=plan.rule,
                setting=setting, path=plan.path,
            )  # fmt: skip
    raise AssertionError("unreachable")  # pragma: no cover


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
            :mod:`~wspool.flashinfer.backends`); the pool holds at least this and the rule.
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
        kv_lora_rank: int = backends.KV_LORA_RANK,
        qk_rope_head_dim: int = backends.QK_ROPE_HEAD_DIM,
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
            wrapper = kernels.make_wrapper(workspace, self.path, self._graph_buffers)  # type: ignore[arg-type]
        else:
            wrapper = kernels.shared_wrapper(self._pool, workspace, self.path, self.return_lse)
        track_kernel_buffers(self._registry, self._pool, wrapper, self._graph_buffers or ())
        return wrapper


#: Plan MLA decode for one step (the documented entry point; the class is the plan).
mla_decode_plan = MLADecodePlan
