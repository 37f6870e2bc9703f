"""wspool in TokenSpeed 0.1.1: the ``tokenspeed.plugins`` entry point and what it patches.

TokenSpeed's plugin loader (``tokenspeed.runtime.plugins.ensure_loaded``, which
every ``ModelConfig`` calls first) runs the ``tokenspeed.plugins`` entry point
``wspool`` (:func:`register`) once per process; ``TOKENSPEED_DISABLE_PLUGINS=wspool``
skips it. :data:`TARGETS` form one group on the one seam
(:mod:`wspool.integrations.patching`), patched all or nothing, and each patch
is reported through TokenSpeed's ``record_external`` with its undo, so the
loader takes them back with the plugin's other registrations. TokenSpeed's
workspaces are served by :mod:`~wspool.integrations.tokenspeed.buffers`;
docs/tokenspeed.md lists them.

Thread semantics: TokenSpeed loads plugins under its loader's lock, at
start-up, before serving; loading is idempotent and never raises.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

import wspool
from wspool.bounds import FactLimit, Reservation
from wspool.integrations import RESERVE_ENV_VAR
from wspool.integrations.patching import Integration, Reporter, entry_points, replacing
from wspool.integrations.reserving import engine_plan, reserve_for_engine
from wspool.integrations.tokenspeed import buffers
from wspool.integrations.tokenspeed.buffers import TOKENSPEED_POOLS, WORKSPACES
from wspool.settings.profiles import engine_spec
from wspool.targets import Target, TargetGroup

__all__ = [
    "ENABLE_ENV_VAR",
    "GROUPS",
    "INTEGRATION",
    "TARGETS",
    "TOKENSPEED_POOLS",
    "WORKSPACES",
    "TokenspeedIntegration",
    "patched",
    "register",
    "reservation_plan",
    "reserve_before_cache",
    "tokenspeed_reporter",
    "unregister",
]

logger = logging.getLogger("wspool.integrations.tokenspeed")

_PAGED = "tokenspeed.runtime.layers.attention.backends.paged."
_BACKEND_INIT = ("self", "config", "spec", "kernel_page_size")

_ATTENTION = "tokenspeed.runtime.layers.attention."
_PROFILE_PARAMETERS = (
    "attn_config", "gpu_id", "tp_size", "gpu_memory_utilization", "total_gpu_memory", "post_profile_bytes",
    "world_group",
)  # fmt: skip


def _reserving(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def profile_available_cache_memory_bytes(attn_config: Any, gpu_id: int, *args: Any, **kwargs: Any) -> Any:
        reserve_before_cache(attn_config, gpu_id)
        return original(attn_config, gpu_id, *args, **kwargs)

    return profile_available_cache_memory_bytes


#: What the integration patches, in order; a missing one means none is patched.
TARGETS: tuple[Target, ...] = (
    Target(
        "tokenspeed.runtime.execution.workspace",
        "WorkspacePool",
        ("device", "initial_nbytes"),
        replacing(buffers.ServedWorkspacePool),
        f"the shared block -> pool {buffers.BLOCK.pool} (allocated on first use; freeze = wspool's freeze)",
        requires=("workspace_pool",),
    ),
    Target(
        _PAGED + "trtllm",
        "TRTLLMMHAAttnBackend.__init__",
        _BACKEND_INIT,
        buffers.wrap_mha_constructor,
        f"its draw from the block sized by {buffers.TRTLLM_MHA.setting}",
    ),
    Target(
        _PAGED + "trtllm_mla",
        "get_trtllm_workspace_buffer",
        ("device",),
        replacing(buffers.trtllm_mla_workspace),
        f"per device, zeroed, from pool {buffers.TRTLLM_MLA.pool}",
    ),
    Target(
        _PAGED + "flashmla",
        "FlashMLABackend.__init__",
        _BACKEND_INIT,
        buffers.wrap_flashmla_constructor,
        f"its FlashInfer prefill workspace per device from {buffers.FLASHMLA.setting}",
        requires=("_global_workspace_buffer", "get_flashinfer_workspace_size"),
    ),
    Target(
        "tokenspeed_kernel.ops.attention.dsa.flashinfer",
        "_get_dsa_sparse_workspace",
        ("device",),
        replacing(buffers.dsa_workspace),
        f"per device, zeroed, from pool {buffers.DSA.pool}",
        requires=("_DSA_SPARSE_WORKSPACE_BYTES",),
    ),
    # The registry imports the profile by name: its copy is the one create_attn_components calls.
    Target(
        _ATTENTION + "registry",
        "profile_available_cache_memory_bytes",
        _PROFILE_PARAMETERS,
        _reserving,
        f"first reserves wspool's pools for the attention backend ({RESERVE_ENV_VAR}=0: off)",
    ),
)

#: One group: the block's users and the buffers kept apart from it only work together.
GROUPS: tuple[TargetGroup, ...] = (TargetGroup("TokenSpeed's attention workspaces", TARGETS),)


def tokenspeed_reporter() -> Reporter | None:
    """Return TokenSpeed's ``record_external``, which joins a change to the plugin's recording (``None`` if absent)."""
    try:
        registry = importlib.import_module("tokenspeed.runtime.plugins.registry")
    except ImportError:
        return None
    record: Callable[..., None] | None = getattr(registry, "record_external", None)
    return record


def reservation_plan(backend: str | None) -> tuple[dict[str, list[str]], int | None]:
    """Return the pool and rule TokenSpeed's ``backend`` calls, and the size TokenSpeed itself gives it.

    ``trtllm_mla`` -> the trtllm-gen MLA workspace (``TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB``);
    ``flashmla`` -> FlashMLA's FlashInfer prefill workspace (``FLASHINFER_WORKSPACE_SIZE``).
    Other backends (the shared block's users, DSA) are not reserved: they grow on first use.
    """
    try:
        if backend == "trtllm_mla":
            envs = importlib.import_module("tokenspeed.runtime.utils.env").envs
            return {buffers.TRTLLM_MLA.pool: [buffers.TRTLLM_MLA.rule]}, int(
                envs.TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB.get()
            ) << 20
        if backend == "flashmla":
            sizes = importlib.import_module("tokenspeed.runtime.utils.flashinfer_config")
            return {buffers.FLASHMLA.pool: [buffers.FLASHMLA.rule]}, int(sizes.get_flashinfer_workspace_size())
    except (ImportError, AttributeError):  # TokenSpeed changed: its workspaces grow on first use
        return {}, None
    return {}, None


def reserve_before_cache(attn_config: Any, gpu_id: int) -> Reservation | None:
    """Reserve the workspace of ``attn_config``'s softmax backend before TokenSpeed measures its cache; never raises."""

    def plan() -> tuple[dict[str, list[str]], int | None]:
        configs = importlib.import_module(_ATTENTION + "configs.base")
        softmax = attn_config.component(configs.SoftmaxAttnConfig)
        return reservation_plan(getattr(softmax, "backend_name", None))

    planned = engine_plan("TokenSpeed", plan, buffers.TokenspeedPools.of)
    if planned is None:
        return None
    (rules, nbytes), registry = planned
    device = torch.device(getattr(attn_config, "device", "cuda"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", gpu_id)
    limits = {} if nbytes is None else {"tokenspeed_bytes": FactLimit(nbytes, nbytes, (nbytes,), "TokenSpeed's size")}
    return reserve_for_engine(
        "TokenSpeed", limits, rules, device=device, lanes=[wspool.current_lane()], engine_bytes=nbytes,
        registry=registry,
    )  # fmt: skip


class TokenspeedIntegration(Integration):
    """TokenSpeed's integration: :data:`TARGETS`, all or nothing, each reported to TokenSpeed's loader."""

    info = engine_spec("tokenspeed")
    all_or_nothing = True
    pools = buffers.TokenspeedPools

    def reporter(self) -> Reporter | None:
        """Return TokenSpeed's ``record_external`` (:func:`tokenspeed_reporter`)."""
        return tokenspeed_reporter()

    def groups(self) -> tuple[TargetGroup, ...]:
        """Return :data:`GROUPS`."""
        return GROUPS


#: The integration of this process.
INTEGRATION = TokenspeedIntegration(logger)


#: ``0`` (or ``false``, ``off``, ``no``) leaves TokenSpeed untouched although the plugin loads; other values
#: are refused.
ENABLE_ENV_VAR = TokenspeedIntegration.info.switch_var


register, unregister, patched = entry_points(INTEGRATION)
