"""Making an MLA decode plan: its argument checks, the size of its workspace and its counters.

The cold part of :class:`~wspool.flashinfer.mla.MLADecodePlan`: everything
here runs once, when a plan is made, before any kernel runs. Device
semantics: the page table's device. Thread semantics: the pools' own (their
growth is locked); the rule-below-need warning is logged outside any lock.
Capture semantics: growing allocates, so plans are made before capture.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from wspool.devices import resolve_device
from wspool.flashinfer import kernels, mla_paths
from wspool.flashinfer.blackwell import check_dcp
from wspool.pool import WorkspacePool
from wspool.registry import PoolRegistry

__all__ = [
    "COUNTER_POOL",
    "COUNTER_RULE",
    "MLAPlanArgs",
    "check_plan_args",
    "counter_pool",
    "size_workspace",
    "write_counts",
]

logger = logging.getLogger("wspool")

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
        self.path = mla_paths.select_path(
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
            **mla_paths.call_facts(
                batch_size=batch_size, q_len=q_len, num_heads=num_heads, max_seq_len=max_seq_len,
                page_size=page_size, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                dtype_bytes=q_dtype.itemsize, sm_count=mla_paths.sm_count(device),
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
    mla_paths.check_int_tensor("block_tables", block_tables, 2, device)
    mla_paths.check_int_tensor("seq_lens", seq_lens, 1, device)
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
