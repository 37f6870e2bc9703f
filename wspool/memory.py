"""Memory accounting: what a registry's buffers hold, per backend, beside PyTorch's figures.

One row per buffer (pool, device, lane), with the bytes FlashInfer's wrappers
hold themselves (tracked weakly per pool, wspool's int workspace regions included) and,
on CUDA, PyTorch's allocated and reserved bytes. Reading has no side effects and
creates no CUDA context; thread-safe. Tables and figures: docs/kernels.md.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from wspool.errors import RuleError
from wspool.pool import Allocator, PoolStats, zeros_allocator
from wspool.units import format_size

if TYPE_CHECKING:
    from wspool.pool import PoolSource, WorkspacePool

__all__ = [
    "KernelBufferStats",
    "dry_run",
    "kernel_buffer_stats",
    "mem_pool_allocator",
    "memory_stats",
    "memory_summary",
    "track_kernel_buffers",
]


@dataclass(frozen=True)
class KernelBufferStats:
    """What the live FlashInfer wrappers built on one pool's buffer hold themselves.

    ``device_bytes`` leaves out wspool's regions, counted once each in
    ``region_bytes``; ``pinned_host_bytes`` includes wspool's pinned copies.
    """

    pool: str
    device: str
    lane: str
    wrappers: int
    device_bytes: int
    pinned_host_bytes: int
    region_bytes: int = 0
    bound_wrappers: int = 0


class _Tracked:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[int, tuple[weakref.ref[Any], str, str, str, tuple[int, ...]]] = {}
        self.default_int_bytes = 0


def track_kernel_buffers(
    registry: PoolSource,
    pool: WorkspacePool,
    wrapper: Any,
    supplied: Iterable[torch.Tensor] = (),
    *,
    default_int_bytes: int,
) -> None:
    """Count ``wrapper``'s own buffers, less ``supplied`` ones, against ``pool`` for as long as it lives.

    ``default_int_bytes``: what the kernel library allocates per wrapper for its int
    workspace (and as much again pinned) when given none, for the summary's comparison.
    """
    tracked = registry.state(_Tracked)
    tracked.default_int_bytes = default_int_bytes
    key = id(wrapper)
    found = tracked.entries.get(key)
    if found is not None and found[0]() is wrapper:
        return
    ptrs = tuple(t.data_ptr() for t in supplied)
    with tracked.lock:
        tracked.entries[key] = (weakref.ref(wrapper), pool.spec.name, str(pool.device), pool.lane, ptrs)


def _own_tensors(wrapper: Any) -> Iterable[torch.Tensor]:
    """The tensors a wrapper holds in its attributes and in those of its attribute objects, one level deep."""
    for value in vars(wrapper).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            yield from (v for v in vars(value).values() if isinstance(v, torch.Tensor))


def kernel_buffer_stats(registry: PoolSource) -> list[KernelBufferStats]:
    """Return, per pool, device and lane, what the live wrappers hold besides the pool's buffer; sorted."""
    tracked = registry.peek_state(_Tracked)
    if tracked is None:
        return []
    with tracked.lock:
        entries = list(tracked.entries.items())
    regions = registry.existing_wrapper_regions()  # reading makes nothing
    totals: dict[tuple[str, str, str], list[int]] = {}
    counted_regions: dict[tuple[str, str, str], set[int]] = {}
    dead = []
    buffers = {(p.spec.name, str(p.device), p.lane): p.buffer for p in registry.pools()}
    for key, (ref, pool, device, lane, supplied) in entries:
        wrapper = ref()
        if wrapper is None:
            dead.append(key)
            continue
        workspace = buffers.get((pool, device, lane))
        skip = {*supplied, *(() if workspace is None else (workspace.data_ptr(),))} - {0}
        total = totals.setdefault((pool, device, lane), [0, 0, 0, 0, 0])
        total[0] += 1
        binding = None if regions is None else regions.binding(wrapper)
        if binding is not None:
            total[4] += 1
            region = binding.region.tensor
            skip.add(region.data_ptr())
            seen_regions = counted_regions.setdefault((pool, device, lane), set())
            if id(binding.region) not in seen_regions:
                seen_regions.add(id(binding.region))
                total[3] += region.numel()
        seen: set[int] = set()
        for tensor in _own_tensors(wrapper):
            ptr = tensor.data_ptr()
            key = ptr or -id(tensor)  # meta tensors have no address: each object counts once
            if ptr in skip or key in seen:
                continue
            seen.add(key)
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.device.type == "cpu":
                if tensor.is_pinned():
                    total[2] += nbytes
            else:
                total[1] += nbytes
    if dead:
        with tracked.lock:
            for key in dead:
                if key in tracked.entries and tracked.entries[key][0]() is None:
                    del tracked.entries[key]
    return [KernelBufferStats(p, d, ln, *v) for (p, d, ln), v in sorted(totals.items())]


