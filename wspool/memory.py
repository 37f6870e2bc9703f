"""Memory accounting: what a registry's buffers hold, per backend, beside PyTorch's figures.

``memory_stats`` returns plain (JSON-able) data and ``memory_summary`` a table,
one row per buffer (pool, device, lane), with the bytes FlashInfer's wrappers
hold for themselves (tracked weakly per pool) and, on CUDA, PyTorch's
allocated and reserved bytes. ``dry_run`` resolves rules on the ``meta``
device, allocating nothing. Reading has no side effects and creates no CUDA
context; thread-safe. Tables and figures: docs/kernels.md.

:class:`WrapperRegions` hands kernel wrappers right-sized regions of their own
(a wrapper's int workspace and its pinned host copy) in place of the fixed
buffers they would allocate; a region lives as long as a wrapper bound to it.
Wrappers bound with one sharing group on one device and lane share a region,
and its :class:`PlanOwner` record says whose plan it holds. Device: a region lives on the wrapper's device, its
pinned copy in page-locked host memory (plain host memory off CUDA).
Capture: a region never moves; none is allocated while the current stream
captures a CUDA graph. Threads: binding is thread-safe; allocation runs
outside the lock. Sharing rules: docs/wrapper-buffers.md.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from wspool.errors import ConfigError, RuleError, WorkspaceFrozenError, WorkspaceLimitError, describe_setting
from wspool.pool import Allocator, PoolStats, cuda_capture_probe, zeros_allocator
from wspool.units import format_size, round_up

if TYPE_CHECKING:
    from wspool.pool import PoolSource, WorkspacePool

__all__ = [
    "FLASHINFER_INT_DEFAULT_BYTES",
    "IntRegion",
    "KernelBufferStats",
    "PlanOwner",
    "WrapperBinding",
    "WrapperRegions",
    "binding_of",
    "dry_run",
    "kernel_buffer_stats",
    "mem_pool_allocator",
    "memory_stats",
    "memory_summary",
    "track_kernel_buffers",
    "wrapper_regions",
]


_STATE_KEY = "kernel_buffers"
#: What FlashInfer allocates per wrapper for its int workspace (and as much again pinned) by default.
FLASHINFER_INT_DEFAULT_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class KernelBufferStats:
    """What the live FlashInfer wrappers built on one pool's buffer hold themselves.

    Attributes:
        pool: The pool whose buffer the wrappers use as their float workspace.
        device: The device, as a string.
        lane: The lane.
        wrappers: Live wrappers.
        device_bytes: Their own device tensors (FlashInfer's int workspaces and the like),
            regions from :class:`WrapperRegions` not included.
        pinned_host_bytes: Their pinned host tensors (staging copies), wspool's pinned
            regions included.
        region_bytes: The wspool regions they use as int workspaces, each counted once.
        bound_wrappers: How many of them use a wspool region.
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


def track_kernel_buffers(
    registry: PoolSource, pool: WorkspacePool, wrapper: Any, supplied: Iterable[torch.Tensor] = ()
) -> None:
    """Count ``wrapper``'s own buffers against ``pool`` for as long as the wrapper lives.

    Args:
        registry: The registry whose statistics report it.
        pool: The pool whose buffer the wrapper was built on.
        wrapper: The FlashInfer wrapper (held weakly).
        supplied: Tensors the caller gave the wrapper (index buffers), not counted.
    """
    tracked: _Tracked | None = registry.op_state.get(_STATE_KEY)
    if tracked is None:
        tracked = registry.op_state.setdefault(_STATE_KEY, _Tracked())
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
    tracked: _Tracked | None = registry.op_state.get(_STATE_KEY)
    if tracked is None:
        return []
    with tracked.lock:
        entries = list(tracked.entries.items())
    regions = wrapper_regions(registry)
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
        binding = regions.binding(wrapper)
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


# -- wrappers' own regions ----------------------------------------------------------

_REGIONS_KEY = "wrapper_regions"
#: Regions start on this boundary, as FlashInfer's planners assume of their int workspaces.
REGION_ALIGNMENT = 16
#: Pinned copies are carved from page-locked chunks of this size: PyTorch's pinned allocator
#: rounds every block up to a power of two, so one block per copy would nearly double them.
PINNED_CHUNK_BYTES = 4 * 1024 * 1024


class PlanOwner:
    """Which plan last wrote an int workspace: the token of the plan whose metadata it holds.

    wspool's record, kept beside the kernel wrapper, never on it. A region shared
    by several wrappers has one record, so a plan of any of them sees another take it.

    Attributes:
        owner: That plan's token; ``None`` before the first plan and while one is planning.
    """

    __slots__ = ("owner",)

    def __init__(self) -> None:
        self.owner: object | None = None


class IntRegion:
    """One int workspace on the device, as wspool hands it to kernel wrappers.

    Attributes:
        tensor: The region: a zero-filled 1-D ``uint8`` tensor of its own allocation.
        record: Whose plan the region holds (every wrapper bound to it shares this record).
        group: The sharing group, or ``None`` for a region of one wrapper.
        device: The device, as a string.
        lane: The lane.
    """

    __slots__ = ("__weakref__", "device", "group", "lane", "record", "tensor")

    def __init__(self, tensor: torch.Tensor, group: Hashable | None, lane: str) -> None:
        self.tensor = tensor
        self.record = PlanOwner()
        self.group = group
        self.device = str(tensor.device)
        self.lane = lane

    @property
    def nbytes(self) -> int:
        """The region's size in bytes."""
        return int(self.tensor.numel())


class WrapperBinding:
    """What wspool gave one wrapper: its int region, and its own pinned host copy where wspool makes one.

    Attributes:
        region: The int workspace.
        pinned: The wrapper's pinned host copy (as large as the region), or ``None``
            where the wrapper makes its own from the region's size.
        kind: What the wrapper is, e.g. ``"mla"`` or ``"decode"`` (for statistics).
    """

    __slots__ = ("kind", "pinned", "region")

    def __init__(self, region: IntRegion, pinned: torch.Tensor | None, kind: str) -> None:
        self.region, self.pinned, self.kind = region, pinned, kind


# Every registry's bindings, for the look-up by wrapper alone (a wrapper has one binding at a time).
_BOUND: weakref.WeakKeyDictionary[Any, WrapperBinding] = weakref.WeakKeyDictionary()


def binding_of(wrapper: Any) -> WrapperBinding | None:
    """Return the region binding ``wrapper`` has in any registry, or ``None``."""
    return _BOUND.get(wrapper)


class WrapperRegions:
    """A registry's regions for kernel wrappers' own buffers, keyed weakly by wrapper.

    Args:
        pool: The name of the pool whose configuration caps them (``max_bytes`` per device and lane).
        max_bytes: Reads that cap for a device: ``None`` for none.
        allocator: Makes zero-filled device regions; default ``torch.zeros``.

    Thread semantics: thread-safe; a region is allocated outside the lock, so two
    threads binding the first wrappers of one group may each allocate, and the one
    that installs its region first wins (the other's region is dropped).
    """

    def __init__(self, pool: str, max_bytes: Callable[[str], int | None], allocator: Allocator | None = None) -> None:
        self.pool = pool
        self._max_bytes = max_bytes
        self._allocate = allocator or zeros_allocator
        self._lock = threading.Lock()
        self._bindings: weakref.WeakKeyDictionary[Any, WrapperBinding] = weakref.WeakKeyDictionary()
        self._groups: weakref.WeakValueDictionary[tuple[str, str, Hashable], IntRegion] = weakref.WeakValueDictionary()
        self._probes: dict[str, Callable[[], bool]] = {}
        self._pinned_chunk: tuple[torch.Tensor, int] | None = None  # (chunk, bytes used)

    def binding(self, wrapper: Any) -> WrapperBinding | None:
        """Return what ``wrapper`` was bound to, or ``None``."""
        return self._bindings.get(wrapper)

    def bind(
        self,
        wrapper: Any,
        *,
        device: torch.device,
        nbytes: int,
        kind: str,
        lane: str,
        group: Hashable | None = None,
        pinned: bool = False,
    ) -> WrapperBinding:
        """Give ``wrapper`` an int region of at least ``nbytes``; return its binding.

        Args:
            wrapper: The kernel wrapper (held weakly; its binding lives as long as it).
            device: The wrapper's device.
            nbytes: What its plans need at most.
            kind: What it is, for statistics.
            lane: The lane of the work it serves.
            group: Wrappers bound with the same group, device and lane share one
                region; the caller states that their plans are never live at once
                (the region's record lets each plan see that another took it).
                ``None``: a region of its own.
            pinned: Also make it a pinned host copy as large as the region.

        Raises:
            WorkspaceFrozenError: A region would be allocated while the current stream captures.
            WorkspaceLimitError: The regions would pass the pool's ``max_bytes``, or the device's memory.
        """
        size = round_up(max(int(nbytes), REGION_ALIGNMENT), REGION_ALIGNMENT)
        key = (str(device), lane, group)
        region = self._groups.get(key) if group is not None else None
        if region is None or region.nbytes < size:
            region = self._new_region(device, size, group, lane)
            if group is not None:
                with self._lock:
                    installed = self._groups.get(key)
                    if installed is not None and installed.nbytes >= size:
                        region = installed  # another thread installed one first
                    else:
                        self._groups[key] = region
        copy = self._pinned_copy(region.nbytes, device) if pinned else None
        binding = WrapperBinding(region, copy, kind)
        with self._lock:
            previous = self._bindings.get(wrapper)
            self._bindings[wrapper] = binding
            _BOUND[wrapper] = binding
        if previous is not None and previous.region is not region:
            previous.region.record.owner = None  # the wrapper's plans no longer live there
        return binding

    def _new_region(self, device: torch.device, size: int, group: Hashable | None, lane: str) -> IntRegion:
        """Allocate a region (outside the lock), refused while capturing or past the cap."""
        where = str(device)
        if device.type == "cuda":
            probe = self._probes.get(where)
            if probe is None:
                probe = self._probes.setdefault(where, cuda_capture_probe(device))
            if probe():
                raise WorkspaceFrozenError(
                    f"a {format_size(size)} int workspace region ({self.pool}) on {device} lane {lane} would be "
                    "allocated during CUDA-graph capture; bind the wrapper (build it and plan it once) before capture"
                )
        limit = self._max_bytes(where)
        if limit is not None:
            held = sum(r.nbytes for r in self._live_regions() if r.device == where and r.lane == lane)
            if held + size > limit:
                raise WorkspaceLimitError(
                    f"int workspace regions ({self.pool}) on {device} lane {lane} would hold {held + size} bytes, "
                    f"over max_bytes {limit}; raise {describe_setting(('pools', self.pool, 'max_bytes'))}"
                )
        with torch.inference_mode(False):
            try:
                tensor = self._allocate(size, device)
            except (RuntimeError, MemoryError) as exc:  # torch's OutOfMemoryError is a RuntimeError
                raise WorkspaceLimitError(
                    f"out of memory allocating a {format_size(size)} int workspace region ({self.pool}) on {device}"
                ) from exc
        return IntRegion(tensor, group, lane)

    def _pinned_copy(self, size: int, device: torch.device) -> torch.Tensor:
        """A pinned host copy of ``size`` bytes of its own, cut from a page-locked chunk (plain memory off CUDA).

        Slices never overlap; a chunk is freed once no copy cut from it is alive.
        """
        if device.type != "cuda":
            with torch.inference_mode(False):
                return torch.empty(size, dtype=torch.uint8)
        while True:
            with self._lock:
                found = self._pinned_chunk
                if found is not None and found[1] + size <= found[0].numel():
                    chunk, used = found
                    self._pinned_chunk = (chunk, round_up(used + size, REGION_ALIGNMENT))
                    return chunk[used : used + size]
            chunk_bytes = max(PINNED_CHUNK_BYTES, 1 << (size - 1).bit_length())
            with torch.inference_mode(False):  # allocated outside the lock; installed unless another thread was first
                new = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
            with self._lock:
                current = self._pinned_chunk
                if current is None or current[1] + size > current[0].numel():
                    self._pinned_chunk = (new, 0)

    def _live_regions(self) -> list[IntRegion]:
        with self._lock:
            found = {id(b.region): b.region for b in self._bindings.values()}
        return list(found.values())

    def stats(self) -> list[dict[str, Any]]:
        """Return the live regions per device and lane: wrappers, regions, region and pinned bytes, kinds.

        ``pinned_bytes`` counts the copies; ``pinned_chunk_bytes`` the page-locked chunks they are cut from.
        """
        with self._lock:
            bindings = list(self._bindings.values())
        totals: dict[tuple[str, str], dict[str, Any]] = {}
        seen: set[int] = set()
        chunks: set[int] = set()
        for binding in bindings:
            region = binding.region
            entry = totals.setdefault(
                (region.device, region.lane),
                {"device": region.device, "lane": region.lane, "wrappers": 0, "regions": 0, "region_bytes": 0,
                 "pinned_bytes": 0, "pinned_chunk_bytes": 0, "kinds": {}},
            )  # fmt: skip
            entry["wrappers"] += 1
            entry["kinds"][binding.kind] = entry["kinds"].get(binding.kind, 0) + 1
            if binding.pinned is not None:
                entry["pinned_bytes"] += binding.pinned.numel()
                storage = binding.pinned.untyped_storage()
                if storage.data_ptr() not in chunks:
                    chunks.add(storage.data_ptr())
                    entry["pinned_chunk_bytes"] += storage.nbytes()
            if id(region) not in seen:
                seen.add(id(region))
                entry["regions"] += 1
                entry["region_bytes"] += region.nbytes
        return [totals[k] for k in sorted(totals)]


def wrapper_regions(registry: PoolSource, pool: str = "flashinfer_int") -> WrapperRegions:
    """Return ``registry``'s :class:`WrapperRegions` (made on first use), capped by ``pools.<pool>.max_bytes``."""
    regions: WrapperRegions | None = registry.op_state.get(_REGIONS_KEY)
    if regions is None:

        def max_bytes(device: str) -> int | None:
            try:
                return registry.spec(pool, device).max_bytes
            except ConfigError:  # the pool is not declared (yet): no cap
                return None

        regions = registry.op_state.setdefault(_REGIONS_KEY, WrapperRegions(pool, max_bytes))
    return regions


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
    regions: WrapperRegions | None = registry.op_state.get(_REGIONS_KEY)
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
        default = format_size(k["wrappers"] * FLASHINFER_INT_DEFAULT_BYTES)
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

    Returns:
        :func:`memory_stats` of the result, plus ``separate_bytes`` (what the
        pools would hold with a buffer each, ``shared_with`` ignored) and
        ``skipped`` (``pool.rule`` -> why, for rules whose facts were not given).
    """
    skipped: dict[str, str] = {}
    largest: dict[str, int] = {}
    requests = []
    for name in registry.pool_names():
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
