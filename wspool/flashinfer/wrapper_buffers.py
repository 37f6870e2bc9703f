"""FlashInfer wrappers' int workspaces and pinned copies: right-sized regions from wspool instead of 8 MiB each.

The one home of the concept: the regions (:class:`WrapperRegions`, per registry),
their sizes (pool ``flashinfer_int``'s :data:`INT_RULES`; FlashInfer's own is
:data:`FLASHINFER_INT_DEFAULT_BYTES`), how a wrapper takes one (paged wrappers
through ``reset_workspace_buffer``, the MLA wrapper's backend inside
:func:`supplying` through a constructor hook on :data:`READ_VERSIONS` only), and
what an engine did with each wrapper it saw (:func:`bind_recorded`). Device: a
region lives on the wrapper's device, its pinned copy in page-locked host memory
(plain memory off CUDA). Capture: a region never moves, and none is allocated
while the current stream captures. Threads: binding is thread-safe and allocates
outside the lock; a supply holds for its thread or context. docs/wrapper-buffers.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from wspool.devices import describe_device, resolve_device
from wspool.errors import ConfigError, WorkspaceFrozenError, WorkspaceLimitError, describe_setting
from wspool.flashinfer.backends import READ_VERSIONS  # the versions whose MLA backend constructor was read
from wspool.freeze import cuda_capture_probe
from wspool.pool import Allocator, PoolSource, RegionsView, zeros_allocator
from wspool.registry import PoolRegistry, get_registry
from wspool.rules import compile_rule
from wspool.targets import PatchSet, Target, TargetGroup
from wspool.units import format_size, round_up

__all__ = [
    "FLASHINFER_INT_DEFAULT_BYTES",
    "INT_POOL",
    "INT_RULES",
    "MLA_BACKEND_CLASS",
    "MLA_HOOK",
    "PINNED_CHUNK_BYTES",
    "READ_VERSIONS",
    "REGION_ALIGNMENT",
    "SUPPLIED",
    "SUPPLIED_BY_THREAD",
    "IntRegion",
    "PlanOwner",
    "WrapperBinding",
    "WrapperRecord",
    "WrapperRegions",
    "bind_mla_wrapper",
    "bind_paged_wrapper",
    "bind_recorded",
    "binding_of",
    "call_supplying",
    "declare_int_pool",
    "install_mla_hook",
    "int_bytes",
    "int_setting_of",
    "keep_flashinfer_buffers",
    "mla_hook_status",
    "paged_int_rule",
    "planner_backend",
    "record_wrapper",
    "supplying",
    "uninstall_mla_hook",
    "wrapper_record",
    "wrapper_regions",
]

_R = TypeVar("_R")

INT_POOL = "flashinfer_int"
#: What FlashInfer allocates per wrapper for its int workspace (and as much again pinned) when given none.
FLASHINFER_INT_DEFAULT_BYTES = 8 * 1024 * 1024

#: Regions start on this boundary, as FlashInfer's planners assume of their int workspaces.
REGION_ALIGNMENT = 16
#: Pinned copies are carved from page-locked chunks of this size: PyTorch's pinned allocator
#: rounds every block up to a power of two, so one block per copy would nearly double them.
PINNED_CHUNK_BYTES = 4 * 1024 * 1024


class PlanOwner:
    """Which plan's metadata a region holds (``None`` before the first plan and mid-plan), seen by all its wrappers."""

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
    """What wspool gave one wrapper: its int region, its own pinned copy if any, and the sizing rule's key."""

    __slots__ = ("kind", "pinned", "region", "setting")

    def __init__(self, region: IntRegion, pinned: torch.Tensor | None, kind: str, setting: str | None = None) -> None:
        self.region, self.pinned, self.kind, self.setting = region, pinned, kind, setting


@dataclass(frozen=True)
class WrapperRecord:
    """What an engine did with a wrapper it saw: ``rule`` sized its region, or (``None``) ``why`` it has none."""

    kind: str
    rule: str | None
    facts: Mapping[str, int]
    why: str | None = None


# Every registry's bindings, and what engines did with the wrappers they saw, by ``id(wrapper)``: (a weak
# reference to the wrapper, its value). An entry leaves as its wrapper dies (the callback runs before the id can
# name another object). Engines look them up per plan call: an id key spares the weak reference a look-up makes.
_BOUND: dict[int, tuple[weakref.ref[Any], WrapperBinding]] = {}
_RECORDS: dict[int, tuple[weakref.ref[Any], WrapperRecord]] = {}
_V = TypeVar("_V")


