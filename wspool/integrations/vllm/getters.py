"""Pool-backed replacements for vLLM's FlashInfer workspace functions (vLLM 0.33 and 0.34).

Each function has the signature, dtype and semantics of the vLLM function it
replaces and draws its buffer from a pool of the process-wide registry through
a bound handle (:class:`~wspool.pool.WorkspaceHandle`): in the steady state a call reads the
lane and returns the buffer the handle holds. docs/vllm.md tables the
functions, pools, rules and what vLLM relies on. The MLA rules see the
engine's facts (:mod:`wspool.integrations.vllm.facts`) only where a configured
rule reads them; otherwise the wrapped call sites pass straight through.

Device semantics: the device vLLM names; the MLA workspace (vLLM's ``"cuda"``)
takes the current CUDA device when its handle binds (vLLM runs one device per
worker process). ``WSPOOL_VLLM_DEVICE`` overrides every device (tests: ``cpu``).
Lanes: vLLM's workspace lane and micro-batch select wspool lane ``main`` (or
the one :func:`wspool.lane` set) for ``(0, 0)``, else ``vllm-u<ubatch>-l<lane>``;
:func:`wrap_use_workspace_lane` keeps wspool's lane following vLLM's.
Thread semantics: thread-safe. Capture semantics: growth while vLLM's workspace
is locked or during capture raises :class:`~wspool.errors.WorkspaceFrozenError`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch

import wspool
from wspool.devices import LANES_ENTERED
from wspool.errors import RuleError, missing_facts
from wspool.integrations.patching import marked, require_own_buffers
from wspool.integrations.vllm import internals
from wspool.integrations.vllm.facts import (
    FACT_NAMES,
    ConfigFacts,
    call_facts,
    decode_kernel_shape,
    folded_kernel_shape,
    set_call_facts,
)
from wspool.integrations.vllm.internals import VllmLanes
from wspool.pool import EPOCH, WorkspaceHandle
from wspool.registry import PoolRegistry, get_registry

__all__ = [
    "DEVICE_ENV_VAR",
    "OWN_BUFFER_POOLS",
    "POOL_COUNTERS",
    "POOL_DASH",
    "POOL_DSV4",
    "POOL_MLA",
    "POOL_PAGED",
    "POOL_PAGED_COUNTERS",
    "POOL_SPARSE",
    "VLLM_POOLS",
    "VllmPools",
    "batch_invariant_mode",
    "configure",
    "current_lane",
    "get_dash_workspace",
    "get_dsv4_workspace",
    "get_mla_workspace_buffer",
    "get_multi_ctas_kv_counter_buffer",
    "get_paged_multi_ctas_kv_counter_buffer",
    "get_paged_workspace_buffer",
    "get_sparse_workspace_buffer",
    "mla_reads_call_facts",
    "served_device",
    "wrap_folded_decode",
    "wrap_forward_mqa",
    "wrap_use_workspace_lane",
]

POOL_MLA = "flashinfer_mla"
POOL_COUNTERS = "flashinfer_mla_counters"
POOL_PAGED_COUNTERS = "flashinfer_counters"
POOL_SPARSE = "flashinfer_mla_sparse"
POOL_PAGED = "flashinfer"
POOL_DSV4 = "flashinfer_dsv4"
POOL_DASH = "flashinfer_dash"

#: Pools whose buffer must be their own: their kernels keep counters in it between launches
#: (trtllm-gen's multi-CTA-KV semaphores; the DeepSeek V4 sparse kernels' split-merge counters,
#: zeroed at a workspace's first use), which another pool's kernel would overwrite.
OWN_BUFFER_POOLS = (POOL_COUNTERS, POOL_PAGED_COUNTERS, POOL_DSV4)

#: Names the device every replacement allocates on (``cpu`` in tests); read when the plugin loads.
DEVICE_ENV_VAR = "WSPOOL_VLLM_DEVICE"

#: The rules the plugin declares (below the configuration: YAML, ``WSPOOL_*`` and
#: ``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE`` override each); ``configs/vllm.yaml`` writes
#: them out. Pool ``flashinfer_mla`` keeps its configured ``default`` and ``lse``.
VLLM_POOLS: dict[str, dict[str, str]] = {
    # vLLM's default (VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE) and its batch-invariant mode's size.
    POOL_PAGED: {"vllm": "394MiB", "vllm_batch_invariant": "2GiB"},
    POOL_SPARSE: {"default": "394MiB"},
    # What vLLM asks for its largest batch; the kernel resets the counters after each launch.
    POOL_COUNTERS: {"counters": "min_bytes"},
    POOL_PAGED_COUNTERS: {"counters": "min_bytes"},
    # vLLM 0.34's constants: DeepSeek V4's sparse MLA workspace (FlashInfer: "a fixed 128 MiB buffer
    # admits every row count on every route") and DASH attention's FlashInfer prefill workspace.
    POOL_DSV4: {"default": "128MiB"},
    POOL_DASH: {"default": "128MiB"},
}

# Every fact a vLLM getter may pass: the engine's, and the counters' ``min_bytes``.
_CALL_FACTS = frozenset((*FACT_NAMES, "min_bytes"))


class _Hooks:
    """What the plugin learned from vLLM when it loaded (defaults: no vLLM)."""

    def __init__(self) -> None:
        self.device: str | None = None
        self.config_facts = ConfigFacts(None)
        self.lanes: VllmLanes = _NO_LANES
        self.batch_invariant: Callable[[], bool] = _env_batch_invariant


_NO_LANE: ContextVar[int] = ContextVar("wspool_no_vllm_lane", default=0)
_NO_LANES = VllmLanes({}, _NO_LANE.get, _NO_LANE.get)
_MAIN_LANE = wspool.current_lane()
_wspool_lane_of = wspool.current_lane

# Read by the getters' fast path as module globals: vLLM's micro-batch contexts (while wspool's lane
# follows vLLM's workspace lane, see wrap_use_workspace_lane; otherwise a non-empty dict, so every call
# takes the full path) and the two MLA handles of lane main (None until bound).
_contexts: dict[Any, Any] = _NO_LANES.contexts
_ALWAYS_FULL_PATH: dict[Any, Any] = {"vLLM's workspace lanes are not followed": True}
_lanes_followed = [False]
_main_mla: list[WorkspaceHandle | None] = [None, None]


def _env_batch_invariant() -> bool:
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() not in ("", "0", "false")


_hooks = _Hooks()


def served_device() -> str | None:
    """Return the device every getter serves on where one is set (:data:`DEVICE_ENV_VAR`), else ``None``."""
    return _hooks.device


def batch_invariant_mode() -> bool:
    """Return whether vLLM runs in batch-invariant mode (the paged pool's rule ``vllm_batch_invariant``)."""
    return bool(_hooks.batch_invariant())


class VllmPools:
    """Per registry: the plugin's pools declared and checked (made when a handle first binds there).

    Raises:
        ConfigError: A declared rule is invalid, or a pool that must own its buffer shares one.
    """

    def __init__(self, registry: PoolRegistry) -> None:
        for pool, rules in VLLM_POOLS.items():
            registry.declare_pool(pool, rules)
        require_own_buffers(
            registry, dict.fromkeys(OWN_BUFFER_POOLS, "its kernels keep counters in it between launches")
        )

    @classmethod
    def of(cls, registry: PoolRegistry) -> VllmPools:
        """Return ``registry``'s, declaring the pools on first use."""
        return registry.state(cls, lambda: cls(registry))


def configure(
    *,
    get_config: Callable[[], Any] | None = None,
    lanes: VllmLanes | None = None,
    batch_invariant: Callable[[], bool] | None = None,
    device: str | None = None,
) -> None:
    """Tell the replacements where vLLM keeps its configuration, lanes and batch-invariant flag.

    Args:
        get_config: ``vllm.config.get_current_vllm_config_or_none``.
        lanes: vLLM's workspace lanes and micro-batches (:func:`internals.lanes`); ``None``: none.
        batch_invariant: Returns ``vllm.envs.VLLM_BATCH_INVARIANT``; default: the variable itself.
        device: Overrides every device (``"cpu"`` in tests); default :data:`DEVICE_ENV_VAR`'s value.
    """
    _hooks.config_facts = ConfigFacts(get_config)
    _hooks.lanes = lanes or _NO_LANES
    _lanes_followed[0] = False
    _point_fast_path()
    _hooks.batch_invariant = batch_invariant or _env_batch_invariant
    _hooks.device = device if device is not None else (os.environ.get(DEVICE_ENV_VAR, "").strip() or None)
    for table in _TABLES:
        table.clear()
    _mla_reads[:] = [-1, True]
    _main_mla[:] = [None, None]
    _COUNTERS_MAIN.clear()
    _PAGED_COUNTERS_MAIN.clear()
    for main in (_SPARSE_MAIN, _DSV4_MAIN, _DASH_MAIN):
        main[0] = None


def _point_fast_path() -> None:
    """Let the getters' fast path read vLLM's micro-batch contexts alone where wspool's lane follows vLLM's."""
    global _contexts
    lanes = _hooks.lanes
    _contexts = lanes.contexts if lanes is _NO_LANES or _lanes_followed[0] else _ALWAYS_FULL_PATH


# Outside a micro-batch, wspool's lane inside vLLM's workspace lane ``n > 0``.
_VLLM_LANE_NAMES: dict[int, str] = {}
# Inside vLLM's workspace lanes: wspool's lane outside them all (``None`` outside them).
_OUTSIDE_VLLM_LANES: ContextVar[str | None] = ContextVar("wspool_lane_outside_vllm_lanes", default=None)


def wrap_use_workspace_lane(original: Callable[[int], Any]) -> Callable[[int], Any]:
    """Wrap vLLM's ``use_workspace_lane(lane)`` so wspool's lane follows vLLM's workspace lane.

    Inside lane ``n > 0`` wspool's lane is ``vllm-u0-l<n>``, inside lane 0 the lane outside
    every vLLM lane, so the getters' steady state reads one lane (docs/vllm.md). Thread and
    task local, as vLLM's; applying it tells the getters so.
    """

    @contextlib.contextmanager
    def use_workspace_lane(lane: int) -> Iterator[None]:
        outside = _OUTSIDE_VLLM_LANES.get()
        if lane:
            name = _VLLM_LANE_NAMES.get(lane) or _VLLM_LANE_NAMES.setdefault(lane, f"vllm-u0-l{lane}")
            token = _OUTSIDE_VLLM_LANES.set(outside if outside is not None else _wspool_lane_of())
            try:
                with original(lane), wspool.lane(name):
                    yield
            finally:
                _OUTSIDE_VLLM_LANES.reset(token)
        elif outside is not None:  # lane 0 inside another lane: the lane outside them all
            token = _OUTSIDE_VLLM_LANES.set(None)
            try:
                with original(lane), wspool.lane(outside):
                    yield
            finally:
                _OUTSIDE_VLLM_LANES.reset(token)
        else:
            with original(lane):
                yield

    _lanes_followed[0] = True
    _point_fast_path()
    return marked(use_workspace_lane, original)


_LANE_NAMES: dict[tuple[int, int], str] = {}


def _lane() -> str:
    lanes = _hooks.lanes
    lane = lanes.lane_of()
    if not lanes.contexts and not lane:
        return wspool.current_lane()
    key = (lanes.ubatch_id(), lane)
    if key == (0, 0):
        return wspool.current_lane()
    name = _LANE_NAMES.get(key)
    if name is None:
        name = _LANE_NAMES.setdefault(key, f"vllm-u{key[0]}-l{key[1]}")
    return name


def current_lane() -> str:
    """Return the wspool lane of the calling context's vLLM micro-batch and workspace lane (see the module)."""
    return _lane()


class _Handles(dict[tuple[Any, ...], WorkspaceHandle]):
    """One getter's bound handles of one pool, by (rule, device, lane); emptied by :func:`configure`."""

    def __init__(self, pool: str, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.pool = pool
        self.dtype = dtype

    def make(
        self, rule: str, device: Any, lane: str, *, facts: Mapping[str, int] | None = None, key: Any = None
    ) -> WorkspaceHandle:
        """Bind a handle (declaring the plugin's pools in the current registry) and keep it under ``key``."""
        pool = self.pool

        def bind() -> wspool.WorkspacePool:
            registry = get_registry()
            VllmPools.of(registry)
            where = device if device is not None else torch.device("cuda", torch.cuda.current_device())
            return registry.serving_pool(pool, rule, where, lane)

        handle = WorkspaceHandle(bind, rule, call_facts=_CALL_FACTS, dtype=self.dtype, facts=facts)
        return self.setdefault(key or (rule, device, lane), handle)


_MLA = _Handles(POOL_MLA, torch.int8)
_SPARSE = _Handles(POOL_SPARSE, torch.int8)
_COUNTERS = _Handles(POOL_COUNTERS)
_PAGED_COUNTERS = _Handles(POOL_PAGED_COUNTERS)
_PAGED = _Handles(POOL_PAGED)
_DSV4 = _Handles(POOL_DSV4)
_DASH = _Handles(POOL_DASH)
_TABLES = (_MLA, _SPARSE, _COUNTERS, _PAGED_COUNTERS, _PAGED, _DSV4, _DASH)


def _facts() -> Mapping[str, int]:
    """The facts of this call: the wrapped call site's (the kernel's shape), else the widest configured."""
    at_call = call_facts()
    if at_call is not None:
        return at_call
    return _hooks.config_facts.widest()


def _missing(exc: RuleError, facts: Mapping[str, int]) -> RuleError:
    return missing_facts(exc, "the vLLM plugin", facts, FACT_NAMES, "vLLM's configuration gives them, see docs/vllm.md")


def _mla_handle(return_lse: bool) -> WorkspaceHandle:
    lane = _lane()
    rule = "lse" if return_lse else "default"
    found = _MLA.get((rule, _hooks.device, lane))
    if found is None:
        found = _MLA.make(rule, _hooks.device, lane)
    if lane == _MAIN_LANE:
        _main_mla[return_lse] = found
    return found


# (the epoch it was decided in, whether the MLA rules read the call sites' facts): the wrappers' one test.
_mla_reads: list[Any] = [-1, True]


def mla_reads_call_facts() -> bool:
    """Whether the MLA rules (``lse``, ``default``) read a fact the wrapped call sites record.

    Decided once per workspace epoch (configuration, growth), not per call.
    """
    if _mla_reads[0] == EPOCH[0]:
        return bool(_mla_reads[1])
    epoch = EPOCH[0]
    reads = _mla_handle(True).current_reads_call_facts() or _mla_handle(False).current_reads_call_facts()
    _mla_reads[:] = [epoch, reads]
    return reads


def get_mla_workspace_buffer(return_lse: bool) -> torch.Tensor:
    """Return FlashInfer MLA's workspace: pool ``flashinfer_mla``, rule ``lse`` or ``default``, as ``int8``.

    Replaces ``flashinfer_mla._get_workspace_buffer``: a zero-filled view on the current
    CUDA device, the same tensor while the buffer suffices.

    Raises:
        RuleError: The rule reads a fact vLLM did not give (named in the message).
        WorkspaceFrozenError: It would have to grow while vLLM's workspace is locked, or during capture.
    """
    # The steady state (no micro-batch, vLLM's lane 0, wspool's lane main): the handle's, written out.
    in_main = not _contexts and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE)
    handle = _main_mla[return_lse] if in_main else None
    if handle is not None:
        buffer = handle.steady()
        if buffer is not None:
            return buffer
    else:
        handle = _mla_handle(return_lse)
    try:
        return handle.fetch(_facts)
    except RuleError as exc:
        raise _missing(exc, _facts()) from exc


def get_multi_ctas_kv_counter_buffer(min_bytes: int, device: torch.device) -> torch.Tensor:
    """Return trtllm-gen's multi-CTA-KV counters: pool ``flashinfer_mla_counters``, rule ``counters``.

    Replaces ``flashinfer_mla._get_multi_ctas_kv_counter_buffer``: a ``uint8`` buffer of at
    least ``min_bytes`` on ``device``, zeroed once when allocated (the kernel resets its
    semaphores after every launch), the same tensor while it suffices.

    Raises:
        WorkspaceFrozenError: It would have to grow while locked or capturing.
    """
    if not _contexts and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE):
        found = _COUNTERS_MAIN.get(min_bytes)
        if found is not None and found[1] == device:
            handle = found[0]
            buffer = handle.steady()
            return buffer if buffer is not None else handle.get()
    return _counters(_COUNTERS, min_bytes, device)


