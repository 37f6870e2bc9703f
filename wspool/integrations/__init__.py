"""Integrations: wspool embedded in inference engines through the engines' own plugin mechanisms.

Each engine is a package on one seam (:mod:`wspool.integrations.patching`):
:mod:`wspool.integrations.vllm` and :mod:`wspool.integrations.sglang`, loaded
by their engines through entry points; :mod:`wspool.integrations.adapters`
holds drop-in functions for engines without a plugin system. :data:`ENGINES`
describes each engine without importing it or its package.
"""

from __future__ import annotations

import importlib

from wspool.integrations.patching import EngineInfo, Integration
from wspool.targets import TargetGroup

__all__ = ["ENGINES", "SGLANG", "VLLM", "integration", "patched_in_process", "targets_of"]

VLLM = EngineInfo(
    key="vllm",
    name="vLLM",
    distribution="vllm",
    supported=">=0.33.0,<0.35",
    entry_point_group="vllm.general_plugins",
    entry_point="wspool.integrations.vllm:register",
    switch_var="WSPOOL_VLLM",
    allowlist_var="VLLM_PLUGINS",
    engine_variables=("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE",),
)
SGLANG = EngineInfo(
    key="sglang",
    name="SGLang",
    distribution="sglang",
    supported=">=0.5.23,<0.5.24",
    entry_point_group="sglang.srt.plugins",
    entry_point="wspool.integrations.sglang:register",
    switch_var="WSPOOL_SGLANG",
    allowlist_var="SGLANG_PLUGINS",
    engine_variables=("SGLANG_FLASHINFER_WORKSPACE_SIZE",),
)

#: Every engine wspool integrates, in the order ``wspool doctor`` lists them.
ENGINES: tuple[EngineInfo, ...] = (VLLM, SGLANG)


def integration(key: str) -> Integration:
    """Return the integration of engine ``key`` (imports wspool's package for it, not the engine).

    Raises:
        KeyError: No engine of that key.
    """
    if key not in {info.key for info in ENGINES}:
        raise KeyError(f"no wspool integration for {key!r} (known: {', '.join(i.key for i in ENGINES)})")
    found: Integration = importlib.import_module(f"wspool.integrations.{key}").INTEGRATION
    return found


def targets_of(key: str) -> tuple[TargetGroup, ...]:
    """Return what wspool patches in engine ``key``, as declared (nothing is imported of the engine)."""
    return integration(key).groups()


def patched_in_process(key: str) -> list[str]:
    """Return the engine attributes wspool patched in this process, by dotted name."""
    return integration(key).patched()
