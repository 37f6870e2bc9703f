"""The FlashInfer MLA wrappers: built on a pool's buffer, shared by the plans of successive steps.

A wrapper is built with its own buffers as normal tensors (never inference
tensors) and, for CUDA-graph plans, on the plan's graph buffers. Device
semantics: the workspace's device. Thread semantics: a race builds two
wrappers, one of which is cached; capture semantics: building a wrapper
allocates, so plans build theirs before capture.
"""

from __future__ import annotations

from typing import Any

import torch

from wspool.flashinfer import kernels
from wspool.pool import WorkspacePool

__all__ = ["make_wrapper", "shared_wrapper"]


def make_wrapper(
    workspace: torch.Tensor,
    backend: str,
    graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> Any:
    """Build a ``BatchMLAPagedAttentionWrapper`` on ``workspace`` (and ``graph_buffers`` for a graph plan)."""
    wrapper_cls = kernels.load_flashinfer_mla().BatchMLAPagedAttentionWrapper
    # The wrapper's own buffers must be normal tensors: it is shared across steps, and its plan()
    # writes them in place whether or not the caller is under torch.inference_mode.
    with torch.inference_mode(False):
        wrapper = wrapper_cls(
            **kernels.wrapper_init_kwargs(workspace=workspace, backend=backend, graph_buffers=graph_buffers)
        )
    wrapper._wspool_owner = None
    return wrapper


def shared_wrapper(pool: WorkspacePool, workspace: torch.Tensor, backend: str, lse: bool) -> Any:
    """One eager wrapper per (pool instance, buffer, backend, LSE mode), shared by the plans of successive steps.

    Each wrapper holds 16 MiB of FlashInfer's own buffers. It lives in the pool's
    ``buffer_cache``, which the pool empties when it replaces the buffer, so no
    cached wrapper outlives the buffer it was built on.
    """
    key = ("mla", backend, lse)
    wrapper = pool.buffer_cache.get(key)
    if wrapper is None:
        wrapper = make_wrapper(workspace, backend)
        if pool.buffer is workspace:  # not replaced meanwhile by another thread
            pool.buffer_cache[key] = wrapper
    return wrapper
