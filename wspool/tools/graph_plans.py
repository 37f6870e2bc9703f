"""Measure what an engine's CUDA-graph decode plans hold: the pool, FlashInfer's buffers, pinned memory.

It captures 20 decode plans (batch sizes 1..256) of kind ``mla`` (wspool's MLA
plans, 128 heads, LSE) or ``paged`` (FlashInfer's graph-mode paged decode
wrapper, 64/8 heads) and reports the memory before and after. Runs on the
current CUDA device, with about 1 GiB of inputs besides what it measures.
Usage and figures: docs/profiles.md, docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from wspool.flashinfer import wrapper_buffers
from wspool.memory import kernel_buffer_stats, track_kernel_buffers
from wspool.registry import PoolRegistry
from wspool.settings.schema import load_settings
from wspool.units import ceil_div, format_size

__all__ = ["BATCH_SIZES", "INT_WORKSPACES", "KINDS", "main", "measure_graph_plans"]

#: The captured batch sizes: 20 of them, as an engine's capture list runs from 1 to 256.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 256)
_PAGE, _DIM, _LATENT = 64, 576, 512
#: What the measurement builds, and whose int workspaces the wrappers use.
KINDS = ("mla", "paged")
INT_WORKSPACES = ("pooled", "shared", "flashinfer")
_GQA = {"num_qo_heads": 64, "num_kv_heads": 8, "head_dim": 128, "page_size": 16}


def _used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def _pinned_host_reserved() -> int | None:
    """PyTorch's pinned host allocator's reserved bytes, where this torch reports them."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    figures = stats()
    for key in ("reserved_bytes.current", "host_alloc_bytes.current", "segment.current"):
        if key in figures:
            return int(figures[key])
    return None


def measure_graph_plans(
    registry: PoolRegistry,
    *,
    kind: str = "mla",
    int_workspace: str = "pooled",
    batch_sizes: Sequence[int] = BATCH_SIZES,
    heads: int = 128,
    seq_len: int = 1024,
) -> dict[str, Any]:
    """Plan and capture one decode graph per batch size; return the memory figures in bytes.

    ``int_workspace`` is ``"pooled"`` (a region per wrapper), ``"shared"`` (MLA: one
    ``int_group`` region) or ``"flashinfer"``. ``beyond_caller_bytes`` is PyTorch's
    allocated delta less the inputs the measurement allocates per plan.
    """
    if kind not in KINDS or int_workspace not in INT_WORKSPACES:
        raise ValueError(f"kind must be one of {KINDS} and int_workspace one of {INT_WORKSPACES}")
    if int_workspace == "flashinfer":
        wrapper_buffers.keep_flashinfer_buffers(registry)
    device = torch.device("cuda", torch.cuda.current_device())
    baseline: list[int | None] = []

    def ready() -> None:
        """Mark the memory in use once the inputs exist (cached blocks released first): what follows is the plans'."""
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        baseline.extend((_used(device), torch.cuda.memory_allocated(device), _pinned_host_reserved()))

    capture = _capture_mla if kind == "mla" else _capture_paged
    keep, pool, inputs = capture(registry, device, batch_sizes, heads, seq_len, int_workspace, ready)
    used, allocated = int(baseline[0] or 0), int(baseline[1] or 0)
    pinned = baseline[2]
    torch.cuda.synchronize(device)
    # What the caller allocated per plan (page tables, lengths, outputs): the rest is the plans' own.
    caller = sum(t.numel() * t.element_size() for entry in keep for t in entry if isinstance(t, torch.Tensor))
    allocated_delta = torch.cuda.memory_allocated(device) - allocated
    kernel = [k for k in kernel_buffer_stats(registry) if k.device == str(device)]
    regions = [r for r in registry.memory_stats()["int_regions"] if r["device"] == str(device)]
    pinned_after = _pinned_host_reserved()
    return {
        "device": torch.cuda.get_device_name(device),
        "kind": kind,
        "int_workspace": int_workspace,
        "profile": registry.profile_of(device).profile,
        "plans": len(keep),
        "heads": heads if kind == "mla" else _GQA["num_qo_heads"],
        "device_used_delta": _used(device) - used,
        "caller_bytes": caller,
        "beyond_caller_bytes": allocated_delta - caller,
        "torch_allocated_delta": allocated_delta,
        "pool_bytes": registry.stats(pool, device).capacity_bytes,
        "region_bytes": sum(k.region_bytes for k in kernel),
        "kernel_device_bytes": sum(k.device_bytes for k in kernel),
        "kernel_pinned_host_bytes": sum(k.pinned_host_bytes for k in kernel),
        "wspool_pinned_chunk_bytes": sum(r["pinned_chunk_bytes"] for r in regions),
        "pinned_host_reserved_delta": None if pinned is None or pinned_after is None else pinned_after - pinned,
        "wrappers": sum(k.wrappers for k in kernel),
        "inputs_bytes": sum(t.numel() * t.element_size() for t in inputs),
    }


