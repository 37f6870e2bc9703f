"""The buffers FlashInfer's wrappers allocate for themselves, counted per pool.

A FlashInfer wrapper built on a pool's float workspace also holds buffers of
its own that no public argument lets a caller supply (FlashInfer 0.7.2.post1
and 0.7.4):

- ``BatchMLAPagedAttentionWrapper``: an 8 MiB int workspace on the device and
  an 8 MiB pinned host staging copy, per wrapper (0.7.4 makes them at each
  ``plan()``; a CUDA-graph wrapper keeps its device one across replans). Its
  constructor takes only the float workspace and the graph index buffers.
- ``BatchDecodeWithPagedKVCacheWrapper`` / ``BatchPrefillWithPagedKVCacheWrapper``:
  the same two 8 MiB buffers from the constructor. ``reset_workspace_buffer(float,
  int)`` takes a device int workspace, but the int workspace holds the plan
  that ``run()`` reads, so it can be shared only by wrappers that never hold a
  live plan at once; and the pinned copy is made anew inside that call.

:func:`track_kernel_buffers` records a wrapper (weakly) against the pool whose
buffer it was built on; :func:`kernel_buffer_stats` sums, per pool, device
and lane, the tensors the live wrappers hold besides that buffer and the
caller's own index buffers: device bytes and pinned host bytes. It reads the
wrappers' attributes and nested objects one level deep, so it follows either
version's layout without naming private FlashInfer fields.

Thread semantics: thread-safe. Reading the figures does no CUDA call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from wspool.pool import WorkspacePool
    from wspool.pool_source import PoolSource

__all__ = ["KernelBufferStats", "kernel_buffer_stats", "track_kernel_buffers"]

_STATE_KEY = "kernel_buffers"


@dataclass(frozen=True)
class KernelBufferStats:
    """What the live FlashInfer wrappers built on one pool's buffer hold themselves.

    Attributes:
        pool: The pool whose buffer the wrappers use as their float workspace.
        device: The device, as a string.
        lane: The lane.
        wrappers: Live wrappers.
        device_bytes: Their own device tensors (int workspaces and the like).
        pinned_host_bytes: Their pinned host tensors (staging copies).
    """

    pool: str
    device: str
    lane: str
    wrappers: int
    device_bytes: int
    pinned_host_bytes: int


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
    totals: dict[tuple[str, str, str], list[int]] = {}
    dead = []
    buffers = {(p.spec.name, str(p.device), p.lane): p.buffer for p in registry.pools()}
    for key, (ref, pool, device, lane, supplied) in entries:
        wrapper = ref()
        if wrapper is None:
            dead.append(key)
            continue
        workspace = buffers.get((pool, device, lane))
        skip = {*supplied, *(() if workspace is None else (workspace.data_ptr(),))} - {0}
        seen: set[int] = set()
        total = totals.setdefault((pool, device, lane), [0, 0, 0])
        total[0] += 1
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
