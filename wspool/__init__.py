"""wspool: configurable, shared GPU workspace pools for inference kernels.

``import wspool`` imports neither torch, FlashInfer nor anything that creates a
CUDA context: the names that need torch (the registry, the pools, the lanes)
are imported on first use, so ``wspool --help`` and ``wspool doctor`` start
without it. Pools allocate on their first request, on the device it names.

The public API is ``__all__`` (README.md's table); ``reset_registry`` is
``set_registry(None)``, and the rule and spec types live in :mod:`wspool.rules`
and :mod:`wspool.pool`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from wspool.errors import (
    ConfigError,
    RuleError,
    SizeError,
    WorkspaceConflictError,
    WorkspaceFrozenError,
    WorkspaceLimitError,
    WorkspaceOverflowError,
    WspoolError,
)
from wspool.rules import SizeRule, compile_rule
from wspool.units import format_size, parse_size

if TYPE_CHECKING:
    from wspool.devices import current_lane, lane
    from wspool.pool import PoolSpec, PoolStats, WorkspacePool
    from wspool.registry import PoolRegistry, get_registry, reset_registry, set_registry
    from wspool.settings.schema import PoolConfig, WspoolSettings, load_settings

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "PoolConfig",
    "PoolRegistry",
    "PoolSpec",
    "PoolStats",
    "RuleError",
    "SizeError",
    "SizeRule",
    "WorkspaceConflictError",
    "WorkspaceFrozenError",
    "WorkspaceLimitError",
    "WorkspaceOverflowError",
    "WorkspacePool",
    "WspoolError",
    "WspoolSettings",
    "__version__",
    "compile_rule",
    "current_lane",
    "format_size",
    "get_registry",
    "lane",
    "load_settings",
    "parse_size",
    "reset_registry",
    "set_registry",
]

# The public names that need torch or pydantic, and the module each comes from.
_LAZY = {
    "PoolSpec": "wspool.pool",
    "PoolStats": "wspool.pool",
    "WorkspacePool": "wspool.pool",
    "PoolRegistry": "wspool.registry",
    "get_registry": "wspool.registry",
    "reset_registry": "wspool.registry",
    "set_registry": "wspool.registry",
    "PoolConfig": "wspool.settings.schema",
    "WspoolSettings": "wspool.settings.schema",
    "load_settings": "wspool.settings.schema",
    "current_lane": "wspool.devices",
    "lane": "wspool.devices",
}


def __getattr__(name: str) -> Any:
    """Import a public name that needs torch (or a submodule, ``wspool.registry``) on first use."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
