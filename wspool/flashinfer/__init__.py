"""Kernels that take a workspace, with their workspace from a wspool pool.

Importing this package does not import FlashInfer; the kernels are loaded on
the first call that needs one. The public API is ``__all__``; ``mla_decode_plan``
returns an :class:`MLADecodePlan` (the same class); the fp32 references, the
refusal parser and path selection stay importable here, outside ``__all__``.
"""

from wspool.flashinfer.backends import select_path as select_path
from wspool.flashinfer.mla import (
    COUNTER_POOL,
    MLA_POOL,
    mla_decode_plan,
)
from wspool.flashinfer.mla import (
    MLADecodePlan as MLADecodePlan,
)
from wspool.flashinfer.mla_cache import mla_decode
from wspool.flashinfer.paged import PAGED_POOL, PagedAttentionPlan, paged_decode_plan, paged_prefill_plan
from wspool.flashinfer.reference import mla_decode_reference as mla_decode_reference
from wspool.flashinfer.reference import paged_attention_reference as paged_attention_reference
from wspool.flashinfer.refusals import WorkspaceRefusal as WorkspaceRefusal
from wspool.flashinfer.refusals import parse_refusal as parse_refusal

__all__ = [
    "COUNTER_POOL",
    "MLA_POOL",
    "PAGED_POOL",
    "PagedAttentionPlan",
    "mla_decode",
    "mla_decode_plan",
    "paged_decode_plan",
    "paged_prefill_plan",
]