def get_paged_multi_ctas_kv_counter_buffer(min_bytes: int, device: torch.device) -> torch.Tensor:
    """Return trtllm-gen's paged-attention counters (pool ``flashinfer_counters``), as the MLA ones."""
    if not _contexts and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE):
        found = _PAGED_COUNTERS_MAIN.get(min_bytes)
        if found is not None and found[1] == device:
            handle = found[0]
            buffer = handle.steady()
            return buffer if buffer is not None else handle.get()
    return _counters(_PAGED_COUNTERS, min_bytes, device)


def _counters(table: _Handles, min_bytes: int, device: torch.device) -> torch.Tensor:
    """The counters' full path: bind the calling lane's handle for ``min_bytes`` (the getters inline the rest)."""
    where = _hooks.device or device
    lane = _lane()
    # vLLM passes its largest batch's size, the same every step: a handle per size, the size bound to it.
    key = (f"counters {min_bytes}", where, lane)
    handle = table.get(key)
    if handle is None:
        handle = table.make("counters", where, lane, facts={"min_bytes": min_bytes}, key=key)
    if lane == _MAIN_LANE:
        _MAIN_BY_POOL[table.pool][min_bytes] = (handle, device)
    return handle.get()


# min_bytes -> the lane-main handle of that size and vLLM's device: the counters' steady state.
_COUNTERS_MAIN: dict[int, tuple[WorkspaceHandle, Any]] = {}
_PAGED_COUNTERS_MAIN: dict[int, tuple[WorkspaceHandle, Any]] = {}
_MAIN_BY_POOL = {POOL_COUNTERS: _COUNTERS_MAIN, POOL_PAGED_COUNTERS: _PAGED_COUNTERS_MAIN}


