"""FlashInfer paged attention (GQA decode and prefill) with its float workspace from a wspool pool.

Plans are made once per step (``plan()`` copies the page table to the host) on
the page table's device; :meth:`PagedAttentionPlan.run` is the per-layer call.
A plan and its lane's buffer serve one stream at a time. These wrappers are
eager: planning never runs during capture (graph-mode engines build their own
on ``reg.workspace("flashinfer", rule=...)``). Pools, paths and the shared
buffer: docs/kernels.md; int workspaces: docs/wrapper-buffers.md.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from wspool.errors import describe_setting
from wspool.flashinfer import backends, kernels, wrapper_buffers
from wspool.flashinfer.layouts import check_int_tensor, check_page_table, page_table_to_csr
from wspool.flashinfer.reference import paged_attention_reference
from wspool.flashinfer.refusals import MAX_RECOVERIES, grow_after_overflow
from wspool.flashinfer.wrapper_buffers import FLASHINFER_INT_DEFAULT_BYTES, PlanOwner
from wspool.memory import track_kernel_buffers
from wspool.registry import PoolRegistry, get_registry
from wspool.units import ceil_div

__all__ = ["BACKENDS", "FLOAT_CARVES", "PAGED_POOL", "PagedAttentionPlan", "paged_decode_plan", "paged_prefill_plan"]

PAGED_POOL = "flashinfer"
BACKENDS = ("auto", "reference", "fa2", "fa3")
# What the pool's rules bound: an eager plan carves the float workspace only for split-KV
# partial outputs (head_dim + 1 floats per row), at most 256 rows per SM for the prefill and
# tensor-core decode kernels, 512 for the CUDA-core decode kernel, plus one per query head
# (Hopper's fa3 prefill carves none). A plan that still overflows grows the pool and plans again.
#: The carves these plans make in the float workspace; others are FlashInfer's own int workspace.
FLOAT_CARVES = frozenset({"batch_decode_tmp_v", "batch_decode_tmp_s", "batch_prefill_tmp_v", "batch_prefill_tmp_s"})
_LN2 = math.log(2.0)


def _no_wrapper() -> None:
    """Stand for the wrapper a plan has not planned yet."""


def _has_kernels(device: torch.device) -> bool:
    return device.type == "cuda"


def _paged_csr(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The page table in FlashInfer's paged form: (indptr, indices, last_page_len)."""
    csr = page_table_to_csr(block_tables, seq_lens, page_size)
    return csr.indptr, csr.indices, csr.lengths - (csr.pages - 1) * page_size


