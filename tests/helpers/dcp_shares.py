"""Decode context parallelism on one device: each request's KV cache split into shares, decoded share by share.

A DCP rank holds a share of every request's cached tokens and runs MLA decode
over it with the queries of all heads, returning the LSE; the ranks' partial
outputs are then merged by their LSEs. Here the shares are contiguous page
ranges of one paged cache (share ``r`` of a request with ``P`` pages holds pages
``r * P // cp_world`` up to ``(r + 1) * P // cp_world``), so a request with
fewer pages than shares has empty shares, and the share holding its last page
may hold fewer tokens than a page.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.mla_inputs import MLAInputs
from wspool.flashinfer import mla_decode
from wspool.flashinfer.reference import merge_lse_partials
from wspool.units import ceil_div

__all__ = ["RAGGED_LENGTHS", "decode_by_shares", "split_into_shares"]

#: Requests of 1 to 65 pages of 64 tokens: at cp_world 2, 4 and 8 some request has empty shares and some
#: request a share of fewer tokens than a page, while the longest request gives every share tokens.
RAGGED_LENGTHS = [5, 64, 70, 1000, 4129, 130, 1, 2049]


def split_into_shares(inputs: MLAInputs, cp_world: int) -> list[MLAInputs]:
    """Split every request's pages into ``cp_world`` contiguous ranges: one decode input per share.

    The shares keep the query (all heads) and the KV cache tensor; each has
    its own page table, lengths (0 for an empty share) and ``max_seq_len``
    (at least 1, as the plan requires an upper bound that is positive).
    """
    page_size = inputs.kv_cache.shape[1]
    lengths = [int(n) for n in inputs.seq_lens.tolist()]
    tables = inputs.block_tables.cpu()
    device = inputs.block_tables.device
    shares = []
    for rank in range(cp_world):
        rows, share_lengths = [], []
        for b, length in enumerate(lengths):
            pages = ceil_div(length, page_size)
            start, end = rank * pages // cp_world, (rank + 1) * pages // cp_world
            rows.append(tables[b, start:end])
            share_lengths.append(max(0, min(end * page_size, length) - start * page_size))
        table = torch.zeros(len(lengths), max(1, max(len(r) for r in rows)), dtype=torch.int32)
        for b, row in enumerate(rows):
            table[b, : len(row)] = row
        shares.append(
            MLAInputs(
                query=inputs.query,
                kv_cache=inputs.kv_cache,
                block_tables=table.to(device),
                seq_lens=torch.tensor(share_lengths, dtype=torch.int32, device=device),
                max_seq_len=max(1, *share_lengths),
                sm_scale=inputs.sm_scale,
            )
        )
    return shares


def decode_by_shares(
    inputs: MLAInputs, cp_world: int, **decode_kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Decode each share as its DCP rank would (all heads, with the LSE), then merge by the LSEs.

    Returns:
        ``(out, lse, partials)``: the merged output and LSE, and each share's ``(out, lse)``.
    """
    partials = []
    for share in split_into_shares(inputs, cp_world):
        out, lse = mla_decode(
            share.query, share.kv_cache, share.block_tables, share.seq_lens, share.max_seq_len,
            sm_scale=share.sm_scale, return_lse=True, facts={"cp_world": cp_world}, **decode_kwargs,
        )  # fmt: skip
        partials.append((out, lse))
    out, lse = merge_lse_partials([o for o, _ in partials], [s for _, s in partials])
    return out, lse, partials
