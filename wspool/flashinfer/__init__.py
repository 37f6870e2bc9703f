"""Kernels that take a workspace, with their workspace from a wspool pool.

Importing this package does not import FlashInfer; the kernels are loaded on
the first call that needs one.
"""

from wspool.flashinfer.mla import (
    COUNTER_POOL,
    MLA_POOL,
    MLADecodePlan,
    mla_decode,
    mla_decode_plan,
)
from wspool.flashinfer.mla_paths import select_path
from wspool.flashinfer.paged import PAGED_POOL, PagedAttentionPlan, paged_decode_plan, paged_prefill_plan
from wspool.flashinfer.paged_reference import paged_attention_reference
from wspool.flashinfer.reference import mla_decode_reference
from wspool.flashinfer.refusals import WorkspaceRefusal, parse_refusal

__all__ = [
    "COUNTER_POOL",
    "MLA_POOL",
    "PAGED_POOL",
    "MLADecodePlan",
    "PagedAttentionPlan",
    "WorkspaceRefusal",
    "mla_decode",
    "mla_decode_plan",
    "mla_decode_reference",
    "paged_attention_reference",
    "paged_decode_plan",
    "paged_prefill_plan",
    "parse_refusal",
    "select_path",
]
