"""FlashInfer's planned MLA wrapper called directly: the baseline wspool is measured against.

The calls carry the exact arguments wspool's op passes, on a preallocated
buffer. Both classes need a CUDA device; nothing here runs at import.
"""

from __future__ import annotations

from typing import Any

import torch

from wspool.flashinfer import kernels
from wspool.flashinfer.backends import KV_LORA_RANK, QK_ROPE_HEAD_DIM
from wspool.flashinfer.layouts import CSRConstants, csr_parts
from wspool.units import MiB, ceil_div

__all__ = ["PAGE_SIZE", "SM_SCALE", "DecodeInputs", "DirectMLA"]

_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
#: DeepSeek's softmax scale, 1/sqrt(qk_nope + qk_rope).
SM_SCALE = 1.0 / (128 + QK_ROPE_HEAD_DIM) ** 0.5
PAGE_SIZE = 64
#: Distinct per-layer KV caches cycle until they span this many bytes, so layers do not hit in L2.
_DISTINCT_KV_BYTES = 512 * MiB


class DecodeInputs:
    """One batch's page table and lengths, and ``distinct`` per-layer queries and KV caches."""

    def __init__(self, batch: int, heads: int, length: int, device: torch.device, layers: int, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        pages = ceil_div(length, PAGE_SIZE)
        per_layer = batch * pages * PAGE_SIZE * _DIM * 2
        self.distinct = min(layers, max(2, ceil_div(_DISTINCT_KV_BYTES, per_layer)))
        order = torch.randperm(batch * pages, generator=gen, device=device).to(torch.int32)
        self.block_tables = order.view(batch, pages)
        self.seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        self.max_seq_len = length
        self.kv = [self._randn(gen, (batch * pages, PAGE_SIZE, _DIM), device) for _ in range(self.distinct)]
        self.queries = [self._randn(gen, (batch, 1, heads, _DIM), device) for _ in range(self.distinct)]
        self.flat_queries = [q.view(batch, heads, _DIM) for q in self.queries]

    @staticmethod
    def _randn(gen: torch.Generator, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)


class DirectMLA:
    """FlashInfer's planned wrapper called directly, doing the op's device work per step, so a comparison is fair."""

    def __init__(self, workspace: torch.Tensor, backend: str, heads: int, return_lse: bool):
        self.fi = kernels.load_flashinfer_mla()
        self.wrapper = self.fi.BatchMLAPagedAttentionWrapper(
            **kernels.wrapper_init_kwargs(workspace=workspace, backend=backend)
        )
        self.heads = heads
        self.return_lse = return_lse
        self._constants: dict[tuple[int, int], tuple[torch.Tensor, CSRConstants]] = {}

    def plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Convert the page table to CSR on the device (as the op does), then plan."""
        batch, max_pages = block_tables.shape
        constants = self._constants.get((batch, max_pages))
        if constants is None:
            constants = self._constants[batch, max_pages] = (
                torch.arange(0, batch + 1, dtype=torch.int32, device=block_tables.device),
                CSRConstants.for_table(block_tables),
            )
        qo_indptr, table_constants = constants
        kv_indptr, kv_indices, lengths, _ = csr_parts(block_tables, seq_lens, PAGE_SIZE, table_constants)
        self.wrapper.plan(
            **kernels.wrapper_plan_kwargs(
                metadata=self.fi.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, lengths),
                num_heads=self.heads,
                kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=QK_ROPE_HEAD_DIM,
                page_size=PAGE_SIZE,
                causal=False,
                sm_scale=SM_SCALE,
                q_dtype=torch.bfloat16,
                kv_dtype=torch.bfloat16,
                return_lse=self.return_lse,
            )
        )

    def run(self, flat_query: torch.Tensor, kv: torch.Tensor) -> Any:
        """One layer's ``run()`` with the arguments the op passes."""
        return self.wrapper.run(
            **kernels.wrapper_run_kwargs(query=flat_query, kv_cache=kv, out=None, lse=None, return_lse=self.return_lse)
        )

    def run_4d(self, query: torch.Tensor, kv: torch.Tensor) -> Any:
        """:meth:`run` for a backend that holds ``[batch, q_len, heads, 576]`` queries and wants its
        results in that form: FlashInfer takes and returns the packed form, so the backend reshapes
        the query and the results, as the op does for a 4-D query."""
        batch, q_len, heads, dim = query.shape
        result = self.run(query.view(batch * q_len, heads, dim), kv)
        if self.return_lse:
            out, lse = result
            return out.view(batch, q_len, heads, -1), lse.view(batch, q_len, heads)
        return result.view(batch, q_len, heads, -1)
