"""Integrations: wspool embedded in inference engines through the engines' own plugin mechanisms.

Each engine is a package on one seam (:mod:`wspool.integrations.patching`):
:mod:`wspool.integrations.vllm`, :mod:`wspool.integrations.sglang` and
:mod:`wspool.integrations.tokenspeed`, loaded by their engines through entry points. :data:`ENGINES`
describes each engine without importing it or its package.
"""

from __future__ import annotations

import importlib

from wspool.integrations.patching import EngineInfo, Integration
from wspool.targets import TargetGroup

__all__ = [
    "ENGINES",
    "RESERVE_ENV_VAR",
    "SGLANG",
    "TOKENSPEED",
    "VLLM",
    "integration",
    "patched_in_process",
    "targets_of",
]

#: ``0`` (false, off, no): no engine reserves wspool's pools before sizing its KV cache (they grow on first use).
RESERVE_ENV_VAR = "WSPOOL_RESERVE"

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

TOKENSPEED = EngineInfo(
    key="tokenspeed",
    name="TokenSpeed",
    distribution="tokenspeed",
    supported=">=0.1.1,<0.1.2",
    entry_point_group="tokenspeed.plugins",
    entry_point="wspool.integrations.tokenspeed:register",
    switch_var="WSPOOL_TOKENSPEED",
    denylist_var="TOKENSPEED_DISABLE_PLUGINS",
    engine_variables=(
        "TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB",
        "TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB",
        "FLASHINFER_WORKSPACE_SIZE",
        "TOKENSPEED_WORKSPACE_INITIAL_MB",
    ),
)

#: Every engine wspool integrates, in the order ``wspool doctor`` lists them.
ENGINES: tuple[EngineInfo, ...] = (VLLM, SGLANG, TOKENSPEED)


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