def _select_path(backend: str, device: torch.device) -> str:
    """Return ``"reference"`` or the FlashInfer backend asked for, checked against ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown paged attention backend {backend!r} (choose one of {', '.join(BACKENDS)})")
    on_cpu = not _has_kernels(device)
    if backend == "reference" or (on_cpu and backend == "auto"):
        return "reference"
    if on_cpu:
        raise ValueError(
            f"paged attention backend {backend!r} needs a CUDA device, got {device}; use backend='reference'"
        )
    return backend


def _check_cached_lengths(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """Check that every request has a cached token (the new one) and that its pages fit the table."""
    if not seq_lens.shape[0]:
        return
    if int(seq_lens.min()) < 1:
        raise ValueError("seq_lens must be at least 1 for every request (the new tokens are in the cache)")
    widest = ceil_div(int(seq_lens.max()), page_size)
    if widest > block_tables.shape[1]:
        raise ValueError(
            f"seq_lens needs {widest} pages for its longest request, but block_tables has "
            f"{block_tables.shape[1]} columns"
        )


def _query_rows(qo_indptr: torch.Tensor | None, seq_lens: torch.Tensor, causal: bool) -> torch.Tensor:
    """Return checked ``[batch + 1]`` query-row offsets: one row per request when ``qo_indptr`` is ``None``."""
    batch, device = seq_lens.shape[0], seq_lens.device
    if qo_indptr is None:
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    check_int_tensor("qo_indptr", qo_indptr, 1, device)
    if qo_indptr.numel() != batch + 1:
        raise ValueError(f"qo_indptr must have batch + 1 = {batch + 1} entries, got {qo_indptr.numel()}")
    rows = qo_indptr[1:] - qo_indptr[:-1]
    if batch and (int(rows.min()) < 0 or (causal and bool((rows > seq_lens).any()))):
        raise ValueError(
            "qo_indptr must not decrease, and with causal no request may have more query "
            "rows than its seq_lens (the new tokens are the last cached ones)"
        )
    return qo_indptr


class PagedAttentionPlan:
    """Paged attention planned for one page table and query layout; ``kind`` is also the rule that sizes it.

    Metadata mutated after planning needs :meth:`replan`. Wrappers live in the
    pool's ``buffer_cache``, emptied when the buffer is replaced; a plan holds
    none and plans again when its wrapper is gone or another plan planned it.
    """

    def __init__(
        self,
        kind: str,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        qo_indptr: torch.Tensor | None,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool,
        sm_scale: float | None,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype | None,
        use_tensor_cores: bool | None,
        registry: PoolRegistry | None,
        pool: str,
        backend: str,
        lane: str | None,
        facts: Mapping[str, int] | None,
    ) -> None:
        """Check the arguments, size the pool for the step and plan it; the public functions document them."""
        self.device, batch = check_page_table(
            block_tables,
            seq_lens,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
        )
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.path = _select_path(backend, self.device)
        _check_cached_lengths(block_tables, seq_lens, page_size)
        self.qo_indptr = _query_rows(qo_indptr, seq_lens, causal)
        self.kind, self.block_tables, self.seq_lens, self.causal = kind, block_tables, seq_lens, causal
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self.sm_scale = float(sm_scale) if sm_scale is not None else head_dim**-0.5
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype or q_dtype
        group = num_qo_heads // num_kv_heads
        self.use_tensor_cores = group > 4 if use_tensor_cores is None else bool(use_tensor_cores)
        tokens = int(self.qo_indptr[-1]) if batch else 0
        self._query_shape = (tokens, num_qo_heads, head_dim)
        self._kv_shape = (2, page_size, num_kv_heads, head_dim)
        self.facts = self._call_facts(batch, tokens, facts)
        self._attach_pool(registry if registry is not None else get_registry(), pool, lane)
        self._pool.ensure(kind, self.facts)  # grow now, outside the per-layer path
        self.replan()

    def _call_facts(self, batch: int, tokens: int, facts: Mapping[str, int] | None) -> dict[str, int]:
        """Return the facts the rule reads: the step's shape, the device's SM count, then the caller's."""
        return {
            "batch_size": batch,
            "num_tokens": tokens,
            "num_qo_heads": self.num_qo_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "dtype_bytes": self.q_dtype.itemsize,
            "sm_count": backends.sm_count(self.device),
            **(facts or {}),
        }

    def _attach_pool(self, registry: PoolRegistry, pool: str, lane: str | None) -> None:
        """Take the plan's pool, and the cache key and ownership record of the wrapper it plans."""
        self._registry = registry
        self._pool = registry.pool(pool, self.device, lane=lane)
        self._setting = describe_setting(("pools", pool, "rules", self.kind))
        self._key = (f"paged_{self.kind}", self.path, self.use_tensor_cores if self.kind == "decode" else None)
        self._token = object()  # this plan, as a shared wrapper's owner
        self._ownership = PlanOwner()  # the record of the wrapper this plan planned last
        self._planned_wrapper: Callable[[], Any] = _no_wrapper  # then a weak reference: the plan holds none
        self.plan_calls = 0
        dtypes = (self.q_dtype, self.kv_dtype)
        planner = wrapper_buffers.planner_backend(self.path, self.device) if self.path != "reference" else self.path
        self.int_rule = wrapper_buffers.paged_int_rule(
            self.kind, use_tensor_cores=self.use_tensor_cores, backend=planner, dtypes=dtypes
        )

    def replan(self) -> None:
        """Plan again for the current contents of the page table, lengths and ``qo_indptr`` (same shapes)."""
        if self.path != "reference":
            self._csr = _paged_csr(self.block_tables, self.seq_lens, self.page_size)
            self._plan_wrapper()

    # -- the per-layer call ----------------------------------------------------

    def run(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run paged attention for one layer; return ``out``, or ``(out, lse)`` with ``return_lse``.

        ``query`` is ``[tokens, num_qo_heads, head_dim]``, ``kv_cache`` NHD
        ``[pages, 2, page_size, num_kv_heads, head_dim]``.

        Raises:
            ValueError: The query or KV cache does not match the plan.
            WorkspaceFrozenError: The pool would have to grow while frozen or capturing.
            WorkspaceOverflowError: FlashInfer still overflowed after recovery.
        """
        if query.shape != self._query_shape or query.dtype != self.q_dtype:
            raise ValueError(
                f"query is {tuple(query.shape)} {query.dtype}, but the plan is for "
                f"{self._query_shape} {self.q_dtype}; make a new plan for a new shape"
            )
        if kv_cache.dim() != 5 or kv_cache.shape[1:] != self._kv_shape:
            raise ValueError(
                f"kv_cache must be [pages, {', '.join(map(str, self._kv_shape))}] (NHD), got {tuple(kv_cache.shape)}"
            )
        self._pool.workspace(self.kind, self.facts)  # counts the request; grows only if the pool was reset
        if self.path == "reference":
            ref_out, ref_lse = paged_attention_reference(
                query,
                kv_cache,
                self.qo_indptr,
                self.block_tables,
                self.seq_lens,
                sm_scale=self.sm_scale,
                causal=self.causal,
            )
            if out is not None:
                ref_out = out.copy_(ref_out)
            if not return_lse:
                return ref_out
            return ref_out, (ref_lse if lse is None else lse.copy_(ref_lse))
        wrapper: Any = self._pool.buffer_cache.get(self._key)
        if wrapper is None or wrapper is not self._planned_wrapper() or self._ownership.owner is not self._token:
            wrapper = self._plan_wrapper()  # the pool replaced its buffer, or another plan took the wrapper
        run_kwargs: dict[str, Any] = {
            "query": query,
            "kv_cache": kv_cache,
            "out": out,
            "lse": lse,
            "return_lse": return_lse,
        }
        if self.kind == "prefill":
            return wrapper.run(**kernels.paged_prefill_run_kwargs(**run_kwargs))  # type: ignore[no-any-return]
        result = wrapper.run(**kernels.paged_decode_run_kwargs(**run_kwargs))
        if return_lse:
            result[1].mul_(_LN2)  # FlashInfer's decode LSE is base 2
        return result  # type: ignore[no-any-return]

    # -- planning (wrapper path) ----------------------------------------------

    def _plan_wrapper(self) -> Any:
        """Plan the pool's cached wrapper (made if missing) for the current page table; return it."""
        kv_indptr, kv_indices, last_page_len = self._csr
        common: dict[str, Any] = {
            "kv_indptr": kv_indptr,
            "kv_indices": kv_indices,
            "kv_last_page_len": last_page_len,
            "num_qo_heads": self.num_qo_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "sm_scale": self.sm_scale,
            "q_dtype": self.q_dtype,
            "kv_dtype": self.kv_dtype,
        }
        if self.kind == "decode":
            plan_kwargs = kernels.paged_decode_plan_kwargs(**common)
        else:
            plan_kwargs = kernels.paged_prefill_plan_kwargs(qo_indptr=self.qo_indptr, causal=self.causal, **common)
        for attempt in range(MAX_RECOVERIES + 1):
            workspace = self._pool.ensure(self.kind, self.facts)
            cache = self._pool.buffer_cache
            wrapper = cache.get(self._key)
            if wrapper is None:
                wrapper = self._make_wrapper(workspace)
                track_kernel_buffers(
                    self._registry, self._pool, wrapper, default_int_bytes=FLASHINFER_INT_DEFAULT_BYTES
                )
                if self._pool.buffer is workspace:  # not replaced meanwhile by another thread
                    cache[self._key] = wrapper
            if self.int_rule is not None:  # a region that holds this step's plan (a larger one when it grew)
                wrapper_buffers.bind_paged_wrapper(
                    wrapper,
                    workspace,
                    registry=self._registry,
                    rule=self.int_rule,
                    facts=self.facts,
                    lane=self._pool.lane,
                    kind=self.kind,
                )
            record = kernels.ownership(wrapper)
            record.owner = None  # no plan may run it while it is being planned
            try:
                self.plan_calls += 1
                wrapper.plan(**plan_kwargs)
            except (RuntimeError, ValueError) as exc:  # the C++ allocator's, or FlashInfer's Python checks
                grow_after_overflow(
                    exc,
                    pool=self._pool,
                    capacity=workspace.numel(),
                    attempt=attempt,
                    op=f"paged {self.kind}",
                    rule=self.kind,
                    setting=self._setting,
                    float_carves=FLOAT_CARVES,
                    int_setting=wrapper_buffers.int_setting_of(wrapper),
                )
                continue
            record.owner = self._token
            self._ownership, self._planned_wrapper = record, weakref.ref(wrapper)
            return wrapper
        raise AssertionError("unreachable")  # pragma: no cover

    def _make_wrapper(self, workspace: torch.Tensor) -> Any:
        """Build this plan's kind of FlashInfer wrapper on ``workspace``."""
        flashinfer = kernels.load_flashinfer_attention()
        if self.kind == "decode":
            wrapper_cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper
            init_kwargs = kernels.paged_decode_init_kwargs(
                workspace=workspace, backend=self.path, use_tensor_cores=self.use_tensor_cores
            )
        else:
            wrapper_cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper
            init_kwargs = kernels.paged_prefill_init_kwargs(workspace=workspace, backend=self.path)
        # Normal tensors for the wrapper's own buffers, as for the MLA wrapper (see kernels.make_wrapper).
        with torch.inference_mode(False):
            return wrapper_cls(**init_kwargs)


def paged_decode_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    sm_scale: float | None = None,
    q_dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    use_tensor_cores: bool | None = None,
    registry: PoolRegistry | None = None,
    pool: str = PAGED_POOL,
    backend: str = "auto",
    lane: str | None = None,
    facts: Mapping[str, int] | None = None,
) -> PagedAttentionPlan:
    """Plan paged decode (one query token per request) for one step; ``plan.run(query, kv_cache)`` per layer.

    Args:
        block_tables: ``[batch, max_pages]`` int32 page ids, on the decode device.
        seq_lens: ``[batch]`` int32 cached lengths (the new token included), each at least 1.
        use_tensor_cores: FlashInfer's tensor-core decode; default for GQA groups above 4.
        backend: ``"auto"``, ``"reference"``, ``"fa2"`` or ``"fa3"``.
        facts: Extra facts for rule ``decode``, beside the plan's own.
    """
    return PagedAttentionPlan(
        "decode",
        block_tables,
        seq_lens,
        None,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        causal=False,
        sm_scale=sm_scale,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        use_tensor_cores=use_tensor_cores,
        registry=registry,
        pool=pool,
        backend=backend,
        lane=lane,
        facts=facts,
    )


def paged_prefill_plan(
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    causal: bool = True,
    sm_scale: float | None = None,
    q_dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    registry: PoolRegistry | None = None,
    pool: str = PAGED_POOL,
    backend: str = "auto",
    lane: str | None = None,
    facts: Mapping[str, int] | None = None,
) -> PagedAttentionPlan:
    """Plan paged prefill (ragged query rows per request, appended to the cache) for one step.

    ``qo_indptr`` (``[batch + 1]`` int32) offsets each request's query rows; the
    others are as for :func:`paged_decode_plan`, with rule ``prefill``.
    """
    return PagedAttentionPlan(
        "prefill",
        block_tables,
        seq_lens,
        qo_indptr,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        causal=causal,
        sm_scale=sm_scale,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        use_tensor_cores=None,
        registry=registry,
        pool=pool,
        backend=backend,
        lane=lane,
        facts=facts,
    )
