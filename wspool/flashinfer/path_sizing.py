"""The float workspace each MLA decode kernel path needs, known before FlashInfer is called.

The workspace never picks the kernel: an op first resolves its path
(:func:`wspool.flashinfer.select_path`), then sizes the buffer for that path.
The pool's rule is the user's choice and is kept; where it resolves below
what the path is known to need, the op requests the need instead (and warns
once, naming the setting), so the first call does not fail and FlashInfer
is never left to choose another backend because the buffer is small. The
refusal parser (:mod:`wspool.flashinfer.refusals`) stays the safety net for
what is not known up front.

What each path is known to need:

- ``fa3`` / ``fa2`` (the planned wrapper, Hopper / Ampere): fixed by the SM
  count, :func:`~wspool.flashinfer.fa_layout.fa_mla_float_workspace_bytes`
  (``64 * sm_count * (4 * kv_lora_rank + 8)`` on even SM counts; FlashInfer
  0.7.4's own preflight computes the same bytes);
- ``cute-dsl`` (Blackwell): FlashInfer's own size function
  (:func:`~wspool.flashinfer.blackwell.cute_dsl_workspace_bytes`);
- ``trtllm-gen`` (Blackwell): the launcher's softmax slab when the LSE is
  returned, plus :data:`TRTLLM_SCRATCH_BYTES` for the scratch behind it, which
  the launcher does not bounds-check (``configs/blackwell.yaml``'s margin);
- ``reference``: nothing.

Plain arithmetic (and, for cute-dsl, FlashInfer's pure-Python function): no
CUDA, thread-safe.
"""

from __future__ import annotations

from wspool.flashinfer.blackwell import cute_dsl_workspace_bytes
from wspool.flashinfer.fa_layout import fa_mla_float_workspace_bytes
from wspool.flashinfer.trtllm_layout import softmax_slab_bytes

__all__ = ["TRTLLM_SCRATCH_BYTES", "path_need_bytes"]

#: The scratch kept behind trtllm-gen's softmax slab (unchecked by FlashInfer; about 20-32 MB on a B200).
TRTLLM_SCRATCH_BYTES = 64 << 20


def path_need_bytes(
    path: str,
    *,
    sm_count: int,
    batch_size: int,
    q_len: int,
    num_heads: int,
    kv_lora_rank: int,
    max_seq_len: int,
    return_lse: bool,
    enable_dcp: bool = False,
) -> int:
    """Return the float workspace bytes ``path`` is known to need for one plan's facts.

    Args:
        path: A concrete path: ``"fa3"``, ``"fa2"``, ``"trtllm-gen"``, ``"cute-dsl"`` or ``"reference"``.
        sm_count: The device's streaming multiprocessors.
        batch_size, q_len, num_heads, kv_lora_rank, max_seq_len: The plan's shape.
        return_lse: Whether the LSE is returned.
        enable_dcp: Whether the call runs decode-context parallel (cute-dsl).

    Raises:
        ValueError: ``path`` is not a concrete path.
    """
    if path in ("fa3", "fa2"):
        return fa_mla_float_workspace_bytes(
            sm_count=sm_count, num_heads=num_heads, q_len=q_len, kv_lora_rank=kv_lora_rank
        )
    if path == "trtllm-gen":
        slab = softmax_slab_bytes(num_heads, batch_size, q_len) if return_lse else 0
        return slab + TRTLLM_SCRATCH_BYTES
    if path == "cute-dsl":
        return cute_dsl_workspace_bytes(
            batch_size=batch_size, q_len=q_len, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
            sm_count=sm_count, max_seq_len=max_seq_len, enable_dcp=enable_dcp,
        )  # fmt: skip
    if path == "reference":
        return 0
    raise ValueError(f"no known workspace need for MLA decode path {path!r}; resolve 'auto' first")
