"""MLA decode's Blackwell call: FlashInfer's trtllm-gen or cute-dsl kernel on a pool's buffer.

The kernel takes the plan's dense page table as it is (no CSR conversion) and
the workspace per call; a refusal of that workspace grows the pool and the call
retries (:mod:`~wspool.flashinfer.recovery`). Device semantics: the plan's
device. Thread semantics: one stream per plan and lane at a time. Capture
semantics: recovery grows the pool, which raises while frozen or capturing.
"""

from __future__ import annotations

from typing import Any

import torch

from wspool.flashinfer import kernels
from wspool.flashinfer.mla_setup import MLAPlanArgs
from wspool.flashinfer.recovery import MAX_RECOVERIES, grow_after_overflow
from wspool.pool import WorkspacePool

__all__ = ["run_trtllm"]


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
