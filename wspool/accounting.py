"""Memory accounting: what a registry's pools hold, per backend, next to PyTorch's own figures.

:meth:`PoolRegistry.memory_stats <wspool.PoolRegistry.memory_stats>` returns
plain data (JSON-able) and :meth:`~wspool.PoolRegistry.memory_summary` a table
with one row per buffer (pool, device, lane): capacity, peak request, grows,
FlashInfer's wrappers' own buffers (:mod:`wspool.kernel_buffers`),
and the backends that drew from it, i.e. each pool whose rules it served
(pools configured with ``shared_with`` draw from their host's buffer) with
its requests per rule. For CUDA devices both add PyTorch's allocated and
reserved bytes from :func:`torch.cuda.memory_stats`, so wspool's share is
visible; wspool's buffers are part of PyTorch's allocated bytes, not extra.

:func:`mem_pool_allocator` makes a registry allocate inside a caller's
:class:`torch.cuda.MemPool` (engines' sleep and offload modes manage the
memory of such a pool as a whole).

:func:`dry_run` resolves a configuration's rules for given facts on the
``meta`` device, which allocates nothing: what ``wspool stats`` prints.

Reading statistics has no side effects and never creates a CUDA context;
PyTorch's figures are read only for devices where a pool already allocated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from wspool.errors import RuleError
from wspool.kernel_buffers import kernel_buffer_stats
from wspool.pool_spec import Allocator, PoolStats, zeros_allocator
from wspool.units import format_size

if TYPE_CHECKING:
    from wspool.pool_source import PoolSource

__all__ = ["dry_run", "mem_pool_allocator", "memory_stats", "memory_summary"]


def mem_pool_allocator(mem_pool: Any, base: Allocator | None = None) -> Allocator:
    """Return an allocator that makes CUDA buffers inside ``mem_pool``.

    Args:
        mem_pool: A :class:`torch.cuda.MemPool`. Buffers on CUDA devices are
            allocated under :func:`torch.cuda.use_mem_pool` for that device;
            other devices allocate as usual.
        base: The allocator to run inside the pool; default ``torch.zeros``.

    Thread semantics: ``use_mem_pool`` routes the calling thread's allocations
    only, and a pool allocates in the thread that asked for the growth.
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
    """Return what the registry's buffers hold, as plain data.

    Returns:
        ``{"buffers": [...], "held_bytes": N, "devices": {...}}``: one entry per
        buffer (pool, device, lane) with its capacity, peak request, requests,
        grows, refusals, retired bytes, last grow reason and ``backends`` (pool ->
        rule -> requests); ``held_bytes`` counts capacities and retired buffers;
        ``devices`` has each device's held bytes and, on CUDA, PyTorch's
        ``allocated_bytes.all.current`` and ``reserved_bytes.all.current``.
    """
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
    }


def _backends_text(backends: Mapping[str, Mapping[str, int]]) -> str:
    parts = [f"{pool} ({', '.join(f'{rule} {n}' for rule, n in rules.items())})" for pool, rules in backends.items()]
    return "; ".join(parts) or "-"


def memory_summary(registry: PoolSource) -> str:
    """Return a table of the registry's buffers, with totals per device and PyTorch's figures."""
    data = memory_stats(registry)
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
        lines.append(
            f"FlashInfer's own buffers on {k['pool']} {k['device']} lane {k['lane']}: {k['wrappers']} wrapper(s) "
            f"hold {format_size(k['device_bytes'])} on the device, {format_size(k['pinned_host_bytes'])} pinned host"
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

    Returns:
        :func:`memory_stats` of the result, plus ``separate_bytes`` (what the
        pools would hold with a buffer each, ``shared_with`` ignored) and
        ``skipped`` (``pool.rule`` -> why, for rules whose facts were not given).
    """
    skipped: dict[str, str] = {}
    largest: dict[str, int] = {}
    requests = []
    for name in sorted(registry.settings.pools):
        for rule in sorted(registry.spec(name).rules):
            try:
                nbytes = registry.resolve(name, rule, device=device, **facts)
            except RuleError as exc:
                skipped[f"{name}.{rule}"] = " ".join(str(exc).split())
                continue
            largest[name] = max(largest.get(name, 0), nbytes)
            requests.append((nbytes, name, rule))
    for _, name, rule in sorted(requests, key=lambda r: -r[0]):  # largest first: one growth per buffer
        registry.pool(name, device).workspace(rule, facts)
    return {**memory_stats(registry), "separate_bytes": sum(largest.values()), "skipped": skipped}