def get_sparse_workspace_buffer(device: torch.device, min_bytes: int | None = None) -> torch.Tensor:
    """Return sparse FlashInfer MLA's workspace: pool ``flashinfer_mla_sparse``, rule ``default``, as ``int8``.

    Replaces ``flashinfer_mla_sparse._get_workspace_buffer``: the rule's size with
    ``min_bytes`` as a floor, zero-filled, the same tensor while the buffer suffices.
    """
    found = _SPARSE_MAIN[0]
    in_main = not _contexts and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE)
    buffer = None
    if in_main and found is not None and found[1] == device:
        handle = found[0]
        buffer = handle.steady()
    else:
        handle = _device_handle(_SPARSE, _SPARSE_MAIN, device)
    if buffer is None:
        try:
            buffer = handle.fetch(_facts)
        except RuleError as exc:
            raise _missing(exc, _facts()) from exc
    if min_bytes is not None and min_bytes > buffer.numel():
        handle.pool.request(min_bytes, "min_bytes")
        buffer = handle()
    return buffer


def get_paged_workspace_buffer(builder: Any, prefill_bytes_per_elem: int | None = None) -> torch.Tensor:
    """Return vLLM's FlashInfer attention workspace: pool ``flashinfer``, rule ``vllm`` (or batch-invariant).

    Replaces ``FlashInferMetadataBuilder._get_workspace_buffer``: made on the first call
    on ``builder.device`` and kept on ``builder``, so vLLM's ``set_workspace_buffer`` still
    shares it. ``prefill_bytes_per_elem`` (vLLM's constant) sets vLLM's prefill floor,
    ``max_num_batched_tokens * num_qo_heads * head_dim`` times it, except in batch-invariant
    mode (rule ``vllm_batch_invariant``, 2 GiB), as in vLLM.
    """
    buffer: torch.Tensor | None = internals.builder_workspace(builder)
    if buffer is None:
        lane = _lane()
        device = _hooks.device or builder.device
        if _hooks.batch_invariant():
            buffer = _PAGED.make("vllm_batch_invariant", device, lane)()
        else:
            handle = _PAGED.make("vllm", device, lane)
            buffer = handle()
            floor = _prefill_floor(builder, prefill_bytes_per_elem)
            if floor > buffer.numel():
                buffer = handle.pool.request(floor, "vLLM's prefill floor")
        internals.set_builder_workspace(builder, buffer)
    return buffer


