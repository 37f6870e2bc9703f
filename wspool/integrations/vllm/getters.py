"""Pool-backed replacements for vLLM's FlashInfer workspace functions (vLLM 0.33 and 0.34).

:class:`VllmGetters` holds them: each has the signature, dtype and semantics
of the vLLM function it replaces and draws its buffer from a pool of the
process-wide registry through a bound handle
(:class:`~wspool.pool.WorkspaceHandle`): in the steady state a call reads the
lane and calls the handle's steady state. docs/vllm.md tables the
functions, pools, rules and what vLLM relies on. The MLA rules see the
engine's facts (:mod:`wspool.integrations.vllm.facts`) only where a configured
rule reads them; otherwise the wrapped call sites pass straight through.

Device semantics: the device vLLM names; the MLA workspace (vLLM's ``"cuda"``)
takes the current CUDA device when its handle binds (vLLM runs one device per
worker process). ``WSPOOL_VLLM_DEVICE`` overrides every device (tests: ``cpu``).
Lanes: vLLM's workspace lane and micro-batch select wspool lane ``main`` (or
the one :func:`wspool.lane` set) for ``(0, 0)``, else ``vllm-u<ubatch>-l<lane>``;
:attr:`VllmGetters.wrap_use_workspace_lane` keeps wspool's lane following vLLM's.
Thread semantics: thread-safe. Capture semantics: growth while vLLM's workspace
is locked or during capture raises :class:`~wspool.errors.WorkspaceFrozenError`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType
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
    "VllmGetters",
    "VllmPools",
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
VLLM_POOLS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
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
)

# Every fact a vLLM getter may pass: the engine's, and the counters' ``min_bytes``.
_CALL_FACTS = frozenset((*FACT_NAMES, "min_bytes"))


_NO_LANE: ContextVar[int] = ContextVar("wspool_no_vllm_lane", default=0)
_NO_LANES = VllmLanes(MappingProxyType({}), _NO_LANE.get, _NO_LANE.get)  # type: ignore[arg-type]
_MAIN_LANE = wspool.current_lane()
_wspool_lane_of = wspool.current_lane
# What the getters' fast path reads in place of vLLM's micro-batch contexts where wspool's lane does not
# follow vLLM's workspace lane: never empty, so every call takes the full path.
_ALWAYS_FULL_PATH: Mapping[str, bool] = MappingProxyType({"vLLM's workspace lanes are not followed": True})
# Inside vLLM's workspace lanes: wspool's lane outside them all (``None`` outside them).
_OUTSIDE_VLLM_LANES: ContextVar[str | None] = ContextVar("wspool_lane_outside_vllm_lanes", default=None)


def _env_batch_invariant() -> bool:
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() not in ("", "0", "false")


def _never() -> None:
    return None  # the steady state of a getter whose lane-main handle has not served yet


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


class _Handles(dict[tuple[Any, ...], WorkspaceHandle]):
    """One getter's bound handles of one pool, by (rule, device, lane), each serving the registry in force."""

    def __init__(self, pool: str, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.pool = pool
        self.dtype = dtype

    def make(
        self, rule: str, device: Any, lane: str, *, facts: Mapping[str, int] | None = None, key: Any = None
    ) -> WorkspaceHandle:
        """Return the handle kept under ``key`` (default ``(rule, device, lane)``), binding it on first use."""
        key = key or (rule, device, lane)
        found = self.get(key)
        if found is not None:
            return found
        pool = self.pool

        def bind() -> wspool.WorkspacePool:
            registry = get_registry()
            VllmPools.of(registry)
            where = device if device is not None else torch.device("cuda", torch.cuda.current_device())
            return registry.serving_pool(pool, rule, where, lane)

        handle = WorkspaceHandle(bind, rule, call_facts=_CALL_FACTS, dtype=self.dtype, facts=facts)
        return self.setdefault(key, handle)


class VllmGetters:
    """vLLM's replacements for one activation of the plugin, and the state they share.

    :class:`~wspool.integrations.vllm.VllmIntegration` makes one when it activates,
    with vLLM's hooks, and installs its functions; it drops it when it deactivates. The
    replacements are closures made here: their steady state (lane main, no micro-batch)
    reads the lane-main handles' steady calls from the closures' cells, which is
    cheaper on vLLM's per-layer path than an attribute or a module global.

    Args:
        get_config: ``vllm.config.get_current_vllm_config_or_none``.
        lanes: vLLM's workspace lanes and micro-batches (:func:`internals.lanes`); ``None``: none.
        batch_invariant: Returns ``vllm.envs.VLLM_BATCH_INVARIANT``; default: the variable itself.
        device: Overrides every device (``"cpu"`` in tests); default :data:`DEVICE_ENV_VAR`'s value.
    """

    #: FlashInfer MLA's ``_get_workspace_buffer(return_lse)``.
    get_mla_workspace_buffer: Callable[[bool], torch.Tensor]
    #: FlashInfer MLA's ``_get_multi_ctas_kv_counter_buffer(min_bytes, device)``.
    get_multi_ctas_kv_counter_buffer: Callable[[int, torch.device], torch.Tensor]
    #: The paged backend's ``_get_multi_ctas_kv_counter_buffer(min_bytes, device)``.
    get_paged_multi_ctas_kv_counter_buffer: Callable[[int, torch.device], torch.Tensor]
    #: Sparse FlashInfer MLA's ``_get_workspace_buffer(device, min_bytes=None)``.
    get_sparse_workspace_buffer: Callable[..., torch.Tensor]
    #: DeepSeek V4's ``get_flashinfer_dsv4_workspace(device)``.
    get_dsv4_workspace: Callable[[torch.device], torch.Tensor]
    #: DASH attention's ``_workspace(device)``.
    get_dash_workspace: Callable[[torch.device], torch.Tensor]
    #: Whether the MLA rules read a fact the wrapped call sites record (decided once per epoch).
    mla_reads_call_facts: Callable[[], bool]
    #: Wraps ``FlashInferMLAImpl.forward_mqa``: the MLA rules see the kernel's shape where they read it.
    wrap_forward_mqa: Callable[[Callable[..., Any]], Callable[..., Any]]
    #: Wraps Kimi K3's draft ``folded_decode``: its MLA workspace sized for the folded query where a rule reads it.
    wrap_folded_decode: Callable[[Callable[..., Any]], Callable[..., Any]]
    #: Wraps vLLM's ``use_workspace_lane``: wspool's lane follows vLLM's workspace lane.
    wrap_use_workspace_lane: Callable[[Callable[[int], Any]], Callable[[int], Any]]
    #: The wspool lane of the calling context's vLLM micro-batch and workspace lane (see the module).
    current_lane: Callable[[], str]

    def __init__(
        self,
        *,
        get_config: Callable[[], Any] | None = None,
        lanes: VllmLanes | None = None,
        batch_invariant: Callable[[], bool] | None = None,
        device: str | None = None,
    ) -> None:
        self.device: str | None = device if device is not None else (os.environ.get(DEVICE_ENV_VAR, "").strip() or None)
        self.config_facts = ConfigFacts(get_config)
        self.lanes: VllmLanes = lanes or _NO_LANES
        self.batch_invariant: Callable[[], bool] = batch_invariant or _env_batch_invariant
        self.mla = _Handles(POOL_MLA, torch.int8)
        self.paged = _Handles(POOL_PAGED)
        _make_replacements(self)

    def served_device(self) -> str | None:
        """Return the device every getter serves on where one is set (:data:`DEVICE_ENV_VAR`), else ``None``."""
        return self.device

    def batch_invariant_mode(self) -> bool:
        """Return whether vLLM runs in batch-invariant mode (the paged pool's rule ``vllm_batch_invariant``)."""
        return bool(self.batch_invariant())

    def facts(self) -> Mapping[str, int]:
        """The facts of this call: the wrapped call site's (the kernel's shape), else the widest configured."""
        at_call = call_facts()
        if at_call is not None:
            return at_call
        return self.config_facts.widest()

    def missing(self, exc: RuleError) -> RuleError:
        """The error for an MLA rule that reads a fact vLLM did not give, naming it."""
        known = FACT_NAMES
        return missing_facts(
            exc, "the vLLM plugin", self.facts(), known, "vLLM's configuration gives them, see docs/vllm.md"
        )

    def get_paged_workspace_buffer(self, builder: Any, prefill_bytes_per_elem: int | None = None) -> torch.Tensor:
        """Return vLLM's FlashInfer attention workspace: pool ``flashinfer``, rule ``vllm`` (or batch-invariant).

        Replaces ``FlashInferMetadataBuilder._get_workspace_buffer``: made on the first call
        on ``builder.device`` and kept on ``builder``, so vLLM's ``set_workspace_buffer`` still
        shares it. ``prefill_bytes_per_elem`` (vLLM's constant) sets vLLM's prefill floor,
        ``max_num_batched_tokens * num_qo_heads * head_dim`` times it, except in batch-invariant
        mode (rule ``vllm_batch_invariant``, 2 GiB), as in vLLM.
        """
        buffer: torch.Tensor | None = internals.builder_workspace(builder)
        if buffer is None:
            lane = self.current_lane()
            device = self.device or builder.device
            if self.batch_invariant():
                buffer = self.paged.make("vllm_batch_invariant", device, lane)()
            else:
                handle = self.paged.make("vllm", device, lane)
                buffer = handle()
                floor = _prefill_floor(builder, prefill_bytes_per_elem)
                if floor > buffer.numel():
                    buffer = handle.pool.request(floor, "vLLM's prefill floor")
            internals.set_builder_workspace(builder, buffer)
        return buffer

    def is_mla_view(self, workspace: object) -> bool:
        """Whether ``workspace`` is a view :attr:`get_mla_workspace_buffer` returned (not a buffer of vLLM's own)."""
        if not isinstance(workspace, torch.Tensor):
            return False
        address = workspace.data_ptr()
        buffers = (handle.pool.buffer for handle in list(self.mla.values()))
        return any(buffer is not None and buffer.data_ptr() == address for buffer in buffers)


def _prefill_floor(builder: Any, bytes_per_elem: int | None) -> int:
    if bytes_per_elem is None:
        return 0
    try:
        return int(builder.max_num_batched_tokens * builder.num_qo_heads * builder.head_dim * bytes_per_elem)
    except (AttributeError, TypeError):  # a builder without these attributes: the rule alone
        return 0


def _make_replacements(getters: VllmGetters) -> None:
    """Make ``getters``' per-layer replacements: closures whose cells hold the state of their steady state.

    Shared cells: ``contexts`` (vLLM's micro-batch contexts while wspool's lane follows
    vLLM's workspace lane, else a mapping never empty, so every call takes the full path)
    and the MLA decision of :attr:`VllmGetters.mla_reads_call_facts`. Each getter keeps its lane-main
    handle's steady call (a miss until that handle served) and, where vLLM passes them,
    the device and size it was bound for.
    """
    hooks = getters.lanes
    lanes_followed = False
    contexts: Mapping[Any, Any] = hooks.contexts
    lane_of, ubatch_id, vllm_contexts = hooks.lane_of, hooks.ubatch_id, hooks.contexts
    served_device = getters.device
    config_facts = getters.config_facts
    facts_of = getters.facts
    lane_names: dict[tuple[int, int], str] = {}
    vllm_lane_names: dict[int, str] = {}

    def point_fast_path() -> None:
        nonlocal contexts
        contexts = hooks.contexts if hooks is _NO_LANES or lanes_followed else _ALWAYS_FULL_PATH

    point_fast_path()

    def current_lane() -> str:
        lane = lane_of()
        if not vllm_contexts and not lane:
            return _wspool_lane_of()
        key = (ubatch_id(), lane)
        if key == (0, 0):
            return _wspool_lane_of()
        name = lane_names.get(key)
        if name is None:
            name = lane_names.setdefault(key, f"vllm-u{key[0]}-l{key[1]}")
        return name

    # -- FlashInfer MLA's workspace, and whether its rules read the call sites' facts --------------

    mla = getters.mla
    steady_lse: Callable[[], torch.Tensor | None] = _never
    steady_plain: Callable[[], torch.Tensor | None] = _never
    mla_epoch = -1  # the epoch mla_reads was decided in
    mla_reads = True

    def get_mla_workspace_buffer(return_lse: bool) -> torch.Tensor:
        """Return FlashInfer MLA's workspace: pool ``flashinfer_mla``, rule ``lse`` or ``default``, as ``int8``.

        Replaces ``flashinfer_mla._get_workspace_buffer``: a zero-filled view on the current
        CUDA device, the same tensor while the buffer suffices.

        Raises:
            RuleError: The rule reads a fact vLLM did not give (named in the message).
            WorkspaceFrozenError: It would have to grow while vLLM's workspace is locked, or during capture.
        """
        if not contexts and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE):
            if return_lse:
                buffer = steady_lse()
                if buffer is not None:
                    return buffer
            else:
                buffer = steady_plain()
                if buffer is not None:
                    return buffer
        return mla_full_path(return_lse)

    def mla_full_path(return_lse: bool) -> torch.Tensor:
        nonlocal steady_lse, steady_plain
        lane = current_lane()
        handle = mla.make("lse" if return_lse else "default", served_device, lane)
        try:
            buffer = handle.fetch(facts_of)
        except RuleError as exc:
            raise getters.missing(exc) from exc
        if lane == _MAIN_LANE:
            if return_lse:
                steady_lse = handle.held
            else:
                steady_plain = handle.held
        return buffer

    def mla_reads_call_facts() -> bool:
        nonlocal mla_epoch, mla_reads
        if mla_epoch == EPOCH[0]:
            return mla_reads
        epoch = EPOCH[0]
        lane = current_lane()
        reads = any(mla.make(rule, served_device, lane).current_reads_call_facts() for rule in ("lse", "default"))
        mla_reads, mla_epoch = reads, epoch
        return reads

    def wrap_forward_mqa(original: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``FlashInferMLAImpl.forward_mqa`` so the MLA rules see the shape of the query the kernel gets.

        The wrapper passes straight through unless a configured MLA rule reads the call's
        facts; then it records, for this thread and the call's duration, the kernel call's
        facts (:func:`~wspool.integrations.vllm.facts.decode_kernel_shape`, at the configured
        maximum of that layout; the widest facts where the metadata cannot be read).
        """

        def forward_mqa(self: Any, q: Any, kv_c_and_k_pe_cache: Any, attn_metadata: Any, layer: Any) -> Any:
            if (not mla_reads and mla_epoch == EPOCH[0]) or not mla_reads_call_facts():
                return original(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)
            query = q[0] if isinstance(q, tuple) else q
            cp_world = getattr(self, "dcp_world_size", 1) or 1
            tokens, heads = query.shape[0], query.shape[-2]
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

    def wrap_folded_decode(original: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap Kimi K3's draft ``folded_decode`` so its MLA workspace is sized for the folded query.

        vLLM 0.34's drafter folds ``fold`` query tokens of a request into each row's heads
        (``fold`` from vLLM's ``fold_plan``). Where ``workspace`` is the ``flashinfer_mla``
        pool's and a rule reads the call's facts, the pool is asked again with the folded
        kernel's facts and that buffer passed on; a buffer of vLLM's own goes through
        unchanged (docs/vllm.md). Otherwise the call passes straight through.
        """
        fold_plan = getattr(original, "__globals__", {}).get("fold_plan")

        def _fold(tokens_per_request: int, heads: int, need_lse: bool) -> int:
            if not need_lse:
                return tokens_per_request
            try:
                return int(fold_plan(tokens_per_request, heads, True, False)[0])  # type: ignore[misc]
            except Exception:  # no plan vLLM could use either: one token per row is never smaller for the rules
                return 1

        def folded_decode(*args: Any, **kwargs: Any) -> Any:
            if (not mla_reads and mla_epoch == EPOCH[0]) or not mla_reads_call_facts():
                return original(*args, **kwargs)
            if getters.is_mla_view(kwargs.get("workspace")):  # keyword-only in vLLM, as the rest read here
                q = args[0] if args else kwargs["q"]
                tokens_per_request = args[5] if len(args) > 5 else kwargs["tokens_per_request"]
                return_lse = bool(kwargs.get("return_lse", False))
                cp_world = kwargs.get("dcp_world_size", 1) or 1
                tokens, heads = q.shape[0], q.shape[-2]
                fold = _fold(tokens_per_request, heads, return_lse or cp_world > 1)
                shape = folded_kernel_shape(tokens, heads, cp_world, fold)
                previous = set_call_facts(config_facts.for_kernel(shape))
                try:
                    kwargs["workspace"] = get_mla_workspace_buffer(return_lse)
                finally:
                    set_call_facts(previous)
            return original(*args, **kwargs)

        return marked(folded_decode, original)

    # -- trtllm-gen's counters: vLLM passes its largest batch's size, the same every step ----------

    def counters_getter(pool: str, name: str, doc: str) -> Callable[[int, torch.device], torch.Tensor]:
        table = _Handles(pool)
        # The lane-main handle last served: (min_bytes, vLLM's device, its steady call), replaced as one.
        main: tuple[int | None, Any, Callable[[], torch.Tensor | None]] = (None, None, _never)

        def get_counters(min_bytes: int, device: torch.device) -> torch.Tensor:
            main_min_bytes, main_device, steady = main
            if (
                min_bytes == main_min_bytes
                and device == main_device
                and not contexts
                and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE)
            ):
                buffer = steady()
                if buffer is not None:
                    return buffer
            return full_path(min_bytes, device)

        def full_path(min_bytes: int, device: torch.device) -> torch.Tensor:
            nonlocal main
            where = served_device or device
            lane = current_lane()
            # A handle per size, the size bound to it.
            handle = table.make("counters", where, lane, facts={"min_bytes": min_bytes}, key=(min_bytes, where, lane))
            buffer = handle.get()
            if lane == _MAIN_LANE:
                main = (min_bytes, device, handle.held)
            return buffer

        get_counters.__name__ = get_counters.__qualname__ = name
        get_counters.__doc__ = doc
        return get_counters

    # -- the getters that take vLLM's device -------------------------------------------------------

    def device_getter(pool: str, dtype: torch.dtype | None, name: str, doc: str) -> Callable[..., torch.Tensor]:
        table = _Handles(pool, dtype)
        # The lane-main handle last bound: (vLLM's device, its steady call), replaced as one.
        main: tuple[Any, Callable[[], torch.Tensor | None]] = (None, _never)

        def bound(device: torch.device) -> WorkspaceHandle:
            nonlocal main
            lane = current_lane()
            handle = table.make("default", served_device or device, lane)
            if lane == _MAIN_LANE:
                main = (device, handle.held)
            return handle

        def full_path(device: torch.device) -> torch.Tensor:
            handle = bound(device)
            try:
                return handle.fetch(facts_of)
            except RuleError as exc:
                raise getters.missing(exc) from exc

        def get_workspace(device: torch.device) -> torch.Tensor:
            main_device, steady = main
            if device == main_device and not contexts and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE):
                buffer = steady()
                if buffer is not None:
                    return buffer
            return full_path(device)

        def get_sparse(device: torch.device, min_bytes: int | None = None) -> torch.Tensor:
            main_device, steady = main
            buffer = None
            if device == main_device and not contexts and (not LANES_ENTERED[0] or _wspool_lane_of() is _MAIN_LANE):
                buffer = steady()
            if buffer is None:
                buffer = full_path(device)
            if min_bytes is not None and min_bytes > buffer.numel():  # a floor: ask the pool for it
                handle = bound(device)
                handle.pool.request(min_bytes, "min_bytes")
                return handle()
            return buffer

        getter = get_sparse if pool == POOL_SPARSE else get_workspace
        getter.__name__ = getter.__qualname__ = name
        getter.__doc__ = doc
        return getter

    # -- wspool's lane following vLLM's workspace lane ---------------------------------------------

    def wrap_use_workspace_lane(original: Callable[[int], Any]) -> Callable[[int], Any]:
        """Wrap vLLM's ``use_workspace_lane(lane)`` so wspool's lane follows vLLM's workspace lane.

        Inside lane ``n > 0`` wspool's lane is ``vllm-u0-l<n>``, inside lane 0 the lane outside
        every vLLM lane, so the getters' steady state reads one lane (docs/vllm.md). Thread and
        task local, as vLLM's; applying it tells the getters so.
        """
        nonlocal lanes_followed

        @contextlib.contextmanager
        def use_workspace_lane(lane: int) -> Iterator[None]:
            outside = _OUTSIDE_VLLM_LANES.get()
            if lane:
                inside = vllm_lane_names.get(lane) or vllm_lane_names.setdefault(lane, f"vllm-u0-l{lane}")
                token = _OUTSIDE_VLLM_LANES.set(outside if outside is not None else _wspool_lane_of())
            elif outside is not None:  # lane 0 inside another lane: the lane outside them all
                inside, token = outside, _OUTSIDE_VLLM_LANES.set(None)
            else:
                with original(lane):
                    yield
                return
            try:
                with original(lane), wspool.lane(inside):
                    yield
            finally:
                _OUTSIDE_VLLM_LANES.reset(token)

        lanes_followed = True
        point_fast_path()
        return marked(use_workspace_lane, original)

    getters.current_lane = current_lane
    getters.get_mla_workspace_buffer = get_mla_workspace_buffer
    getters.mla_reads_call_facts = mla_reads_call_facts
    getters.wrap_forward_mqa = wrap_forward_mqa
    getters.wrap_folded_decode = wrap_folded_decode
    getters.wrap_use_workspace_lane = wrap_use_workspace_lane
    getters.get_multi_ctas_kv_counter_buffer = counters_getter(
        POOL_COUNTERS,
        "get_multi_ctas_kv_counter_buffer",
        """Return trtllm-gen's multi-CTA-KV counters: pool ``flashinfer_mla_counters``, rule ``counters``.

        Replaces ``flashinfer_mla._get_multi_ctas_kv_counter_buffer``: a ``uint8`` buffer of at
        least ``min_bytes`` on ``device``, zeroed once when allocated (the kernel resets its
        semaphores after every launch), the same tensor while it suffices.

        Raises:
            WorkspaceFrozenError: It would have to grow while locked or capturing.
        """,
    )
    getters.get_paged_multi_ctas_kv_counter_buffer = counters_getter(
        POOL_PAGED_COUNTERS,
        "get_paged_multi_ctas_kv_counter_buffer",
        """Return trtllm-gen's paged-attention counters (pool ``flashinfer_counters``), as the MLA ones.""",
    )
    getters.get_sparse_workspace_buffer = device_getter(
        POOL_SPARSE,
        torch.int8,
        "get_sparse_workspace_buffer",
        """Return sparse FlashInfer MLA's workspace: pool ``flashinfer_mla_sparse``, rule ``default``, as ``int8``.

        Replaces ``flashinfer_mla_sparse._get_workspace_buffer``: the rule's size with
        ``min_bytes`` as a floor, zero-filled, the same tensor while the buffer suffices.
        """,
    )
    getters.get_dsv4_workspace = device_getter(
        POOL_DSV4,
        None,
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
    getters.get_dash_workspace = device_getter(
        POOL_DASH,
        None,
        "get_dash_workspace",
        """Return DASH attention's FlashInfer prefill workspace: pool ``flashinfer_dash``, rule ``default``.

        Replaces vLLM 0.34's ``dash_attention._workspace(device)`` (docs/vllm.md): a zero-filled
        ``uint8`` buffer of the rule's size; each FlashInfer wrapper keeps the tensor it was built
        with, so the memory stays valid for its captured graphs if the pool grows later.
        """,
    )
