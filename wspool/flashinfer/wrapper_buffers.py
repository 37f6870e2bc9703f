"""FlashInfer wrappers' int workspaces and pinned copies, right-sized from wspool instead of 8 MiB each.

A wrapper gets a region sized by a rule of pool ``flashinfer_int``
(:data:`INT_RULES`). Paged wrappers take it through ``reset_workspace_buffer``;
the MLA wrapper's backend takes it inside :func:`supplying`, through a
constructor hook on :data:`READ_VERSIONS` only (:func:`mla_hook_status`).
Wrappers bound with one group on one device and lane share a region; pinned
copies are never shared. Device, capture and thread semantics:
:mod:`wspool.regions`. Sizes, the hook and sharing: docs/wrapper-buffers.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from wspool.devices import describe_device
from wspool.errors import ConfigError, describe_setting
from wspool.flashinfer.backends import READ_VERSIONS  # the versions whose MLA backend constructor was read
from wspool.regions import WrapperBinding, binding_of, wrapper_regions
from wspool.registry import PoolRegistry
from wspool.rules import compile_rule
from wspool.targets import PatchSet, Target, TargetGroup

__all__ = [
    "INT_POOL",
    "INT_RULES",
    "MLA_BACKEND_CLASS",
    "MLA_HOOK",
    "READ_VERSIONS",
    "SUPPLIED",
    "SUPPLIED_BY_THREAD",
    "bind_mla_wrapper",
    "bind_paged_wrapper",
    "call_supplying",
    "declare_int_pool",
    "install_mla_hook",
    "int_bytes",
    "int_setting_of",
    "keep_flashinfer_buffers",
    "mla_hook_status",
    "paged_int_rule",
    "planner_backend",
    "supplying",
    "uninstall_mla_hook",
]

_R = TypeVar("_R")

INT_POOL = "flashinfer_int"
#: The int workspace rules. ``mla``: 9 int32 arrays of 16384 work items and 5 of one int32 per SM,
#: each 16-byte aligned. ``decode``: 2 int32 arrays of P entries, P + 1 offsets, a chunk size and
#: P split flags, P at most the batch or the planner's grid (at most 32 blocks per SM) per KV head.
#: ``prefill``: 3 int32 arrays of P, B + 1 offsets, T + 1 merge offsets and P flags, P at most the
#: grid or the query tiles (16 rows per tile at least). Every term is bounded above; see
#: docs/wrapper-buffers.md for the carves.
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
#: The binding a synchronous plan call on each thread supplies, by ``threading.get_ident()``: set by
#: :func:`call_supplying`, and by a call site that plans every step, around exactly the plan call.
#: Read before :data:`SUPPLIED`; a context variable's set and reset cost grows with the context.
#: A ``None`` entry (left once a call ends, to spare a deletion per call) supplies nothing.
SUPPLIED_BY_THREAD: dict[int, WrapperBinding | None] = {}
_hook_lock = threading.Lock()


class _IntPoolState:
    """Per registry: whether pool ``flashinfer_int`` is declared, and whether wrappers keep FlashInfer's buffers."""

    def __init__(self) -> None:
        self.declared = False
        self.keep_flashinfer = False


def keep_flashinfer_buffers(registry: PoolRegistry, keep: bool = True) -> None:
    """Let wrappers bound through ``registry`` from now on keep FlashInfer's own buffers (``keep=False`` undoes it)."""
    registry.state(_IntPoolState).keep_flashinfer = keep


def declare_int_pool(registry: PoolRegistry) -> None:
    """Declare pool ``flashinfer_int`` with :data:`INT_RULES` (once per registry; configured rules win)."""
    state = registry.state(_IntPoolState)
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
    if current is None and registry.state(_IntPoolState).keep_flashinfer:
        return None
    device = float_workspace.device
    nbytes = int_bytes(registry, rule, device, facts)
    if current is not None and current.region.nbytes >= nbytes:
        return current

    def reseat(binding: WrapperBinding) -> None:
        _reset_workspace_buffer(wrapper, float_workspace, binding.region.tensor)

    regions = wrapper_regions(registry, INT_POOL)
    return regions.bind(
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
    """Give ``wrapper`` ``int_workspace`` through ``reset_workspace_buffer``, all or nothing (docs/wrapper-buffers.md).

    A failed pinned-copy allocation would leave a larger workspace with a smaller
    copy its planner overruns, so the attributes the call changed are put back.
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
    if registry.state(_IntPoolState).keep_flashinfer or install_mla_hook() is not None:
        return None
    nbytes = int_bytes(registry, "mla", device, facts or {})
    _check_mla_bytes(registry, device, facts or {}, nbytes)
    regions = wrapper_regions(registry, INT_POOL)
    return regions.bind(
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