def _prefill_floor(builder: Any, bytes_per_elem: int | None) -> int:
    if bytes_per_elem is None:
        return 0
    try:
        return int(builder.max_num_batched_tokens * builder.num_qo_heads * builder.head_dim * bytes_per_elem)
    except (AttributeError, TypeError):  # a builder without these attributes: the rule alone
        return 0


def _device_getter(
    table: _Handles, main: list[tuple[WorkspaceHandle, Any] | None], name: str, doc: str
) -> Callable[[torch.device], torch.Tensor]:
    """A getter of ``table``'s rule ``default`` on the device vLLM names, its steady state written out."""

    def get_workspace(device: torch.device) -> torch.Tensor:
        found = main[0]
        if (
            found is not None
            and found[1] == device
            and not _contexts
            and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE)
        ):
            buffer = found[0].steady()
            if buffer is not None:
                return buffer
        return _device_handle(table, main, device).get()

    get_workspace.__name__ = get_workspace.__qualname__ = name
    get_workspace.__doc__ = doc
    return get_workspace


def _device_handle(table: _Handles, main: list[tuple[WorkspaceHandle, Any] | None], device: Any) -> WorkspaceHandle:
    """Bind the calling lane's handle of ``table``'s rule ``default`` on ``device``, kept in ``main`` for lane main."""
    where = _hooks.device or device
    lane = _lane()
    handle = table.get(("default", where, lane))
    if handle is None:
        handle = table.make("default", where, lane)
    if lane == _MAIN_LANE:
        main[0] = (handle, device)
    return handle