def _capture(device: torch.device, run: Any) -> torch.cuda.CUDAGraph:
    """Run once off the capture (warm-up), then capture the same call."""
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def _capture_mla(
    registry: PoolRegistry,
    device: torch.device,
    batch_sizes: Sequence[int],
    heads: int,
    seq_len: int,
    mode: str,
    ready: Callable[[], None],
) -> tuple[list[Any], str, tuple[torch.Tensor, ...]]:
    from wspool.flashinfer.mla import MLA_POOL, mla_decode_plan

    largest = max(batch_sizes)
    pages = largest * ceil_div(seq_len, _PAGE)
    generator = torch.Generator(device=device).manual_seed(0)
    kv_cache = torch.randn(pages, _PAGE, _DIM, generator=generator, device=device).to(torch.bfloat16)
    tables = torch.arange(pages, dtype=torch.int32, device=device).view(largest, -1)
    query = torch.randn(largest, 1, heads, _DIM, generator=generator, device=device).to(torch.bfloat16)
    ready()
    keep: list[Any] = []
    for batch in batch_sizes:
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        block_tables = tables[:batch].contiguous()
        plan = mla_decode_plan(
            block_tables,
            lens,
            seq_len,
            num_heads=heads,
            sm_scale=1 / 192**0.5,
            page_size=_PAGE,
            return_lse=True,
            registry=registry,
            use_cuda_graph=True,
            int_group="decode" if mode == "shared" else None,
        )
        out = torch.empty(batch, 1, heads, _LATENT, dtype=torch.bfloat16, device=device)
        lse = torch.empty(batch, 1, heads, dtype=torch.float32, device=device)
        q = query[:batch]
        with registry.frozen():
            graph = _capture(device, lambda p=plan, q=q, o=out, s=lse: p.run(q, kv_cache, out=o, lse=s))
        keep.append((plan, graph, out, lse, lens, block_tables))
    return keep, MLA_POOL, (kv_cache, tables, query)


def _capture_paged(
    registry: PoolRegistry,
    device: torch.device,
    batch_sizes: Sequence[int],
    _heads: int,
    seq_len: int,
    _mode: str,
    ready: Callable[[], None],
) -> tuple[list[Any], str, tuple[torch.Tensor, ...]]:
    from wspool.flashinfer.kernels import load_flashinfer_attention
    from wspool.flashinfer.paged import PAGED_POOL

    flashinfer = load_flashinfer_attention()
    hq, hkv, dim, page = _GQA["num_qo_heads"], _GQA["num_kv_heads"], _GQA["head_dim"], _GQA["page_size"]
    largest = max(batch_sizes)
    per_request = ceil_div(seq_len, page)
    generator = torch.Generator(device=device).manual_seed(0)
    kv_cache = torch.randn(largest * per_request, 2, page, hkv, dim, generator=generator, device=device).to(
        torch.bfloat16
    )
    query = torch.randn(largest, hq, dim, generator=generator, device=device).to(torch.bfloat16)
    ready()
    workspace = registry.workspace(
        PAGED_POOL,
        device,
        rule="decode",
        batch_size=largest,
        num_tokens=largest,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=dim,
        page_size=page,
        dtype_bytes=2,
    )
    rule = wrapper_buffers.paged_int_rule(
        "decode", use_tensor_cores=True, backend="auto", dtypes=(torch.bfloat16, torch.bfloat16)
    )
    keep: list[Any] = []
    for batch in batch_sizes:
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * per_request
        indices = torch.arange(batch * per_request, dtype=torch.int32, device=device)
        last = torch.full((batch,), seq_len - (per_request - 1) * page, dtype=torch.int32, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last,
        )
        track_kernel_buffers(
            registry,
            registry.pool(PAGED_POOL, device),
            wrapper,
            (indptr, indices, last),
            default_int_bytes=wrapper_buffers.FLASHINFER_INT_DEFAULT_BYTES,
        )
        if rule is not None:
            wrapper_buffers.bind_paged_wrapper(
                wrapper,
                workspace,
                registry=registry,
                rule=rule,
                lane="main",
                kind="decode",
                facts={"batch_size": batch, "num_tokens": batch, "num_qo_heads": hq, "num_kv_heads": hkv},
            )
        wrapper.plan(indptr, indices, last, hq, hkv, dim, page, q_data_type=torch.bfloat16)
        out = torch.empty(batch, hq, dim, dtype=torch.bfloat16, device=device)
        q = query[:batch]
        graph = _capture(device, lambda w=wrapper, q=q, o=out: w.run(q, kv_cache, out=o))
        keep.append((wrapper, graph, out, indptr, indices, last))
    return keep, PAGED_POOL, (kv_cache, query)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement and print it (``--json``: as JSON)."""
    parser = argparse.ArgumentParser(prog="python -m wspool.tools.graph_plans", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="profile for every device (default: the configured one)")
    parser.add_argument("--kind", choices=KINDS, default="mla", help="MLA plans or paged decode wrappers")
    parser.add_argument(
        "--int-workspace",
        choices=INT_WORKSPACES,
        default="pooled",
        help="wspool's int regions (a region per wrapper, or one for the MLA plans) or FlashInfer's",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m wspool.tools.graph_plans: error: needs a CUDA device", file=sys.stderr)
        return 2
    overrides = {} if args.profile is None else {"profile": args.profile}
    figures = measure_graph_plans(
        PoolRegistry(load_settings(**overrides)), kind=args.kind, int_workspace=args.int_workspace
    )
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(
        f"{figures['plans']} CUDA-graph {figures['kind']} plans (batch {BATCH_SIZES[0]}..{BATCH_SIZES[-1]}, "
        f"{figures['heads']} heads) on {figures['device']}, profile {figures['profile']}, int workspaces "
        f"{figures['int_workspace']}:"
    )
    keys = (
        "device_used_delta",
        "caller_bytes",
        "beyond_caller_bytes",
        "torch_allocated_delta",
        "pool_bytes",
        "region_bytes",
        "kernel_device_bytes",
        "kernel_pinned_host_bytes",
        "wspool_pinned_chunk_bytes",
    )
    for key in (*keys, "pinned_host_reserved_delta"):
        if figures[key] is not None:
            print(f"  {key:<26} {figures[key]:>12} bytes ({format_size(figures[key])})")
    print(f"  wrappers alive             {figures['wrappers']:>12}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
