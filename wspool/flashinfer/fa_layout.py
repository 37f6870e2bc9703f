"""How FlashInfer's planned MLA wrapper (fa2/fa3: Hopper, Ampere) carves its float workspace.

Read from FlashInfer 0.7.2's ``MLAPlan`` (``include/flashinfer/attention/scheduler.cuh``),
which both the fa3 (SM90) and fa2 plans call. The plan splits the device
into ``num_clusters`` clusters of ``cluster_size`` CTAs (2 when a request
packs more than 64 query rows, ``q_len * num_heads > 64``, else 1), each
CTA a tile of 64 query rows, and carves, at ``plan()`` time, with the
bounds-checked ``AlignedAllocator``::

    mla_partial_o   = 2 * num_clusters * cluster_tile_q * 2 * head_dim_o   (alignment 16)
    mla_partial_lse = 2 * num_clusters * cluster_tile_q * 4                (alignment 16)

with ``cluster_tile_q = 64 * cluster_size``, ``num_clusters = sm_count //
cluster_size`` and ``head_dim_o = kv_lora_rank``. Batch size, sequence
lengths and whether the LSE is returned do not enter: the need is fixed by
the SM count. ``num_clusters * cluster_tile_q`` is ``64 * sm_count`` for an
even SM count (every Hopper part) and at most that for an odd one, so
:data:`FA_MLA_WORKSPACE_RULE` is exact on Hopper and never below the need
elsewhere. On an H200 (132 SMs) it is 17,369,088 bytes; the first carve alone
is the 17,301,504 bytes of the overflow message an 8 MiB workspace gives.

FlashInfer 0.7.4 checks the same bytes in Python before its C++ plan
(``fa3 MLA needs <N> float workspace bytes for partial outputs and LSE.``,
plus any misalignment of the buffer's start, which pool buffers never have).
Either refusal comes from ``plan()``, before any kernel runs, so an undersized
buffer is caught (see :mod:`wspool.flashinfer.refusals`) rather than
corrupting memory; :mod:`wspool.flashinfer.path_sizing` sizes the buffer by
this rule before ``plan()`` is called.
"""

from __future__ import annotations

__all__ = ["FA_MLA_WORKSPACE_RULE", "fa_mla_float_workspace_bytes"]

#: The float workspace of FlashInfer's fa2/fa3 MLA plan, as a wspool rule over the call's facts.
FA_MLA_WORKSPACE_RULE = "64 * sm_count * (4 * kv_lora_rank + 8)"


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def fa_mla_float_workspace_bytes(*, sm_count: int, num_heads: int, q_len: int, kv_lora_rank: int = 512) -> int:
    """Return the bytes FlashInfer's fa2/fa3 MLA ``plan()`` carves from a 16-byte aligned workspace.

    Args:
        sm_count: The device's streaming multiprocessors.
        num_heads: Query heads.
        q_len: Query tokens per request (all requests alike).
        kv_lora_rank: The latent width, FlashInfer's ``head_dim_ckv`` (the output's head dim).
    """
    cluster_size = 2 if q_len * num_heads > 64 else 1
    rows = (sm_count // cluster_size) * 64 * cluster_size
    partial_o = 2 * rows * 2 * kv_lora_rank
    partial_lse = 2 * rows * 4
    return _align(partial_o, 16) + partial_lse