# The lane-main handle and vLLM's device of each getter that takes a device: its steady state.
_SPARSE_MAIN: list[tuple[WorkspaceHandle, Any] | None] = [None]
_DSV4_MAIN: list[tuple[WorkspaceHandle, Any] | None] = [None]
_DASH_MAIN: list[tuple[WorkspaceHandle, Any] | None] = [None]

get_dsv4_workspace = _device_getter(
    _DSV4,
    _DSV4_MAIN,
    "get_dsv4_workspace",
    """Return DeepSeek V4's FlashInfer sparse MLA workspace: pool ``flashinfer_dsv4``, rule ``default``.

    Replaces vLLM's ``get_flashinfer_dsv4_workspace(device)`` (docs/vllm.md). The kernels
    keep split-merge counters in it, so the buffer is the pool's own (:data:`OWN_BUFFER_POOLS`),
    zeroed once when allocated, and the same ``uint8`` tensor while it suffices.

    Raises:
        ConfigError: The pool is configured to share another pool's buffer.
        WorkspaceFrozenError: It would have to grow while locked or capturing.
    """,
)
get_dash_workspace = _device_getter(
    _DASH,
    _DASH_MAIN,
    "get_dash_workspace",
    """Return DASH attention's FlashInfer prefill workspace: pool ``flashinfer_dash``, rule ``default``.

    Replaces vLLM 0.34's ``dash_attention._workspace(device)`` (docs/vllm.md): a zero-filled
    ``uint8`` buffer of the rule's size; each FlashInfer wrapper keeps the tensor it was built
    with, so the memory stays valid for its captured graphs if the pool grows later.
    """,
)


