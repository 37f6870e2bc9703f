"""Kernel wrappers' own buffers, right-sized: int workspace regions and pinned host copies.

:class:`WrapperRegions` hands kernel wrappers right-sized int workspaces, keyed
weakly by wrapper; wrappers bound with one group on one device and lane share a
region, whose :class:`PlanOwner` says whose plan it holds. A region lives on the
wrapper's device, its pinned copy in page-locked host memory (plain memory off
CUDA). A region never moves, and none is allocated while the current stream
captures. Binding is thread-safe; allocation runs outside the lock. FlashInfer's
side: :mod:`wspool.flashinfer.wrapper_buffers`; sharing: docs/wrapper-buffers.md.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from wspool.devices import resolve_device
from wspool.errors import ConfigError, WorkspaceFrozenError, WorkspaceLimitError, describe_setting
from wspool.freeze import cuda_capture_probe
from wspool.pool import Allocator, PoolSource, zeros_allocator
from wspool.units import format_size, round_up

__all__ = [
    "PINNED_CHUNK_BYTES",
    "REGION_ALIGNMENT",
    "IntRegion",
    "PlanOwner",
    "WrapperBinding",
    "WrapperRegions",
    "binding_of",
    "existing_regions",
    "wrapper_regions",
]

#: Regions start on this boundary, as FlashInfer's planners assume of their int workspaces.
REGION_ALIGNMENT = 16
#: Pinned copies are carved from page-locked chunks of this size: PyTorch's pinned allocator
#: rounds every block up to a power of two, so one block per copy would nearly double them.
PINNED_CHUNK_BYTES = 4 * 1024 * 1024


class PlanOwner:
    """Which plan's metadata an int workspace holds (``owner``: ``None`` before the first plan and mid-plan).

    One record per region, beside the wrappers, so a plan sees another wrapper's plan take it.
    """

    __slots__ = ("owner",)

    def __init__(self) -> None:
        self.owner: object | None = None


class IntRegion:
    """One int workspace (a zero-filled ``uint8`` tensor of its own allocation) as kernel wrappers get it."""

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

    ``setting`` is the key of the rule that sized the region, for errors.
    """

    __slots__ = ("kind", "pinned", "region", "setting")

    def __init__(self, region: IntRegion, pinned: torch.Tensor | None, kind: str, setting: str | None = None) -> None:
        self.region, self.pinned, self.kind, self.setting = region, pinned, kind, setting


# Every registry's bindings by ``id(wrapper)``: (a weak reference to the wrapper, its binding). A wrapper
# has one binding at a time; its entry leaves when it dies (the weak reference's callback runs as the wrapper
# is freed, before its id can name another object). Engines look a binding up per plan call, so the key is the
# id, not the wrapper (a WeakKeyDictionary makes a weak reference per look-up).
_BOUND: dict[int, tuple[weakref.ref[Any], WrapperBinding]] = {}


def binding_of(wrapper: Any) -> WrapperBinding | None:
    """Return the region binding ``wrapper`` has in any registry, or ``None`` (any thread)."""
    found = _BOUND.get(id(wrapper))
    return None if found is None else found[1]


def _remember(wrapper: Any, binding: WrapperBinding) -> None:
    key = id(wrapper)

    # The table is bound here, not looked up as a global: a wrapper may die at interpreter exit
    # after this module's globals were cleared, and its callback must still find the table.
    def forget(ref: weakref.ref[Any], bound: dict[int, tuple[weakref.ref[Any], WrapperBinding]] = _BOUND) -> None:
        found = bound.get(key)
        if found is not None and found[0] is ref:  # not a later wrapper's entry under a reused id
            bound.pop(key, None)

    _BOUND[key] = (weakref.ref(wrapper, forget), binding)


