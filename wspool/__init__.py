"""wspool: configurable, shared GPU workspace pools for inference kernels.

``import wspool`` imports neither FlashInfer nor anything that creates a CUDA
context; pools allocate on their first request, on the device it names.

The public API is ``__all__`` (README.md's table); ``reset_registry`` is
``set_registry(None)``, and the rule and spec types live in :mod:`wspool.rules`
and :mod:`wspool.pool`.
"""

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
from wspool.pool import PoolSpec, PoolStats, WorkspacePool
from wspool.registry import PoolRegistry, get_registry, reset_registry, set_registry
from wspool.rules import SizeRule, compile_rule
from wspool.settings.schema import PoolConfig, WspoolSettings, load_settings
from wspool.streams import current_lane, lane
from wspool.units import format_size, parse_size

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