def mem_pool_allocator(mem_pool: Any, base: Allocator | None = None) -> Allocator:
    """Return an allocator that makes CUDA buffers inside ``mem_pool`` (a :class:`torch.cuda.MemPool`).

    ``use_mem_pool`` routes the calling thread's allocations only, and a pool
    allocates in the thread that asked for the growth; other devices allocate as usual.
    """
    allocate = base or zeros_allocator

    def allocate_in_mem_pool(nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return allocate(nbytes, device)
        with torch.cuda.use_mem_pool(mem_pool, device=device):
            return allocate(nbytes, device)

    return allocate_in_mem_pool


def _backends(stats: PoolStats, owners: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Requests per rule, grouped by the pool that owns each rule (a reason such as ``reserve`` stays with the host)."""
    grouped: dict[str, dict[str, int]] = {}
    for rule, count in sorted(stats.requests_by_rule.items()):
        grouped.setdefault(owners.get(rule, stats.pool), {})[rule] = count
    return grouped


def _order(stats: PoolStats) -> tuple[str, str, str]:
    return (stats.pool, stats.device, stats.lane)


def _torch_figures(device: str) -> dict[str, int] | None:
    target = torch.device(device)
    if target.type != "cuda" or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    figures = torch.cuda.memory_stats(target)
    return {
        "torch_allocated_bytes": int(figures.get("allocated_bytes.all.current", 0)),
        "torch_reserved_bytes": int(figures.get("reserved_bytes.all.current", 0)),
    }


def memory_stats(registry: PoolSource) -> dict[str, Any]:
    """Return what the registry's buffers hold as plain data: ``buffers``, ``held_bytes`` and per-device figures."""
    buffers = []
    devices: dict[str, dict[str, int]] = {}
    instances = sorted(((p.stats(), p.spec.rule_pools) for p in registry.pools()), key=lambda x: _order(x[0]))
    for stats, owners in instances:
        backends = _backends(stats, owners)
        held = stats.capacity_bytes + stats.retired_bytes
        buffers.append(
            {
                "pool": stats.pool,
                "device": stats.device,
                "lane": stats.lane,
                "capacity_bytes": stats.capacity_bytes,
                "peak_request_bytes": stats.peak_request_bytes,
                "request_count": stats.request_count,
                "grow_count": stats.grow_count,
                "refused_count": stats.refused_count,
                "retired_bytes": stats.retired_bytes,
                "last_grow_reason": stats.last_grow_reason,
                "backends": backends,
            }
        )
        entry = devices.setdefault(stats.device, {"held_bytes": 0})
        entry["held_bytes"] += held
    kernel = [asdict(k) for k in kernel_buffer_stats(registry)]
    regions = registry.existing_wrapper_regions()
    int_regions = [] if regions is None else regions.stats()
    for k in kernel:
        entry = devices.setdefault(k["device"], {"held_bytes": 0})
        entry["kernel_bytes"] = entry.get("kernel_bytes", 0) + k["device_bytes"]
        entry["kernel_pinned_host_bytes"] = entry.get("kernel_pinned_host_bytes", 0) + k["pinned_host_bytes"]
    for device, entry in devices.items():
        entry.update(_torch_figures(device) or {})
    return {
        "buffers": buffers,
        "held_bytes": sum(d["held_bytes"] for d in devices.values()),
        "devices": devices,
        "kernel_buffers": kernel,
        "int_regions": int_regions,
    }


def _backends_text(backends: Mapping[str, Mapping[str, int]]) -> str:
    parts = [f"{pool} ({', '.join(f'{rule} {n}' for rule, n in rules.items())})" for pool, rules in backends.items()]
    return "; ".join(parts) or "-"


def memory_summary(registry: PoolSource) -> str:
    """Return a table of the registry's buffers, with totals per device and PyTorch's figures."""
    data = memory_stats(registry)
    tracked = registry.peek_state(_Tracked)
    default_int_bytes = 0 if tracked is None else tracked.default_int_bytes
    header = ("pool", "device", "lane", "capacity", "peak request", "grows", "backends (requests per rule)")
    rows = [
        (
            b["pool"],
            b["device"],
            b["lane"],
            format_size(b["capacity_bytes"])
            + (f" +{format_size(b['retired_bytes'])} retired" if b["retired_bytes"] else ""),
            format_size(b["peak_request_bytes"]),
            str(b["grow_count"]),
            _backends_text(b["backends"]),
        )
        for b in data["buffers"]
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in [header, *rows]
    ]
    if not rows:
        lines.append("(no buffers: nothing has requested a workspace yet)")
    for k in data["kernel_buffers"]:
        bound = (
            f" ({k['bound_wrappers']} on wspool int regions, {format_size(k['region_bytes'])})"
            if k["bound_wrappers"]
            else ""
        )
        default = format_size(k["wrappers"] * default_int_bytes)
        lines.append(
            f"FlashInfer's own buffers on {k['pool']} {k['device']} lane {k['lane']}: {k['wrappers']} wrapper(s)"
            f"{bound} hold {format_size(k['device_bytes'])} more on the device, "
            f"{format_size(k['pinned_host_bytes'])} pinned host (FlashInfer's defaults: {default} + {default} pinned)"
        )
    for r in data["int_regions"]:
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(r["kinds"].items()))
        lines.append(
            f"int workspace regions on {r['device']} lane {r['lane']}: {r['regions']} region(s) of "
            f"{format_size(r['region_bytes'])} for {r['wrappers']} wrapper(s) ({kinds}), "
            f"{format_size(r['pinned_bytes'])} of pinned copies made by wspool "
            f"(in {format_size(r['pinned_chunk_bytes'])} of page-locked chunks)"
        )
    for device, entry in sorted(data["devices"].items()):
        line = f"{device}: wspool holds {format_size(entry['held_bytes'])}"
        if entry.get("kernel_bytes") or entry.get("kernel_pinned_host_bytes"):
            line += (
                f", FlashInfer's wrappers {format_size(entry['kernel_bytes'])} more "
                f"(+{format_size(entry['kernel_pinned_host_bytes'])} pinned host)"
            )
        if "torch_allocated_bytes" in entry:
            line += (
                f" of the {format_size(entry['torch_allocated_bytes'])} PyTorch has allocated "
                f"(reserved {format_size(entry['torch_reserved_bytes'])})"
            )
        lines.append(line)
    return "\n".join(line.rstrip() for line in lines)


def dry_run(registry: PoolSource, facts: Mapping[str, int], device: str = "meta") -> dict[str, Any]:
    """Request every configured rule once with ``facts`` on ``device`` (``meta``: nothing is allocated).

    Returns :func:`memory_stats` plus ``separate_bytes`` (a buffer per pool) and ``skipped`` rules.
    """
    skipped: dict[str, str] = {}
    largest: dict[str, int] = {}
    requests = []
    for name in registry.pool_names():
        for rule, compiled in sorted(registry.spec(name).rules.items()):
            # The facts this rule reads: resolve() refuses a fact no rule of the pool reads, and
            # ``facts`` serve every pool (the caller checks that each is read by some rule).
            read = {fact: facts[fact] for fact in compiled.names if fact in facts}
            try:
                nbytes = registry.resolve(name, rule, device=device, **read)
            except RuleError as exc:
                skipped[f"{name}.{rule}"] = " ".join(str(exc).split())
                continue
            largest[name] = max(largest.get(name, 0), nbytes)
            requests.append((nbytes, name, rule))
    for _, name, rule in sorted(requests, key=lambda r: -r[0]):  # largest first: one growth per buffer
        registry.pool(name, device).workspace(rule, facts)
    return {**memory_stats(registry), "separate_bytes": sum(largest.values()), "skipped": skipped}
