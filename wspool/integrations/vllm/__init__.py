"""wspool in vLLM 0.33 and 0.34: the ``vllm.general_plugins`` entry point and what it patches.

vLLM calls :func:`register` in every process it starts (engine core, workers)
through the ``vllm.general_plugins`` entry point ``wspool``; ``VLLM_PLUGINS``,
when set, must name ``wspool``. The targets are :data:`GROUPS` on the one
seam (:mod:`wspool.integrations.patching`): module globals vLLM's callers look
up at call time, the builder's methods, the MLA call sites that record the
kernel's shape, and ``WorkspaceManager.lock``/``unlock``, which also freeze
and unfreeze wspool's registry. Each group is patched whole or not at all; a
group vLLM has changed keeps vLLM's own behaviour, named in one warning. The
replacements live in :mod:`~wspool.integrations.vllm.getters`, the engine's
facts in :mod:`~wspool.integrations.vllm.facts`, the FlashInfer wrappers' int
workspaces in :mod:`~wspool.integrations.vllm.wrappers`. docs/vllm.md lists
every target, pool and rule. :func:`get_workspace_buffer` (also under vLLM's
name ``_get_workspace_buffer``) is vLLM's MLA workspace function, pool-backed,
for a backend that imports it in place of vLLM's.

Thread semantics: vLLM loads plugins at start-up, before serving; loading is
idempotent and never raises. The drop-in function is thread-safe, on the
current CUDA device at each call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from wspool.bounds import Reservation
from wspool.devices import DeviceLike
from wspool.errors import WspoolError
from wspool.integrations.patching import Integration, entry_points
from wspool.integrations.reserving import RESERVE_ENV_VAR, reserve_for_engine, write_snapshot
from wspool.integrations.vllm import getters as ws
from wspool.integrations.vllm import internals, wrappers
from wspool.integrations.vllm.facts import limits_from_config
from wspool.integrations.vllm.getters import DEVICE_ENV_VAR
from wspool.registry import PoolRegistry, get_registry
from wspool.settings.profiles import engine_spec
from wspool.targets import Target, TargetGroup
from wspool.units import MiB, parse_size

__all__ = [
    "DEVICE_ENV_VAR",
    "ENABLE_ENV_VAR",
    "FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE",
    "FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE",
    "GROUPS",
    "INTEGRATION",
    "TARGETS",
    "VllmIntegration",
    "check_workspace_facts",
    "get_workspace_buffer",
    "patched",
    "register",
    "reservation_lanes",
    "reservation_rules",
    "reserve_before_kv_cache",
    "unregister",
]

# A child of vLLM's logger, so the load line appears with vLLM's own (vLLM configures "vllm").
logger = logging.getLogger("vllm.wspool")

_MLA = "vllm.v1.attention.backends.mla.flashinfer_mla"
_SPARSE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"
# Imports the sparse function by name: a copy bound at its import, patched on its own.
_SPARSE_SM120 = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120"
_PAGED = "vllm.v1.attention.backends.flashinfer"
_WORKSPACE = "vllm.v1.worker.workspace"
_DRAFTER = "vllm.models.kimi_k3.nvidia.specialized_decode.drafter.attention"
_DSV4 = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse"
_DSV41 = "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"
_DSV41_SPARSE = "vllm.models.deepseek_v41.nvidia.specialized_decode.attention.sparse_mla"
_DASH = "vllm.v1.attention.ops.dash_attention"
_MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"
_GPU_WORKER = "vllm.v1.worker.gpu_worker"
_FOLLOWS_LANE = "also sets wspool's lane"


def _installing(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A target's ``make`` that puts the integration's getter ``name`` (:class:`~.getters.VllmGetters`) in place."""

    def make(_original: Callable[..., Any]) -> Callable[..., Any]:
        return getattr(INTEGRATION.getters, name)  # type: ignore[no-any-return]

    return make


