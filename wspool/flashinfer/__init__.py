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
    select_path,
)
from wspool.flashinfer.overflow import WorkspaceOverflow, parse_overflow
from wspool.flashinfer.reference import mla_decode_reference

__all__ = [
    "COUNTER_POOL",
    "MLA_POOL",
    "MLADecodePlan",
    "WorkspaceOverflow",
    "mla_decode",
    "mla_decode_plan",
    "mla_decode_reference",
    "parse_overflow",
    "select_path",
]
