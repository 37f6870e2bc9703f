"""Random MLA decode inputs (a paged KV cache with shuffled pages and ragged lengths), decoded and referenced."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wspool.flashinfer import mla_decode, mla_decode_reference
from wspool.units import ceil_div


@dataclass
class MLAInputs:
    """One decode step's tensors."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    sm_scale: float


def make_inputs(
    batch: int,
    heads: int,
    lengths: list[int],
    *,
    page_size: int = 64,
    q_len: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> MLAInputs:
    """Build inputs whose pages are scattered over the cache, as in a real engine."""
    assert len(lengths) == batch
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [ceil_div(n, page_size) for n in lengths]
    width = max(pages_per_seq)
    total = sum(pages_per_seq) + 7  # spare pages that no request owns
    order = torch.randperm(total, generator=generator)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        tables[b, :count] = order[used : used + count]
        used += count
    kv = torch.randn(total, page_size, 576, generator=generator).to(dtype)
    query = torch.randn(batch, q_len, heads, 576, generator=generator).to(dtype)
    return MLAInputs(
        query=query.to(device),
        kv_cache=kv.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32).to(device),
        max_seq_len=max(lengths),
        sm_scale=1.0 / (192**0.5),  # DeepSeek: 1/sqrt(qk_nope + qk_rope) = 1/sqrt(128 + 64)
    )


def mla_reference(inputs: MLAInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the fp32 reference's ``(out, lse)`` for one step's inputs."""
    return mla_decode_reference(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )


def run_mla_decode(inputs: MLAInputs, **kwargs: object) -> object:
    """Return ``mla_decode`` of one step's inputs, with any other keyword arguments it takes."""
    return mla_decode(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
        sm_scale=inputs.sm_scale, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
