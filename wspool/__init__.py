"""wspool: configurable, shared GPU workspace pools for inference kernels.

``import wspool`` imports neither FlashInfer nor anything that creates a CUDA
context; pools allocate on their first request, on the device it names.

The public API is ``__all__`` (README.md's table). The names below it stay
importable (explicit re-exports) for code that uses them (``reset_registry`` is ``set_registry(None)``;
the rule and spec types live in :mod:`wspool.rules` and :mod:`wspool.pool`).
"""

from wspool.errors import (
    ConfigError,
    RuleError,
    SizeError,
    WorkspaceFrozenError,
    WorkspaceLimitError,
    WorkspaceOverflowError,
    WspoolError,
)
from wspool.pool import PoolSpec as PoolSpec
from wspool.pool import PoolStats, WorkspacePool
from wspool.registry import PoolRegistry, get_registry, set_registry
from wspool.registry import reset_registry as reset_registry
from wspool.rules import SizeRule as SizeRule
from wspool.rules import compile_rule as compile_rule
from wspool.settings.schema import PoolConfig, load_settings
from wspool.settings.schema import WspoolSettings as WspoolSettings
from wspool.streams import current_lane, lane
from wspool.units import format_size, parse_size

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "PoolConfig",
    "PoolRegistry",
    "PoolStats",
    "RuleError",
    "SizeError",
    "WorkspaceFrozenError",
    "WorkspaceLimitError",
    "WorkspaceOverflowError",
    "WorkspacePool",
    "WspoolError",
    "__version__",
    "current_lane",
    "format_size",
    "get_registry",
    "lane",
    "load_settings",
    "parse_size",
    "set_registry",
]
