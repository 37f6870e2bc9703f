"""Every FlashInfer call wspool makes, built in one place, the MLA wrappers built on a pool's buffer, and their owners.

Each ``*_kwargs`` function returns the exact keyword arguments wspool passes, so
the CPU tests bind them to the installed FlashInfer's signatures. FlashInfer is
imported lazily. Wrappers are built with normal (never inference) tensors and
cached in the pool's ``buffer_cache``, so none outlives its buffer.
"""

from __future__ import annotations

import importlib
import weakref
from types import ModuleType
from typing import Any

import torch

from wspool.flashinfer.backends import PRIVATE_NAMES_READ, DCPArgs, int8_view
from wspool.flashinfer.wrapper_buffers import PlanOwner, binding_of
from wspool.pool import WorkspacePool

__all__ = [
    "TRTLLM_DECODE_KEYWORDS",
    "graph_buffers",
    "load_flashinfer_attention",
    "load_flashinfer_mla",
    "make_wrapper",
    "ownership",
    "paged_decode_init_kwargs",
    "paged_decode_plan_kwargs",
    "paged_decode_run_kwargs",
    "paged_prefill_init_kwargs",
    "paged_prefill_plan_kwargs",
    "paged_prefill_run_kwargs",
    "shared_wrapper",
    "trtllm_decode_kwargs",
    "wrapper_backend",
    "wrapper_float_workspace",
    "wrapper_init_kwargs",
    "wrapper_plan_kwargs",
    "wrapper_run_kwargs",
]


_INSTALL_HINT = "install a supported one: pip install 'flashinfer-python>=0.7.2,<0.7.5' (or backend='reference')"


_flashinfer_mla: ModuleType | None = None


def load_flashinfer_mla() -> ModuleType:
    """Import ``flashinfer.mla`` once; ``ImportError`` with an install hint when FlashInfer is missing."""
    global _flashinfer_mla
    if _flashinfer_mla is None:
        try:
            _flashinfer_mla = importlib.import_module("flashinfer.mla")
        except ImportError as exc:
            raise ImportError(f"wspool's MLA decode kernels need FlashInfer ({exc}); {_INSTALL_HINT}") from exc
    return _flashinfer_mla


def trtllm_decode_kwargs(
    *,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace: torch.Tensor,
    backend: str,
    dcp: DCPArgs,
    counters: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    sm_scale: float,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    return_lse: bool,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
) -> dict[str, Any]:
    """Arguments of ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` (Blackwell), as vLLM passes them.

    ``counters`` (trtllm-gen only) come from their own pool, so they are zeroed
    once and never reallocated behind a captured graph.
    """
    return {
        "query": query,
        "kv_cache": kv_cache.unsqueeze(1),  # [pages, 1, page_size, dim]: one shared KV head
        "workspace_buffer": int8_view(workspace) if backend == "cute-dsl" else workspace,
        "qk_nope_head_dim": qk_nope_head_dim,
        "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": qk_rope_head_dim,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "max_seq_len": max_seq_len,
        "out": out,
        "bmm1_scale": sm_scale,
        "bmm2_scale": 1.0,
        "backend": backend,
        "lse": lse,
        "return_lse": return_lse,
        "multi_ctas_kv_counter_buffer": counters,
        "return_lse_base": "basee",
        **dcp.kwargs(),
    }


#: Every keyword :func:`trtllm_decode_kwargs` passes (checked against the installed kernel once).
TRTLLM_DECODE_KEYWORDS = (
    "query", "kv_cache", "workspace_buffer", "qk_nope_head_dim", "kv_lora_rank", "qk_rope_head_dim",
    "block_tables", "seq_lens", "max_seq_len", "out", "bmm1_scale", "bmm2_scale", "backend", "lse",
    "return_lse", "multi_ctas_kv_counter_buffer", "return_lse_base", "enable_dcp", "cp_world", "cp_rank",
    "causal_seqlens_kv_global",
)  # fmt: skip