class WrapperRegions:
    """A registry's regions for kernel wrappers' own buffers, keyed weakly by wrapper.

    ``max_bytes`` reads pool ``pool``'s cap per device and lane; a device counts as
    its tensors report it, however spelled. Thread-safe: two threads binding a
    group's first wrappers may each allocate; the first to install wins.
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
        setting: str | None = None,
        install: Callable[[WrapperBinding], None] | None = None,
    ) -> WrapperBinding:
        """Give ``wrapper`` (held weakly) an int region of at least ``nbytes``; return its binding.

        Args:
            group: Wrappers bound with one group, device and lane share one region;
                the caller states their plans are never live at once. ``None``: its own.
            pinned: Also make it a pinned host copy as large as the region.
            install: Hands the new binding to the wrapper, outside the lock; the
                binding is recorded only once it returns (what it raises propagates).

        Raises:
            WorkspaceFrozenError: A region would be allocated while the current stream captures.
            WorkspaceLimitError: The regions would pass the pool's ``max_bytes``, or the device's memory.
            ConfigError: ``device`` is ``cuda`` and torch can use no CUDA device here.
        """
        device = _as_tensors_report(device)
        size = round_up(max(int(nbytes), REGION_ALIGNMENT), REGION_ALIGNMENT)
        key = (str(device), lane, group)
        region = self._groups.get(key) if group is not None else None
        if region is None or region.nbytes < size:
            region = self._new_region(device, size, group, lane, wrapper)
            if group is not None:
                with self._lock:
                    installed = self._groups.get(key)
                    if installed is not None and installed.nbytes >= size:
                        region = installed  # another thread installed one first
                    else:
                        self._groups[key] = region
        copy = self._pinned_copy(region.nbytes, device) if pinned else None
        binding = WrapperBinding(region, copy, kind, setting)
        if install is not None:
            install(binding)
        with self._lock:
            previous = self._bindings.get(wrapper)
            self._bindings[wrapper] = binding
            _remember(wrapper, binding)
        if previous is not None and previous.region is not region:
            previous.region.record.owner = None  # the wrapper's plans no longer live there
        return binding

    def _new_region(
        self, device: torch.device, size: int, group: Hashable | None, lane: str, wrapper: Any
    ) -> IntRegion:
        """Allocate a region for ``wrapper`` (outside the lock), refused while capturing or past the cap."""
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
            held = sum(r.nbytes for r in self._live_regions(wrapper) if r.device == where and r.lane == lane)
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
        """A pinned host copy of ``size`` bytes, cut from a page-locked chunk freed once no copy of it is alive."""
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

    def _live_regions(self, leaving: Any = None) -> list[IntRegion]:
        """The regions the bound wrappers hold, each once; ``leaving``'s binding not counted."""
        with self._lock:
            found = {id(b.region): b.region for w, b in self._bindings.items() if w is not leaving}
        return list(found.values())

    def stats(self) -> list[dict[str, Any]]:
        """Return the live regions per device and lane; ``pinned_chunk_bytes`` counts the chunks copies are cut from."""
        with self._lock:
            bindings = list(self._bindings.values())
        totals: dict[tuple[str, str], dict[str, Any]] = {}
        seen: set[int] = set()
        chunks: set[int] = set()
        for binding in bindings:
            region = binding.region
            entry = totals.setdefault(
                (region.device, region.lane),
                {
                    "device": region.device,
                    "lane": region.lane,
                    "wrappers": 0,
                    "regions": 0,
                    "region_bytes": 0,
                    "pinned_bytes": 0,
                    "pinned_chunk_bytes": 0,
                    "kinds": {},
                },
            )
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


def _as_tensors_report(device: torch.device) -> torch.device:
    """Return ``device`` as a tensor on it reports it (``cuda`` -> ``cuda:<current>``, ``cpu:0`` -> ``cpu``)."""
    if device.type == "cuda":
        return resolve_device(device) if device.index is None else device
    if device.type in ("cpu", "meta") and device.index is not None:
        return torch.device(device.type)
    return device


def wrapper_regions(registry: PoolSource, pool: str = "flashinfer_int") -> WrapperRegions:
    """Return ``registry``'s :class:`WrapperRegions` (made on first use), capped by ``pools.<pool>.max_bytes``."""

    def max_bytes(device: str) -> int | None:
        try:
            return registry.spec(pool, device).max_bytes
        except ConfigError:  # the pool is not declared (yet): no cap
            return None

    return registry.state(WrapperRegions, lambda: WrapperRegions(pool, max_bytes))


def existing_regions(registry: PoolSource) -> WrapperRegions | None:
    """Return ``registry``'s :class:`WrapperRegions` if one was made (nothing is created), else ``None``."""
    return registry.peek_state(WrapperRegions)
