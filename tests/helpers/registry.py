"""The one way tests build a registry: settings from code (no file, no environment leak), an optional allocator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import wspool
from wspool.pool import Allocator
from wspool.registry import DeviceDescriber


def make_registry(
    pools: Mapping[str, Any] | None = None,
    *,
    allocator: Allocator | None = None,
    describe_device: DeviceDescriber | None = None,
    **settings: Any,
) -> wspool.PoolRegistry:
    """Return a registry configured by ``pools`` and other settings given in code.

    Args:
        pools: ``pools`` as the YAML file would give it; ``None`` keeps the built-in pools.
        allocator: Stands in for ``torch.zeros`` (counting, failing, or CPU memory for a CUDA device).
        describe_device: Stands a device in for a GPU (see ``wspool.devices.fake_device``).
        **settings: Any other top-level setting (``profile``, ``debug_streams``...).
    """
    if pools is not None:
        settings["pools"] = pools
    return wspool.PoolRegistry(wspool.load_settings(**settings), allocator=allocator, describe_device=describe_device)
