"""wspool: configurable, shared GPU workspace pools for inference kernels.

``import wspool`` imports neither FlashInfer nor anything that creates a CUDA
context; pools allocate on their first request, on the device it names.
"""

from wspool.errors import (
    ConfigError,
    RuleError,
    SizeError,
    WorkspaceFrozenError,
    WorkspaceLimitError,
    WspoolError,
)
from wspool.lanes import current_lane, lane
from wspool.pool import PoolSpec, PoolStats, WorkspacePool
from wspool.registry import PoolRegistry, get_registry, reset_registry, set_registry
from wspool.rules import SizeRule, compile_rule
from wspool.settings.config import PoolConfig, WspoolSettings, load_settings
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
    "WorkspaceFrozenError",
    "WorkspaceLimitError",
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
