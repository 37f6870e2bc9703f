"""Measure what an engine's CUDA-graph MLA plans hold on the device: the pool and FlashInfer's own buffers.

An engine captures one decode graph per batch size. This captures 20 MLA
decode plans (batch sizes 1..256, 128 heads, the LSE returned, one plan and
one graph per batch size, on one registry) and reports the device memory
before and after, split into what the pool holds, what FlashInfer's wrappers
hold themselves (:mod:`wspool.memory`), and the rest (index buffers,
outputs, the graphs' memory). Run it on a GPU, once per profile::

    python -m wspool.tools.graph_plans                  # profile auto (hopper on an H200)
    python -m wspool.tools.graph_plans --profile fixed  # vLLM's fixed 128/256 MiB

Device semantics: the current CUDA device. It allocates about 1 GiB of
inputs besides what it measures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from wspool.memory import kernel_buffer_stats
from wspool.registry import PoolRegistry
from wspool.settings.schema import load_settings
from wspool.units import ceil_div, format_size

__all__ = ["BATCH_SIZES", "main", "measure_graph_plans"]

#: The captured batch sizes: 20 of them, as an engine's capture list runs from 1 to 256.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 256)
_PAGE, _DIM, _LATENT = 64, 576, 512


def _used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def measure_graph_plans(
    registry: PoolRegistry, *, batch_sizes: Sequence[int] = BATCH_SIZES, heads: int = 128, seq_len: int = 1024
) -> dict[str, Any]:
    """Plan and capture one LSE decode graph per batch size; return the memory figures (bytes).

    Returns:
        ``device_used_delta`` (from ``cudaMemGetInfo``), ``torch_allocated_delta``,
        ``pool_bytes`` (the flashinfer_mla buffer), ``kernel_device_bytes`` and
        ``kernel_pinned_host_bytes`` (the wrappers' own), ``profile``, ``plans``.
    """
    from wspool.flashinfer.mla import mla_decode_plan

    device = torch.device("cuda", torch.cuda.current_device())
    largest = max(batch_sizes)
    pages = largest * ceil_div(seq_len, _PAGE)
    generator = torch.Generator(device=device).manual_seed(0)
    kv_cache = torch.randn(pages, _PAGE, _DIM, generator=generator, device=device).to(torch.bfloat16)
    tables = torch.arange(pages, dtype=torch.int32, device=device).view(largest, -1)
    query = torch.randn(largest, 1, heads, _DIM, generator=generator, device=device).to(torch.bfloat16)
    torch.cuda.synchronize(device)
    used, allocated = _used(device), torch.cuda.memory_allocated(device)
    keep: list[Any] = []
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    for batch in batch_sizes:
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        block_tables = tables[:batch].contiguous()
        plan = mla_decode_plan(
            block_tables, lens, seq_len, num_heads=heads, sm_scale=1 / 192**0.5, page_size=_PAGE, return_lse=True,
            registry=registry, use_cuda_graph=True,
        )  # fmt: skip
        out = torch.empty(batch, 1, heads, _LATENT, dtype=torch.bfloat16, device=device)
        lse = torch.empty(batch, 1, heads, dtype=torch.float32, device=device)
        q = query[:batch]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            plan.run(q, kv_cache, out=out, lse=lse)  # warm-up off the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with registry.frozen(), torch.cuda.graph(graph):
            plan.run(q, kv_cache, out=out, lse=lse)
        keep.append((plan, graph, out, lse, lens, block_tables))
    torch.cuda.synchronize(device)
    kernel = [k for k in kernel_buffer_stats(registry) if k.device == str(device)]
    return {
        "device": torch.cuda.get_device_name(device),
        "profile": registry.profile_of(device).profile,
        "plans": len(keep),
        "heads": heads,
        "device_used_delta": _used(device) - used,
        "torch_allocated_delta": torch.cuda.memory_allocated(device) - allocated,
        "pool_bytes": registry.stats("flashinfer_mla", device).capacity_bytes,
        "kernel_device_bytes": sum(k.device_bytes for k in kernel),
        "kernel_pinned_host_bytes": sum(k.pinned_host_bytes for k in kernel),
        "wrappers": sum(k.wrappers for k in kernel),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement and print it (``--json``: as JSON)."""
    parser = argparse.ArgumentParser(prog="python -m wspool.tools.graph_plans", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="profile for every device (default: the configured one)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m wspool.tools.graph_plans: error: needs a CUDA device", file=sys.stderr)
        return 2
    overrides = {} if args.profile is None else {"profile": args.profile}
    figures = measure_graph_plans(PoolRegistry(load_settings(**overrides)))
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"{figures['plans']} CUDA-graph MLA plans (batch {BATCH_SIZES[0]}..{BATCH_SIZES[-1]}, {figures['heads']} "
          f"heads, LSE) on {figures['device']}, profile {figures['profile']}:")  # fmt: skip
    for key in ("device_used_delta", "torch_allocated_delta", "pool_bytes", "kernel_device_bytes",
                "kernel_pinned_host_bytes"):  # fmt: skip
        print(f"  {key:<26} {figures[key]:>12} bytes ({format_size(figures[key])})")
    print(f"  wrappers alive             {figures['wrappers']:>12}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