def _wrapping(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A target's ``make`` that wraps the original with the integration's wrapper ``name``."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        return getattr(INTEGRATION.getters, name)(original)  # type: ignore[no-any-return]

    return make


def _paged_method(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's constant for its prefill floor, read from the module that defines the original.
    per_elem = getattr(original, "__globals__", {}).get("FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM")
    per_elem = per_elem if isinstance(per_elem, int) else None
    get_paged_workspace_buffer = INTEGRATION.getters.get_paged_workspace_buffer

    def _get_workspace_buffer(self: Any) -> Any:
        return get_paged_workspace_buffer(self, per_elem)

    _get_workspace_buffer.__doc__ = get_paged_workspace_buffer.__doc__
    return _get_workspace_buffer


def _locking(original: Callable[..., Any], frozen: bool) -> Callable[..., Any]:
    def wrapper(self: Any) -> None:
        original(self)
        registry = get_registry()
        if frozen:
            registry.freeze()
            write_snapshot("captured", registry)
        else:
            registry.unfreeze()

    wrapper.__name__ = original.__name__
    wrapper.__qualname__ = getattr(original, "__qualname__", original.__name__)
    wrapper.__doc__ = original.__doc__
    return wrapper


#: vLLM's fixed sizes of its FlashInfer MLA workspace (since PR #47074), for code that imports them;
#: the sizes served come from the configuration (whose built-in defaults are these).
FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE = 128 * MiB
FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE = 256 * MiB

#: vLLM's own sizes of the buffers a reservation covers, by (pool, rule): the log line compares them.
_VLLM_CONSTANTS: dict[tuple[str, str], int] = {
    (ws.POOL_MLA, "default"): FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE,
    (ws.POOL_MLA, "lse"): FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE,
    **{
        (pool, rule): parse_size(size)
        for pool in (ws.POOL_PAGED, ws.POOL_SPARSE)
        for rule, size in ws.VLLM_POOLS[pool].items()
    },
}


def reservation_rules(config: Any, backends: Iterable[str], batch_invariant: bool = False) -> dict[str, list[str]]:
    """Return the pools and rules the attention ``backends`` (vLLM's names) call under ``config``.

    FlashInfer MLA calls rule ``lse`` where DCP spans several ranks (its decode returns
    the LSE), else ``default``; FlashInfer's paged backend calls ``vllm`` (batch-invariant:
    ``vllm_batch_invariant``); sparse FlashInfer MLA calls ``default``.
    """
    cp_world = getattr(getattr(config, "parallel_config", None), "decode_context_parallel_size", 1) or 1
    found = set(backends)
    rules: dict[str, list[str]] = {}
    if "FLASHINFER_MLA" in found:
        rules[ws.POOL_MLA] = ["lse" if cp_world > 1 else "default"]
    if "FLASHINFER" in found:
        rules[ws.POOL_PAGED] = ["vllm_batch_invariant" if batch_invariant else "vllm"]
    if "FLASHINFER_MLA_SPARSE" in found:
        rules[ws.POOL_SPARSE] = ["default"]
    return rules


def reservation_lanes(config: Any) -> list[str]:
    """Return the wspool lanes ``config``'s micro-batches and draft workspace lane use (:mod:`.getters` names them)."""
    parallel = getattr(config, "parallel_config", None)
    ubatches = getattr(parallel, "num_ubatches", 1) if getattr(parallel, "use_ubatching", False) else 1
    speculative = getattr(config, "speculative_config", None)
    use_dspark = getattr(speculative, "use_dspark", None)
    workspace_lanes = 2 if callable(use_dspark) and use_dspark() else 1
    names = []
    for ubatch in range(max(1, int(ubatches))):
        for lane in range(workspace_lanes):
            names.append(INTEGRATION.getters.current_lane() if (ubatch, lane) == (0, 0) else f"vllm-u{ubatch}-l{lane}")
    return names


def reserve_before_kv_cache(worker: Any) -> Reservation | None:
    """Reserve the pools the worker's attention backends call, at their bounds over its configuration's limits.

    Called by ``Worker.determine_available_memory`` before vLLM measures memory
    for the KV cache, so the cache is sized with wspool's buffers counted. Never
    raises (:func:`wspool.integrations.reserving.reserve_for_engine`).
    """
    config = getattr(worker, "vllm_config", None)
    registry = get_registry()
    try:
        ws.VllmPools.of(registry)
    except WspoolError as exc:
        logger.warning("wspool: vLLM's pools not reserved: %s", exc)
        return None
    getters = INTEGRATION.getters
    rules = reservation_rules(config, internals.attention_backends(config) or (), getters.batch_invariant_mode())
    device = getters.served_device() or getattr(worker, "device", None) or "cuda"
    return reserve_for_engine(
        "vLLM",
        limits_from_config(config),
        rules,
        device=device,
        lanes=reservation_lanes(config),
        engine_bytes=sum(_VLLM_CONSTANTS.get((pool, rule), 0) for pool, names in rules.items() for rule in names),
        registry=registry,
    )


def _reserving(original: Callable[..., Any]) -> Callable[..., Any]:
    def determine_available_memory(self: Any) -> Any:
        reserve_before_kv_cache(self)
        return original(self)

    determine_available_memory.__name__ = original.__name__
    determine_available_memory.__qualname__ = getattr(original, "__qualname__", original.__name__)
    determine_available_memory.__doc__ = original.__doc__
    return determine_available_memory


_FOLDED_DECODE_PARAMETERS = (
    "q",
    "kv_cache",
    "block_table",
    "seq_lens",
    "max_seq_len",
    "tokens_per_request",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "bmm1_scale",
    "bmm2_scale",
    "workspace",
    "return_lse",
    "dcp_world_size",
    "dcp_rank",
    "dcp_tot_seq_lens",
    "max_reqs",
    "backend",
    "table_cache",
)

_MLA_POOL = "pool flashinfer_mla (int8)"
_SPARSE_POOL = "pool flashinfer_mla_sparse (int8)"
_DSV4_POOL = "pool flashinfer_dsv4"
_INT_POOL = "its wrappers' int workspaces from pool flashinfer_int"

#: What :func:`register` patches: groups in order, each all or none.
GROUPS: tuple[TargetGroup, ...] = (
    TargetGroup(
        "the MLA decode workspace",
        (
            Target(_MLA, "_get_workspace_buffer", ("return_lse",), _installing("get_mla_workspace_buffer"), _MLA_POOL),
            Target(
                _MLA,
                "FlashInferMLAImpl.forward_mqa",
                ("self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"),
                _wrapping("wrap_forward_mqa"),
                "the kernel's facts (rows, q_len, heads, cp_world)",
            ),
            Target(
                _DRAFTER,
                "folded_decode",
                _FOLDED_DECODE_PARAMETERS,
                _wrapping("wrap_folded_decode"),
                "the folded kernel's facts",
                optional=True,
            ),
        ),
    ),
    TargetGroup(
        "trtllm-gen's MLA counters",
        (
            Target(
                _MLA,
                "_get_multi_ctas_kv_counter_buffer",
                ("min_bytes", "device"),
                _installing("get_multi_ctas_kv_counter_buffer"),
                "pool flashinfer_mla_counters",
            ),
        ),
    ),
    TargetGroup(
        "the sparse MLA workspace",
        (
            Target(
                _SPARSE,
                "_get_workspace_buffer",
                ("device", "min_bytes"),
                _installing("get_sparse_workspace_buffer"),
                _SPARSE_POOL,
            ),
            Target(
                _SPARSE_SM120,
                "_get_workspace_buffer",
                ("device", "min_bytes"),
                _installing("get_sparse_workspace_buffer"),
                _SPARSE_POOL,
                optional=True,
            ),
        ),
    ),
    TargetGroup(
        "the FlashInfer attention workspace",
        (
            Target(
                _PAGED, "FlashInferMetadataBuilder._get_workspace_buffer", ("self",), _paged_method, "pool flashinfer"
            ),
        ),
    ),
    TargetGroup(
        "trtllm-gen's paged-attention counters",
        (
            Target(
                _PAGED,
                "_get_multi_ctas_kv_counter_buffer",
                ("min_bytes", "device"),
                _installing("get_paged_multi_ctas_kv_counter_buffer"),
                "pool flashinfer_counters",
            ),
        ),
    ),
    # Two groups: the decode wrappers' regions need nothing of the prefill wrapper's, nor it of theirs.
    TargetGroup(
        "the FlashInfer decode wrappers' int workspaces",
        (
            Target(
                _PAGED,
                "FlashInferMetadataBuilder._get_decode_wrapper",
                ("self", "batch_size", "use_cudagraph", "q_len_per_req"),
                wrappers.wrap_get_decode_wrapper,
                _INT_POOL,
            ),
        ),
    ),
    TargetGroup(
        "the FlashInfer prefill wrappers' int workspaces",
        (
            Target(
                _PAGED,
                "FlashInferMetadataBuilder._get_prefill_wrapper",
                ("self", "causal"),
                wrappers.wrap_get_prefill_wrapper,
                _INT_POOL,
            ),
        ),
    ),
    TargetGroup(
        "DeepSeek V4's sparse MLA workspace",
        (
            # vLLM 0.34: one function, two copies imported by name; vLLM 0.33: a function in each
            # model's module, the second imported by name.
            *(
                Target(module, name, ("device",), _installing("get_dsv4_workspace"), _DSV4_POOL, optional=True)
                for name in ("get_flashinfer_dsv4_workspace", "_get_flashinfer_dsv4_workspace")
                for module in (_DSV4, _DSV41, _DSV41_SPARSE)
            ),
        ),
    ),
    TargetGroup(
        "DASH attention's FlashInfer workspace",
        (
            Target(
                _DASH,
                "_workspace",
                ("device",),
                _installing("get_dash_workspace"),
                "pool flashinfer_dash",
                optional=True,
            ),
        ),
    ),
    TargetGroup(
        "the reservation before KV-cache sizing",
        (
            Target(
                _GPU_WORKER,
                "Worker.determine_available_memory",
                ("self",),
                _reserving,  # before the lanes: importing the worker imports the model runner's copy
                f"first reserves wspool's pools for the configuration's limits ({RESERVE_ENV_VAR}=0: off)",
            ),
        ),
    ),
    TargetGroup(
        "vLLM's workspace lanes",
        (
            Target(_WORKSPACE, "use_workspace_lane", ("lane",), _wrapping("wrap_use_workspace_lane"), _FOLLOWS_LANE),
            # Import it by name: copies bound at their import, patched where that import came first.
            *(
                Target(
                    module,
                    "use_workspace_lane",
                    ("lane",),
                    _wrapping("wrap_use_workspace_lane"),
                    _FOLLOWS_LANE,
                    optional=True,
                    imported_only=True,
                )
                for module in (_MODEL_RUNNER, "vllm.benchmarks.forward.speculator")
            ),
        ),
    ),
    TargetGroup(
        "vLLM's workspace lock",
        (
            Target(_WORKSPACE, "WorkspaceManager.lock", ("self",), lambda f: _locking(f, True), "also freezes wspool"),
            Target(
                _WORKSPACE, "WorkspaceManager.unlock", ("self",), lambda f: _locking(f, False), "also unfreezes wspool"
            ),
        ),
    ),
)

#: Every target of :data:`GROUPS`, in order.
TARGETS: tuple[Target, ...] = tuple(target for group in GROUPS for target in group.targets)


class VllmIntegration(Integration):
    """vLLM's integration: :data:`GROUPS` patched group by group, each all or none.

    Its :attr:`getters` are the replacements it installs and the state they share, made
    anew when it activates (with vLLM's hooks) and when it deactivates (with none).
    """

    info = engine_spec("vllm")
    pools = ws.VllmPools

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger)
        self.getters = ws.VllmGetters()

    def groups(self) -> tuple[TargetGroup, ...]:
        """Return :data:`GROUPS`."""
        return GROUPS

    def activate(self) -> list[str]:
        """Point the replacements at vLLM's configuration, lanes and batch-invariant flag; return what is missing."""
        missing = []
        get_config = None
        try:
            from vllm.config import get_current_vllm_config_or_none

            get_config = get_current_vllm_config_or_none
        except ImportError:
            missing.append("vllm.config.get_current_vllm_config_or_none (rules see call-time facts only)")
        lanes = internals.lanes()
        if lanes is None:
            missing.append("vLLM's workspace lanes (every micro-batch uses lane main)")
        batch_invariant = None
        try:
            import vllm.envs as envs

            if hasattr(envs, "VLLM_BATCH_INVARIANT"):

                def batch_invariant() -> bool:
                    return bool(envs.VLLM_BATCH_INVARIANT)

        except ImportError:
            pass
        self.getters = ws.VllmGetters(get_config=get_config, lanes=lanes, batch_invariant=batch_invariant)
        return missing

    def deactivate(self) -> None:
        """Forget vLLM's hooks and the handles the getters bound."""
        self.getters = ws.VllmGetters()


#: The plugin of this process.
INTEGRATION = VllmIntegration(logger)


#: ``0`` (or ``false``, ``off``, ``no``) leaves vLLM untouched although the plugin loads; other values are refused.
ENABLE_ENV_VAR = VllmIntegration.info.switch_var


register, unregister, patched = entry_points(INTEGRATION)


_DROP_IN_POOL = "flashinfer_mla"
_DROP_IN_DEVICE = "cuda"  # the current CUDA device at each call (tests point it at the CPU)


def get_workspace_buffer(return_lse: bool) -> torch.Tensor:
    """Return FlashInfer MLA's workspace: the ``flashinfer_mla`` pool's buffer, grown to rule ``lse`` or ``default``.

    vLLM's ``_get_workspace_buffer(return_lse)`` (128 MiB, or 256 MiB once a
    call returns the LSE, grown lazily and reused) with sizes from the
    configuration and the device's profile, one buffer per device and lane
    shared with the pool's other users, and growth refused during capture or
    while frozen. The call passes no facts: a rule reads the pool's default
    facts or the device's, which :func:`check_workspace_facts` checks at load time.

    Args:
        return_lse: Whether the call also returns the LSE (the larger rule).

    Returns:
        A zero-filled ``uint8`` buffer of at least the rule's size (128 MiB /
        256 MiB by default); the same tensor on later calls while it suffices.

    Raises:
        WorkspaceFrozenError: It would have to grow while frozen or capturing; warm up both sizes first.
        WorkspaceLimitError: It would have to grow beyond ``max_bytes`` or memory.
    """
    return get_registry().workspace(_DROP_IN_POOL, _DROP_IN_DEVICE, rule="lse" if return_lse else "default")


def check_workspace_facts(registry: PoolRegistry | None = None, device: DeviceLike = _DROP_IN_DEVICE) -> None:
    """Check at load time that :func:`get_workspace_buffer` can size both rules without facts.

    An engine calls it once while it loads (before its first decode step):
    a rule of ``flashinfer_mla`` that reads a fact neither the pool's default
    facts nor the device supply fails here, naming the key to set.

    Args:
        registry: The registry; default :func:`wspool.get_registry`.
        device: The device the calls will run on; default the current CUDA device.

    Raises:
        ConfigError: A fact is missing; the message names ``pools.flashinfer_mla.facts.<name>``
            and ``WSPOOL_POOLS__FLASHINFER_MLA__FACTS__<NAME>``.
    """
    (registry or get_registry()).check_facts(_DROP_IN_POOL, ("default", "lse"), device=device)


#: vLLM's name for the function, so a backend switches by changing one import.
_get_workspace_buffer = get_workspace_buffer
