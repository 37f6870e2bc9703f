"""Kernels that take a workspace, with their workspace from a wspool pool.

Importing this package does not import FlashInfer; the kernels are loaded on
the first call that needs one. ``mla_decode_plan`` returns an
:class:`MLADecodePlan`; the fp32 references, the LSE merge, the refusal
parser and path selection are importable here too.
"""

from wspool.flashinfer.backends import select_path
from wspool.flashinfer.mla import COUNTER_POOL, MLA_POOL, MLADecodePlan, mla_decode_plan
from wspool.flashinfer.mla_decode import mla_decode
from wspool.flashinfer.paged import PAGED_POOL, PagedAttentionPlan, paged_decode_plan, paged_prefill_plan
from wspool.flashinfer.reference import merge_lse_partials, mla_decode_reference, paged_attention_reference
from wspool.flashinfer.refusals import WorkspaceRefusal, parse_refusal
from wspool.flashinfer.wrapper_buffers import INT_POOL, bind_mla_wrapper, bind_paged_wrapper, supplying

__all__ = [
    "COUNTER_POOL",
    "INT_POOL",
    "MLA_POOL",
    "PAGED_POOL",
    "MLADecodePlan",
    "PagedAttentionPlan",
    "WorkspaceRefusal",
    "bind_mla_wrapper",
    "bind_paged_wrapper",
    "merge_lse_partials",
    "mla_decode",
    "mla_decode_plan",
    "mla_decode_reference",
    "paged_attention_reference",
    "paged_decode_plan",
    "paged_prefill_plan",
    "parse_refusal",
    "select_path",
    "supplying",
]
