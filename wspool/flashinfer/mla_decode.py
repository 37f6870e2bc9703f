"""``mla_decode``: MLA decode for one layer, reusing the previous call's plan while the metadata is unchanged.

The last plan per pool, lane, backend and LSE mode lives in the registry's
:class:`MLAPlanCache` (thread-safe; :meth:`~wspool.PoolRegistry.reset` forgets
it), on the metadata's device. These plans are eager; for capture use
``mla_decode_plan(..., use_cuda_graph=True)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from wspool.devices import current_lane
from wspool.flashinfer.mla import MLA_POOL, MLADecodePlan, mla_decode_plan
from wspool.registry import PoolRegistry, get_registry

__all__ = ["MLAPlanCache", "mla_decode"]


logger = logging.getLogger(__name__)


class MLAPlanCache(dict[tuple[Any, ...], MLADecodePlan]):
    """The last plan per (pool, lane, backend, LSE mode) of one registry: one plan per step."""

    @classmethod
    def of(cls, registry: PoolRegistry) -> MLAPlanCache:
        """Return ``registry``'s cache, creating it on first use (thread-safe)."""
        return registry.state(MLAPlanCache)

    def reusable(
        self,
        key: tuple[Any, ...],
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        sm_scale: float,
        facts: Mapping[str, int] | None,
    ) -> tuple[MLADecodePlan, bool] | None:
        """Return the plan under ``key`` and whether the query is 4-D, if that plan serves this call.

        Metadata edited in place is planned again here; resized metadata needs a new plan (``None``).
        """
        plan = self.get(key)
        if plan is None:
            return None
        step = plan.step
        if (
            step.block_tables is not block_tables
            or step.seq_lens is not seq_lens
            or (facts is not None and any(plan.facts.get(k) != v for k, v in facts.items()))
        ):
            return None
        signature = (query.shape, query.dtype, kv_cache.dtype, max_seq_len, sm_scale)
        four_d = signature == plan.call_signature
        if not four_d and signature != plan.packed_signature:
            return None
        # Each operation here runs once per layer call: the counters are read once.
        versions = plan.metadata_versions  # None for inference tensors, which count no writes
        now = None if versions is None else (block_tables._version, seq_lens._version)
        if now is None or now != versions:
            if plan.metadata_resized():
                return None
            if now is None:
                _warn_unversioned_metadata()
            plan.replan_for(now)
        return plan, four_d


def mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    sm_scale: float,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    registry: PoolRegistry | None = None,
    pool: str = MLA_POOL,
    backend: str = "auto",
    lane: str | None = None,
    facts: Mapping[str, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run MLA decode for one layer on ``pool``; return ``out``, or ``(out, lse)`` with ``return_lse``.

    The previous call's plan is reused while ``block_tables`` and ``seq_lens`` are
    the same tensors with unchanged version counters and the shapes and options
    match; a kernel writing them behind torch's back needs :func:`mla_decode_plan`.
    Inference tensors keep no counters, so every call plans again (warned once).
    ``query`` is ``[batch, q_len, heads, 576]`` or the packed ``[batch * q_len,
    heads, 576]``, and results come back in its form; the rest is as for
    :func:`mla_decode_plan`.
    """
    registry = registry if registry is not None else get_registry()
    plans = MLAPlanCache.of(registry)
    lane = lane if lane is not None else current_lane()  # a plan holds its lane's buffer
    key = (pool, lane, backend, return_lse)
    reused = plans.reusable(key, query, kv_cache, block_tables, seq_lens, max_seq_len, sm_scale, facts)
    if reused is not None:
        plan, four_d = reused
        return plan.run_matched(query, kv_cache, out, lse) if four_d else plan.run(query, kv_cache, out=out, lse=lse)
    plan = plans[key] = mla_decode_plan(
        block_tables,
        seq_lens,
        max_seq_len,
        num_heads=_query_heads(query),
        sm_scale=sm_scale,
        page_size=kv_cache.shape[1],
        q_len=_query_len(query, seq_lens),
        q_dtype=query.dtype,
        kv_dtype=kv_cache.dtype,
        return_lse=return_lse,
        registry=registry,
        pool=pool,
        backend=backend,
        lane=lane,
        facts=facts,
    )
    return plan.run(query, kv_cache, out=out, lse=lse)


_warned_unversioned = False


def _warn_unversioned_metadata() -> None:
    """Say once per process why mla_decode plans on every call with inference-tensor metadata."""
    global _warned_unversioned
    if not _warned_unversioned:
        _warned_unversioned = True
        logger.warning(
            "wspool: mla_decode got block_tables/seq_lens made under torch.inference_mode; torch counts no "
            "in-place writes to such tensors, so every call plans again (about a millisecond of host time "
            "each). Plan once per step with mla_decode_plan(...) and call plan.run() per layer, or allocate "
            "the metadata outside inference mode"
        )


def _query_heads(query: torch.Tensor) -> int:
    """The heads of a 4-D or packed query."""
    if not isinstance(query, torch.Tensor) or query.dim() not in (3, 4):
        shown = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be [batch, q_len, heads, dim] or packed [batch * q_len, heads, dim], got {shown}")
    return int(query.shape[-2])


def _query_len(query: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """Query tokens per request: the 4-D query's second dimension, or packed tokens over the batch."""
    if query.dim() == 4:
        return int(query.shape[1])
    tokens = int(query.shape[0])
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1:
        return 1  # the plan rejects seq_lens with its own message
    batch = seq_lens.shape[0]
    if batch == 0 or tokens % batch or tokens == 0:
        raise ValueError(
            f"packed query has {tokens} tokens for a batch of {batch} (seq_lens): "
            f"it must hold the same number of query tokens, at least one, for every request"
        )
    return tokens // batch