def wrapper_init_kwargs(
    *,
    workspace: torch.Tensor,
    backend: str,
    graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Arguments of ``BatchMLAPagedAttentionWrapper(...)``; ``graph_buffers`` ``None`` for eager mode."""
    kwargs: dict[str, Any] = {"float_workspace_buffer": workspace, "backend": backend}
    if graph_buffers is not None:
        qo_indptr, kv_indptr, kv_indices, kv_len_arr = graph_buffers
        kwargs.update(
            use_cuda_graph=True, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr
        )
    return kwargs


def wrapper_plan_kwargs(
    *,
    metadata: object,
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    page_size: int,
    causal: bool,
    sm_scale: float,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    return_lse: bool,
) -> dict[str, Any]:
    """Arguments of ``BatchMLAPagedAttentionWrapper.plan`` (canonical CSR metadata, packed inputs)."""
    return {
        "metadata": metadata,
        "num_heads": num_heads,
        "head_dim_ckv": kv_lora_rank,
        "head_dim_kpe": qk_rope_head_dim,
        "page_size": page_size,
        "causal": causal,
        "sm_scale": sm_scale,
        "q_data_type": q_dtype,
        "kv_data_type": kv_dtype,
        "query_layout": "packed",
        "kv_cache_layout": "packed",
        # The natural-log LSE, as every other path returns it (DCP merges need one base).
        "lse_mode": "basee" if return_lse else "none",
    }


def wrapper_run_kwargs(
    *,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    return_lse: bool,
) -> dict[str, Any]:
    """Arguments of ``BatchMLAPagedAttentionWrapper.run`` (packed query ``[tokens, heads, dim]``)."""
    return {
        "query": query,
        "kv_cache": kv_cache,
        "out": out,
        "lse": lse,
        "return_lse": return_lse,
        # FlashInfer checks this against the plan's lse_mode: "basee" only when an LSE is planned.
        "return_lse_base_on_e": return_lse,
    }


# -- paged attention (GQA decode and prefill) ------------------------------------


def load_flashinfer_attention() -> ModuleType:
    """Import ``flashinfer`` (its paged wrappers); ``ImportError`` with an install hint when it is missing."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(f"wspool's paged attention kernels need FlashInfer ({exc}); {_INSTALL_HINT}") from exc


def paged_decode_init_kwargs(*, workspace: torch.Tensor, backend: str, use_tensor_cores: bool) -> dict[str, Any]:
    """Arguments of ``BatchDecodeWithPagedKVCacheWrapper(...)`` (eager, NHD paged KV cache)."""
    return {
        "float_workspace_buffer": workspace,
        "kv_layout": "NHD",
        "use_tensor_cores": use_tensor_cores,
        "backend": backend,
    }


def paged_decode_plan_kwargs(
    *,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    sm_scale: float,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> dict[str, Any]:
    """Arguments of ``BatchDecodeWithPagedKVCacheWrapper.plan`` (CSR page table, all by keyword)."""
    return {
        "indptr": kv_indptr,
        "indices": kv_indices,
        "last_page_len": kv_last_page_len,
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "page_size": page_size,
        "sm_scale": sm_scale,
        "q_data_type": q_dtype,
        "kv_data_type": kv_dtype,
    }


def paged_decode_run_kwargs(
    *, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool
) -> dict[str, Any]:
    """Arguments of ``BatchDecodeWithPagedKVCacheWrapper.run``, whose LSE is base 2 (the op converts it)."""
    return {"q": query, "paged_kv_cache": kv_cache, "out": out, "lse": lse, "return_lse": return_lse}


def paged_prefill_init_kwargs(*, workspace: torch.Tensor, backend: str) -> dict[str, Any]:
    """Arguments of ``BatchPrefillWithPagedKVCacheWrapper(...)`` (eager, NHD paged KV cache)."""
    return {"float_workspace_buffer": workspace, "kv_layout": "NHD", "backend": backend}


def paged_prefill_plan_kwargs(
    *,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    causal: bool,
    sm_scale: float,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> dict[str, Any]:
    """Arguments of ``BatchPrefillWithPagedKVCacheWrapper.plan`` (CSR query and page table)."""
    return {
        "qo_indptr": qo_indptr,
        "paged_kv_indptr": kv_indptr,
        "paged_kv_indices": kv_indices,
        "paged_kv_last_page_len": kv_last_page_len,
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim_qk": head_dim,
        "page_size": page_size,
        "causal": causal,
        "sm_scale": sm_scale,
        "q_data_type": q_dtype,
        "kv_data_type": kv_dtype,
    }


def paged_prefill_run_kwargs(
    *, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool
) -> dict[str, Any]:
    """Arguments of ``BatchPrefillWithPagedKVCacheWrapper.run``, asking for the natural-log LSE."""
    return {
        "q": query,
        "paged_kv_cache": kv_cache,
        "out": out,
        "lse": lse,
        "return_lse": return_lse,
        "lse_base": "ln",
    }


def graph_buffers(
    batch_size: int, max_pages: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CUDA-graph wrapper's fixed index buffers, normal tensors since FlashInfer copies into them every plan."""
    with torch.inference_mode(False):
        return (
            torch.empty(batch_size + 1, dtype=torch.int32, device=device),
            torch.empty(batch_size + 1, dtype=torch.int32, device=device),
            torch.empty(max_pages, dtype=torch.int32, device=device),
            torch.empty(batch_size, dtype=torch.int32, device=device),
        )


def make_wrapper(
    workspace: torch.Tensor,
    backend: str,
    graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> Any:
    """Build a ``BatchMLAPagedAttentionWrapper`` on ``workspace`` (and ``graph_buffers`` for a graph plan)."""
    wrapper_cls = load_flashinfer_mla().BatchMLAPagedAttentionWrapper
    # The wrapper's own buffers must be normal tensors: it is shared across steps, and its plan()
    # writes them in place whether or not the caller is under torch.inference_mode.
    with torch.inference_mode(False):
        return wrapper_cls(**wrapper_init_kwargs(workspace=workspace, backend=backend, graph_buffers=graph_buffers))


def shared_wrapper(pool: WorkspacePool, workspace: torch.Tensor, backend: str, lse: bool) -> Any:
    """One eager wrapper per (pool instance, buffer, backend, LSE mode), shared by successive steps' plans."""
    key = ("mla", backend, lse)
    wrapper = pool.buffer_cache.get(key)
    if wrapper is None:
        wrapper = make_wrapper(workspace, backend)
        if pool.buffer is workspace:  # not replaced meanwhile by another thread
            pool.buffer_cache[key] = wrapper
    return wrapper


# Weakly keyed: a record lives exactly as long as its wrapper (FlashInfer's wrappers are plain objects).
_ownership: weakref.WeakKeyDictionary[Any, PlanOwner] = weakref.WeakKeyDictionary()


def ownership(wrapper: Any) -> PlanOwner:
    """Return the record of the int workspace ``wrapper`` plans into (its region's, if bound), made on first use."""
    binding = binding_of(wrapper)
    if binding is not None:
        return binding.region.record
    record = _ownership.get(wrapper)
    if record is None:
        record = _ownership.setdefault(wrapper, PlanOwner())  # one record even when threads race here
    return record


def wrapper_backend(wrapper: Any) -> str | None:
    """Return the backend a FlashInfer wrapper resolved (its private ``_backend``), ``None`` where it has none."""
    return getattr(wrapper, "_backend", None)


def wrapper_float_workspace(wrapper: Any) -> torch.Tensor:
    """Return the float workspace a FlashInfer wrapper was built on (its private ``_float_workspace_buffer``)."""
    try:
        return wrapper._float_workspace_buffer  # type: ignore[no-any-return]
    except AttributeError:
        raise AttributeError(
            f"{type(wrapper).__name__} has no _float_workspace_buffer (read from {PRIVATE_NAMES_READ})"
        ) from None
