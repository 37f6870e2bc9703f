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

import importlib
import logging
from collections.abc import Callable, Mapping

from wspool.integrations import TOKENSPEED
from wspool.integrations.patching import Integration, Reporter, describe_config
from wspool.integrations.tokenspeed import buffers
from wspool.integrations.tokenspeed.buffers import TOKENSPEED_POOLS, WORKSPACES
from wspool.registry import PoolRegistry
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
    "tokenspeed_reporter",
    "unregister",
]

logger = logging.getLogger("wspool.integrations.tokenspeed")

_PAGED = "tokenspeed.runtime.layers.attention.backends.paged."
_BACKEND_INIT = ("self", "config", "spec", "kernel_page_size")

#: What the integration patches, in order; a missing one means none is patched.
TARGETS: tuple[Target, ...] = (
    Target(
        "tokenspeed.runtime.execution.workspace",
        "WorkspacePool",
        ("device", "initial_nbytes"),
        buffers.replacing(buffers.ServedWorkspacePool),
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
        buffers.replacing(buffers.trtllm_mla_workspace),
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
        buffers.replacing(buffers.dsa_workspace),
        f"per device, zeroed, from pool {buffers.DSA.pool}",
        requires=("_DSA_SPARSE_WORKSPACE_BYTES",),
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


class TokenspeedIntegration(Integration):
    """TokenSpeed's integration: :data:`TARGETS`, all or nothing, each reported to TokenSpeed's loader."""

    info = TOKENSPEED
    all_or_nothing = True

    def groups(self) -> tuple[TargetGroup, ...]:
        """Return :data:`GROUPS`."""
        return GROUPS

    def check(self, registry: PoolRegistry, environ: Mapping[str, str]) -> str:
        """Declare the pools and check those TokenSpeed zeroes, and FlashMLA's, own their buffers."""
        buffers.TokenspeedPools.of(registry)
        return f"{describe_config(environ)}; profile {registry.settings.profile}"

    def deactivate(self) -> None:
        """Forget what was said once."""
        buffers.forget()


#: The integration of this process.
INTEGRATION = TokenspeedIntegration(logger)


#: ``0`` (or ``false``, ``off``, ``no``) leaves TokenSpeed untouched although the plugin loads; other values
#: are refused.
ENABLE_ENV_VAR = TOKENSPEED.switch_var


def register() -> None:
    """Install wspool's workspaces into TokenSpeed (the ``tokenspeed.plugins`` entry point); never raises.

    Idempotent. Reads the switch, wspool's configuration and TokenSpeed's
    version, then patches every target or none, reporting each to TokenSpeed's
    ``record_external``; logs one line.
    """
    INTEGRATION.load(tokenspeed_reporter())


def unregister() -> list[str]:
    """Put TokenSpeed's originals back (for tests); return the names restored.

    Backends built meanwhile keep the buffers they hold.
    """
    return INTEGRATION.unload()


def patched() -> list[str]:
    """Return the names of the TokenSpeed attributes wspool replaced in this process."""
    return INTEGRATION.patched()