def wrap_forward_mqa(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FlashInferMLAImpl.forward_mqa`` so the MLA rules see the shape of the query the kernel gets.

    The wrapper passes straight through unless a configured MLA rule reads the call's
    facts; then it records, for this thread and the call's duration, the kernel call's
    facts (:func:`~wspool.integrations.vllm.facts.decode_kernel_shape`, at the configured
    maximum of that layout; the widest facts where the metadata cannot be read).
    """

    def forward_mqa(self: Any, q: Any, kv_c_and_k_pe_cache: Any, attn_metadata: Any, layer: Any) -> Any:
        if (not _mla_reads[1] and _mla_reads[0] == EPOCH[0]) or not mla_reads_call_facts():
            return original(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)
        query = q[0] if isinstance(q, tuple) else q
        cp_world = getattr(self, "dcp_world_size", 1) or 1
        tokens, heads = query.shape[0], query.shape[-2]
        config_facts = _hooks.config_facts
        shape = decode_kernel_shape(tokens, heads, cp_world, attn_metadata)
        if shape is None:
            facts: Mapping[str, int] = {
                **config_facts.widest(),
                "q_heads": heads,
                "num_heads": max(1, heads // cp_world),
                "cp_world": cp_world,
            }
        else:
            facts = config_facts.for_kernel(shape)
        previous = set_call_facts(facts)
        try:
            return original(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)
        finally:
            set_call_facts(previous)

    return marked(forward_mqa, original)


def _is_mla_view(workspace: object) -> bool:
    """Whether ``workspace`` is a view :func:`get_mla_workspace_buffer` returned (not a buffer of vLLM's own)."""
    if not isinstance(workspace, torch.Tensor):
        return False
    address = workspace.data_ptr()
    return any(
        buffer is not None and buffer.data_ptr() == address for buffer in (h.pool.buffer for h in list(_MLA.values()))
    )


def wrap_folded_decode(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Kimi K3's draft ``folded_decode`` so its MLA workspace is sized for the folded query.

    vLLM 0.34's drafter folds ``fold`` query tokens of a request into each row's heads
    (``fold`` from vLLM's ``fold_plan``). Where ``workspace`` is the ``flashinfer_mla``
    pool's and a rule reads the call's facts, the pool is asked again with the folded
    kernel's facts and that buffer passed on; a buffer of vLLM's own goes through
    unchanged (docs/vllm.md).
    """
    fold_plan = getattr(original, "__globals__", {}).get("fold_plan")

    def _fold(tokens_per_request: int, heads: int, need_lse: bool) -> int:
        if not need_lse:
            return tokens_per_request
        try:
            return int(fold_plan(tokens_per_request, heads, True, False)[0])  # type: ignore[misc]
        except Exception:  # no plan vLLM could use either: one token per row is never smaller for the rules
            return 1

    def folded_decode(
        q: Any,
        kv_cache: Any,
        block_table: Any,
        seq_lens: Any,
        max_seq_len: Any,
        tokens_per_request: int,
        *,
        workspace: Any,
        return_lse: bool = False,
        dcp_world_size: int = 1,
        **kwargs: Any,
    ) -> Any:
        if mla_reads_call_facts() and _is_mla_view(workspace):
            cp_world = dcp_world_size or 1
            tokens, heads = q.shape[0], q.shape[-2]
            fold = _fold(tokens_per_request, heads, return_lse or cp_world > 1)
            shape = folded_kernel_shape(tokens, heads, cp_world, fold)
            previous = set_call_facts(_hooks.config_facts.for_kernel(shape))
            try:
                workspace = get_mla_workspace_buffer(return_lse)
            finally:
                set_call_facts(previous)
        return original(
            q,
            kv_cache,
            block_table,
            seq_lens,
            max_seq_len,
            tokens_per_request,
            workspace=workspace,
            return_lse=return_lse,
            dcp_world_size=dcp_world_size,
            **kwargs,
        )

    return marked(folded_decode, original)