def binding_of(wrapper: Any) -> WrapperBinding | None:
    """Return the region binding ``wrapper`` has in any registry, or ``None`` (any thread)."""
    found = _BOUND.get(id(wrapper))
    return None if found is None else found[1]


def _remember(table: dict[int, tuple[weakref.ref[Any], _V]], wrapper: Any, value: _V) -> None:
    key = id(wrapper)

    # The table is bound here, not looked up as a global: a wrapper may die at interpreter exit
    # after this module's globals were cleared, and its callback must still find the table.
    def forget(ref: weakref.ref[Any], bound: dict[int, tuple[weakref.ref[Any], _V]] = table) -> None:
        found = bound.get(key)
        if found is not None and found[0] is ref:  # not a later wrapper's entry under a reused id
            bound.pop(key, None)

    table[key] = (weakref.ref(wrapper, forget), value)


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
        self.declared = False  # pool ``pool`` is declared with INT_RULES
        self.keep_flashinfer = False  # wrappers bound from now on keep FlashInfer's own buffers

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
            _remember(_BOUND, wrapper, binding)
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
            with self._lock:  # the regions held once ``wrapper`` has moved, each once
                live = {id(b.region): b.region for w, b in self._bindings.items() if w is not wrapper}
            held = sum(r.nbytes for r in live.values() if r.device == where and r.lane == lane)
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

    def stats(self) -> list[dict[str, Any]]:
        """Return the live regions per device and lane; ``pinned_chunk_bytes`` counts the chunks copies are cut from."""
        with self._lock:
            bindings = list(self._bindings.values())
        totals: dict[tuple[str, str], dict[str, Any]] = {}
        seen: set[int] = set()
        chunks: set[int] = set()
        for binding in bindings:
            region = binding.region
            counts = dict.fromkeys(("wrappers", "regions", "region_bytes", "pinned_bytes", "pinned_chunk_bytes"), 0)
            entry = totals.setdefault(
                (region.device, region.lane), {"device": region.device, "lane": region.lane, **counts, "kinds": {}}
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


def wrapper_regions(registry: PoolSource, pool: str = INT_POOL) -> WrapperRegions:
    """Return ``registry``'s :class:`WrapperRegions` (made on first use), capped by ``pools.<pool>.max_bytes``."""

    def max_bytes(device: str) -> int | None:
        try:
            return registry.spec(pool, device).max_bytes
        except ConfigError:  # the pool is not declared (yet): no cap
            return None

    # Kept under the key accounting reads: the core cannot name this module's class.
    made = registry.state(RegionsView, lambda: WrapperRegions(pool, max_bytes))  # type: ignore[type-abstract]
    return cast(WrapperRegions, made)


# -- sizes and the per-registry switch ------------------------------------------------------

#: The int workspace rules: ``mla`` is the MLA planner's exact carve, ``decode`` and ``prefill`` bound
#: their planners' carves above (each term and how it was found: docs/wrapper-buffers.md).
INT_RULES: Mapping[str, str] = {
    "mla": "9 * 65536 + 5 * round_up(4 * sm_count, 16)",
    "decode": "13 * max(batch_size, ceil_div(32 * sm_count, num_kv_heads)) + 64",
    "prefill": (
        "13 * max(ceil_div(32 * sm_count, num_kv_heads), ceil_div(num_tokens * num_qo_heads, 16 * num_kv_heads)"
        " + batch_size) + 4 * (batch_size + num_tokens) + 128"
    ),
}
#: The FlashInfer class whose constructor makes the MLA int workspace and pinned copy.
MLA_BACKEND_CLASS = ("flashinfer.mla._batch_mla._backends._fa_common", "_BatchMLAGeneratedFaMechanics")

#: The binding whose buffers an MLA backend built in this context takes (this thread or task only),
#: set by :func:`supplying` around a plan.
SUPPLIED: contextvars.ContextVar[WrapperBinding | None] = contextvars.ContextVar("wspool_mla_supply", default=None)
#: The binding a synchronous plan call on each thread supplies (read before :data:`SUPPLIED`, whose set and
#: reset cost grows with the context), set around exactly the plan call; a ``None`` entry supplies nothing.
SUPPLIED_BY_THREAD: dict[int, WrapperBinding | None] = {}
_hook_lock = threading.Lock()


def keep_flashinfer_buffers(registry: PoolRegistry, keep: bool = True) -> None:
    """Let wrappers bound through ``registry`` from now on keep FlashInfer's own buffers (``keep=False`` undoes it)."""
    wrapper_regions(registry).keep_flashinfer = keep


def declare_int_pool(registry: PoolRegistry) -> None:
    """Declare pool ``flashinfer_int`` with :data:`INT_RULES` (once per registry; configured rules win)."""
    state = wrapper_regions(registry)
    if not state.declared:
        registry.declare_pool(INT_POOL, dict(INT_RULES))
        state.declared = True


def int_bytes(registry: PoolRegistry, rule: str, device: torch.device, facts: Mapping[str, int]) -> int:
    """Resolve int workspace ``rule`` for ``facts`` on ``device`` (its SM count is a device fact)."""
    declare_int_pool(registry)
    return registry.resolve(INT_POOL, rule, device=device, **facts)


def planner_backend(backend: str, device: torch.device) -> str:
    """Return the backend whose planner a paged wrapper built with ``backend`` plans with on ``device``.

    FlashInfer's ``"auto"`` is fa3 only on SM90, so elsewhere it is fa2; it stays
    ``"auto"`` on SM90 and on a device wspool cannot describe.
    """
    if backend != "auto":
        return backend
    description = describe_device(device)
    if description is None or description.cc_major == 9:
        return backend
    return "fa2"


def paged_int_rule(kind: str, *, use_tensor_cores: bool, backend: str, dtypes: tuple[torch.dtype, ...]) -> str | None:
    """Return the int rule of a ``"decode"`` or ``"prefill"`` wrapper's planner; ``None`` for fa3, which none bounds."""
    if kind == "decode" and not use_tensor_cores:
        return "decode"
    fp8 = {torch.float8_e4m3fn, torch.float8_e5m2} & set(dtypes)
    if backend == "fa2" or (kind == "decode" and backend == "auto" and not fp8):
        return "prefill"
    return None


# -- paged wrappers: FlashInfer's public reset_workspace_buffer -------------------------------


def bind_paged_wrapper(
    wrapper: Any,
    float_workspace: torch.Tensor,
    *,
    registry: PoolRegistry,
    rule: str,
    facts: Mapping[str, int],
    lane: str,
    kind: str,
    group: Hashable | None = None,
) -> WrapperBinding | None:
    """Give a paged decode or prefill wrapper an int region sized by ``rule``, through ``reset_workspace_buffer``.

    A region that holds the size is kept. Call it before a ``plan()``, never
    between a plan and its runs, nor after a CUDA graph captured the wrapper.
    If FlashInfer raises, the wrapper and its binding stay as they were.
    ``facts`` must bound every plan the wrapper makes. Returns the binding, or
    ``None`` where the registry keeps FlashInfer's buffers.

    Raises:
        RuleError: The rule cannot be resolved, naming the setting.
        WorkspaceFrozenError: A region would be allocated during capture.
        WorkspaceLimitError: Past ``pools.flashinfer_int.max_bytes`` or the device's memory.
    """
    current = binding_of(wrapper)
    if current is None and wrapper_regions(registry).keep_flashinfer:
        return None
    device = float_workspace.device
    nbytes = int_bytes(registry, rule, device, facts)
    if current is not None and current.region.nbytes >= nbytes:
        return current

    def reseat(binding: WrapperBinding) -> None:
        _reset_workspace_buffer(wrapper, float_workspace, binding.region.tensor)

    return wrapper_regions(registry).bind(
        wrapper,
        device=device,
        nbytes=nbytes,
        kind=kind,
        lane=lane,
        group=group,
        setting=_rule_setting(rule),
        install=reseat,
    )


def _reset_workspace_buffer(wrapper: Any, float_workspace: torch.Tensor, int_workspace: torch.Tensor) -> None:
    """Give ``wrapper`` ``int_workspace`` through ``reset_workspace_buffer``, all or nothing.

    A failed pinned-copy allocation would leave a larger workspace with a smaller copy its planner overruns.
    """
    state: dict[str, Any] | None = getattr(wrapper, "__dict__", None)
    before = dict(state) if state is not None else None
    try:
        wrapper.reset_workspace_buffer(float_workspace, int_workspace)
    except BaseException:
        if state is not None and before is not None:
            state.clear()
            state.update(before)
        raise


# -- MLA wrappers: the version-gated backend constructor hook --------------------------------


def _flashinfer_version() -> str | None:
    try:
        return str(importlib.import_module("flashinfer").__version__)
    except (ImportError, AttributeError):
        return None


def _supplied_init(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap the MLA backend constructor: inside :func:`supplying`, fill the buffers FlashInfer would allocate."""

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        binding = SUPPLIED_BY_THREAD.get(threading.get_ident()) if SUPPLIED_BY_THREAD else None
        if binding is None:
            binding = SUPPLIED.get()
        if binding is not None:
            int_buffer = kwargs.get("int_workspace_buffer")
            if int_buffer is None:
                int_buffer = kwargs["int_workspace_buffer"] = binding.region.tensor
            pinned = binding.pinned
            # The planner writes the pinned copy at the int workspace's offsets: never a smaller one.
            if (
                kwargs.get("pin_memory_int_workspace_buffer") is None
                and pinned is not None
                and pinned.numel() >= int_buffer.numel()
            ):
                kwargs["pin_memory_int_workspace_buffer"] = pinned
        original(self, *args, **kwargs)

    return init


#: The MLA backend constructor as read in every version of :data:`READ_VERSIONS`: wspool fills its
#: int workspace and pinned copy inside :func:`supplying`, and leaves every other call unchanged.
MLA_HOOK = TargetGroup(
    "FlashInfer's MLA backend constructor",
    (
        Target(
            MLA_BACKEND_CLASS[0],
            f"{MLA_BACKEND_CLASS[1]}.__init__",
            ("self", "backend", "float_workspace_buffer", "use_cuda_graph", "qo_indptr_buf", "kv_indptr_buf",
             "kv_indices_buf", "kv_len_arr_buf", "int_workspace_buffer", "pin_memory_int_workspace_buffer"),
            _supplied_init,
            f"int workspaces from pool {INT_POOL} inside supplying()",
        ),
    ),
)  # fmt: skip
_hook = PatchSet(all_or_nothing=True)
_hook_status: list[str | None] = []  # [why not] once decided; [None] when installed


def install_mla_hook() -> str | None:
    """Install the MLA backend constructor hook once, on :data:`READ_VERSIONS`; return ``None``, or why not."""
    if _hook_status:
        return _hook_status[0]
    version = _flashinfer_version()
    if version is None:
        status: str | None = "FlashInfer is not installed"
    elif version not in READ_VERSIONS:
        status = (
            f"FlashInfer {version} is not a version whose MLA backend wspool has read "
            f"({', '.join(READ_VERSIONS)}); its MLA wrappers keep FlashInfer's own 8 MiB int workspace and pinned copy"
        )
    else:
        plan = _hook.plan((MLA_HOOK,))
        status = f"FlashInfer {version}: {'; '.join(plan.not_patched)}" if plan.not_patched else None
        if status is None:
            _hook.apply(plan)  # the one attribute wspool sets on FlashInfer; a second apply does nothing
    with _hook_lock:
        if not _hook_status:
            _hook_status.append(status)
        return _hook_status[0]


def mla_hook_status() -> str:
    """Say whether MLA wrappers take wspool's int workspace, for ``wspool show`` and statistics."""
    status = install_mla_hook()
    if status is None:
        return f"MLA wrappers take int workspaces from pool {INT_POOL} (FlashInfer {_flashinfer_version()})"
    return status


def uninstall_mla_hook() -> None:
    """Restore FlashInfer's constructor and forget the decision (for tests)."""
    _hook.undo()
    _hook_status.clear()


def bind_mla_wrapper(
    wrapper: Any,
    *,
    registry: PoolRegistry,
    device: torch.device,
    lane: str,
    group: Hashable | None = None,
    facts: Mapping[str, int] | None = None,
) -> WrapperBinding | None:
    """Give a ``BatchMLAPagedAttentionWrapper`` an int region (rule ``mla``) and a pinned copy of its own.

    The wrapper takes them in its next ``plan()`` inside :func:`supplying`; bind
    before its first plan (a graph-mode wrapper keeps what it planned with).
    Returns ``None`` where the hook is not installed or the registry keeps
    FlashInfer's buffers; raises as :func:`bind_paged_wrapper`.
    """
    current = binding_of(wrapper)
    if current is not None:
        return current
    if wrapper_regions(registry).keep_flashinfer or install_mla_hook() is not None:
        return None
    nbytes = int_bytes(registry, "mla", device, facts or {})
    _check_mla_bytes(registry, device, facts or {}, nbytes)
    return wrapper_regions(registry).bind(
        wrapper,
        device=device,
        nbytes=nbytes,
        kind="mla",
        lane=lane,
        group=group,
        pinned=True,
        setting=_rule_setting("mla"),
    )


def _rule_setting(rule: str) -> str:
    return describe_setting(("pools", INT_POOL, "rules", rule))


def _check_mla_bytes(registry: PoolRegistry, device: torch.device, facts: Mapping[str, int], nbytes: int) -> None:
    """Refuse a configured ``mla`` rule below what the MLA planner always carves, before anything is allocated."""
    known = {**registry.device_facts(device), **facts}
    if "sm_count" not in known:
        return  # not a GPU wspool can describe: the planner's own check stands
    need = compile_rule(INT_RULES["mla"]).resolve(known)
    if nbytes < need:
        raise ConfigError(
            f"{_rule_setting('mla')} resolves to {nbytes} bytes on {device}, below the {need} bytes FlashInfer's MLA "
            f"planner carves there ({INT_RULES['mla']}); raise it to at least {need}",
            path=("pools", INT_POOL, "rules", "mla"),
        )


def int_setting_of(wrapper: Any) -> str | None:
    """The key of the rule that sized ``wrapper``'s region (what an int-carve overflow names), or ``None``."""
    binding = binding_of(wrapper)
    return None if binding is None else binding.setting


def call_supplying(binding: WrapperBinding | None, call: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    """Run ``call(*args, **kwargs)`` (a wrapper's plan) with ``binding`` supplied on this thread (none: as is)."""
    if binding is None:
        return call(*args, **kwargs)
    key = threading.get_ident()
    previous = SUPPLIED_BY_THREAD.get(key)
    SUPPLIED_BY_THREAD[key] = binding
    try:
        return call(*args, **kwargs)
    finally:
        SUPPLIED_BY_THREAD[key] = previous


@contextlib.contextmanager
def supplying(wrapper: Any) -> Iterator[WrapperBinding | None]:
    """Let the MLA backends ``wrapper`` builds in this block (wrap its ``plan()``) take its region and pinned copy."""
    binding = binding_of(wrapper)
    token = SUPPLIED.set(binding)
    try:
        yield binding
    finally:
        SUPPLIED.reset(token)


# -- what engines did with their wrappers ----------------------------------------------------


def wrapper_record(wrapper: Any) -> WrapperRecord | None:
    """Return what an engine did with ``wrapper`` (:func:`record_wrapper`), or ``None`` if it never saw it."""
    found = _RECORDS.get(id(wrapper))
    return None if found is None else found[1]


def record_wrapper(wrapper: Any, record: WrapperRecord) -> WrapperRecord:
    """Remember ``record`` for ``wrapper`` (held weakly; its last record wins) and return it."""
    found = _RECORDS.get(id(wrapper))
    if found is None or found[1] is not record:
        _remember(_RECORDS, wrapper, record)
    return record


def bind_recorded(
    wrapper: Any,
    float_workspace: torch.Tensor,
    *,
    kind: str,
    rule: str,
    facts: Mapping[str, int],
    lane: str,
    label: str,
) -> WrapperRecord:
    """Bind an engine's wrapper in the registry in force, on ``float_workspace``'s device; record and return it.

    Rule ``mla`` binds a ``BatchMLAPagedAttentionWrapper`` (:func:`bind_mla_wrapper`),
    another a paged wrapper (:func:`bind_paged_wrapper`, its binding named ``label``).
    A wrapper left with FlashInfer's buffers is recorded with why. Raises as they do.
    """
    registry = get_registry()
    if rule == "mla":
        binding = bind_mla_wrapper(wrapper, registry=registry, device=float_workspace.device, lane=lane)
    else:
        binding = bind_paged_wrapper(
            wrapper, float_workspace, registry=registry, rule=rule, facts=facts, lane=lane, kind=label
        )
    if binding is not None:
        return record_wrapper(wrapper, WrapperRecord(kind, rule, facts))
    kept = rule != "mla" or install_mla_hook() is None  # the hook's decision is cached
    why = "the registry keeps FlashInfer's buffers" if kept else mla_hook_status()
    return record_wrapper(wrapper, WrapperRecord(kind, None, facts, why))
