"""Integrations: wspool embedded in inference engines through the engines' own plugin mechanisms.

Each engine is a package on one seam (:mod:`wspool.integrations.patching`):
:mod:`wspool.integrations.vllm`, :mod:`wspool.integrations.sglang` and
:mod:`wspool.integrations.tokenspeed`, loaded by their engines through entry points. Each
package's ``engine.yaml`` is the engine's spec
(:func:`~wspool.settings.profiles.engine_specs` reads them all without importing a package),
so an engine is added by its own package alone.
"""

from __future__ import annotations

import importlib

from wspool.integrations.patching import Integration
from wspool.settings.profiles import EngineSpec, engine_spec, engine_specs
from wspool.targets import TargetGroup

__all__ = [
    "ENGINES",
    "RESERVE_ENV_VAR",
    "integration",
    "patched_in_process",
    "targets_of",
]

#: ``0`` (false, off, no): no engine reserves wspool's pools before sizing its KV cache (they grow on first use).
RESERVE_ENV_VAR = "WSPOOL_RESERVE"

#: Every engine wspool integrates, in the order ``wspool doctor`` lists them: their specs as read at import.
ENGINES: tuple[EngineSpec, ...] = engine_specs()


def integration(key: str) -> Integration:
    """Return the integration of engine ``key`` (imports wspool's package for it, not the engine).

    Raises:
        KeyError: No engine of that key.
    """
    found: Integration = importlib.import_module(f"{__name__}.{engine_spec(key).key}").INTEGRATION
    return found


def targets_of(key: str) -> tuple[TargetGroup, ...]:
    """Return what wspool patches in engine ``key``, as declared (nothing is imported of the engine)."""
    return integration(key).groups()


def patched_in_process(key: str) -> list[str]:
    """Return the engine attributes wspool patched in this process, by dotted name."""
    return integration(key).patched()
