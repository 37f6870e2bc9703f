"""Merge partial attention outputs over disjoint KV shares by their natural-log LSEs.

Under decode context parallelism each rank attends over its share of the KV
cache and returns its output and LSE; :func:`merge_lse_partials` combines them
(softmax over the shares' LSEs, in the natural log wspool's MLA decode returns).
A share whose LSE is ``-inf`` weighs nothing, a row every share left empty
merges to 0 and ``-inf``, and a NaN or ``+inf`` LSE makes its row NaN. Runs on
the partials' device in fp32 with PyTorch's allocator, stateless, with no host
synchronisation, so it can be captured in a CUDA graph. Use with DCP: docs/multi-gpu.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["merge_lse_partials"]


def merge_lse_partials(
    outs: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the partial outputs of attention over disjoint KV shares into the whole's.

    With ``m = max_i lse_i``: ``out = sum_i exp(lse_i - m) * out_i / sum_i exp(lse_i - m)``
    and ``lse = m + log(sum_i exp(lse_i - m))``.

    Args:
        outs: One output per share, each ``[*rows, dim]`` (e.g. ``[batch, q_len,
            heads, kv_lora_rank]`` or packed ``[tokens, heads, kv_lora_rank]``),
            all of one shape, dtype and device; or the same stacked as one
            ``[shares, *rows, dim]`` tensor (what an all-gather gives).
        lses: The shares' natural-log LSEs, each ``[*rows]`` (or stacked
            ``[shares, *rows]``): finite, or ``-inf`` for a row the share has no keys for
            (NaN or ``+inf`` make the row's output and LSE NaN).

    Returns:
        ``(out, lse)``: ``out [*rows, dim]`` in the partials' dtype and
        ``lse [*rows]`` in fp32, natural log.

    Raises:
        ValueError: No shares, different numbers of outputs and LSEs, or
            shapes, dtypes or devices that do not match.
    """
    out_stack, lse_stack = _stacked(outs, "outs"), _stacked(lses, "lses")
    if out_stack.shape[0] != lse_stack.shape[0]:
        raise ValueError(f"merge_lse_partials got {out_stack.shape[0]} outputs but {lse_stack.shape[0]} LSEs")
    if out_stack.dim() < 2 or lse_stack.shape != out_stack.shape[:-1]:
        raise ValueError(
            f"each share's LSE must have its output's shape without the last dimension: outputs "
            f"{tuple(out_stack.shape[1:])}, LSEs {tuple(lse_stack.shape[1:])}"
        )
    if out_stack.device != lse_stack.device:
        raise ValueError(f"the outputs are on {out_stack.device} but the LSEs on {lse_stack.device}")
    for name, tensor in (("outs", out_stack), ("lses", lse_stack)):
        if not tensor.is_floating_point():
            raise ValueError(f"merge_lse_partials: {name} must be floating point, got {tensor.dtype}")
    lse_stack = lse_stack.float()
    # A NaN or +inf LSE is no log-sum-exp: its row has no merge, and must not read as one (a row of zeros).
    invalid = (torch.isnan(lse_stack) | torch.isposinf(lse_stack)).any(dim=0)
    lse_max = lse_stack.amax(dim=0)
    # A row that every share left empty has lse_max = -inf: shift it by 0, since -inf - -inf is NaN.
    shift = torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lse_stack - shift)  # in [0, 1]; 0 exactly for empty shares
    total = weights.sum(dim=0)
    lse = shift + torch.log(total)  # log(0) = -inf for rows that every share left empty
    scale = torch.where(total > 0, weights / total, torch.zeros_like(weights)).unsqueeze(-1)
    # An empty share's output may hold anything (NaN included): select, do not multiply by 0.
    partials = torch.where(scale > 0, out_stack.float(), torch.zeros((), device=out_stack.device))
    out = (partials * scale).sum(dim=0)
    nan = torch.full((), float("nan"), device=out.device)
    out = torch.where(invalid.unsqueeze(-1), nan, out).to(out_stack.dtype)
    return out, torch.where(invalid, nan, lse)


def _stacked(tensors: Sequence[torch.Tensor] | torch.Tensor, name: str) -> torch.Tensor:
    """One ``[shares, ...]`` tensor from a stacked tensor or a sequence of equal tensors."""
    if isinstance(tensors, torch.Tensor):
        if tensors.dim() == 0 or tensors.shape[0] == 0:
            raise ValueError(
                f"merge_lse_partials: stacked {name} must be [shares, ...] with a share, got {tuple(tensors.shape)}"
            )
        return tensors
    shares = list(tensors)
    if not shares:
        raise ValueError(f"merge_lse_partials needs at least one share, got no {name}")
    first = shares[0]
    for i, tensor in enumerate(shares):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"merge_lse_partials: {name}[{i}] is a {type(tensor).__name__}, not a tensor")
        if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError(
                f"merge_lse_partials: {name}[{i}] is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                f"but {name}[0] is {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    return torch.stack(shares)
