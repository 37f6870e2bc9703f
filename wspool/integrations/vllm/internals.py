"""vLLM's private names that the plugin reads, each through one accessor that names where it was read.

vLLM has no public API for these; each accessor says which vLLM versions its
name was read from, returns ``None`` (or does nothing) where the name is
absent, and ``tests/integrations/test_vllm_plugin.py`` fails with the
accessor's name when a supported vLLM lacks it. Nothing here imports vLLM at
import time; the accessors import its modules when called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

__all__ = ["ACCESSORS", "READ_FROM", "builder_workspace", "lane_reader", "set_builder_workspace"]

#: The vLLM versions every name below was read from.
READ_FROM = "vLLM 0.33.0 and 0.34.0"

_WORKSPACE = "vllm.v1.worker.workspace"
_UBATCHING = "vllm.v1.worker.ubatching"


def _module_attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def lane_reader() -> Callable[[], tuple[int, int] | None] | None:
    """Return a reader of vLLM's ``(ubatch id, workspace lane)``, ``None`` for ``(0, 0)``; ``None`` without them.

    Reads ``vllm.v1.worker.workspace._workspace_lane`` (a ``ContextVar``) and
    ``vllm.v1.worker.ubatching._THREAD_ID_TO_CONTEXT`` (empty unless dual-batch
    overlap runs), with vLLM's public ``dbo_current_ubatch_id`` (vLLM 0.33.0 and 0.34.0).
    """
    lane_var = _module_attr(_WORKSPACE, "_workspace_lane")
    contexts = _module_attr(_UBATCHING, "_THREAD_ID_TO_CONTEXT")
    ubatch_id = _module_attr(_UBATCHING, "dbo_current_ubatch_id")
    if not isinstance(lane_var, ContextVar) or not isinstance(contexts, dict) or not callable(ubatch_id):
        return None
    lane_of = lane_var.get

    def read() -> tuple[int, int] | None:
        lane = lane_of()
        if not contexts and not lane:  # no micro-batch runs and lane 0: wspool's own lane
            return None
        return ubatch_id(), lane

    return read


def builder_workspace(builder: Any) -> Any:
    """Return ``FlashInferMetadataBuilder._workspace_buffer``, ``None`` before the first call (vLLM 0.33/0.34)."""
    return getattr(builder, "_workspace_buffer", None)


def set_builder_workspace(builder: Any, buffer: Any) -> None:
    """Set ``FlashInferMetadataBuilder._workspace_buffer``, where vLLM's getter caches it (vLLM 0.33/0.34)."""
    builder._workspace_buffer = buffer


#: Every accessor with the module and name it reads (for the test that they still exist).
ACCESSORS: dict[str, tuple[str, str]] = {
    "lane_reader": (_WORKSPACE, "_workspace_lane"),
    "lane_reader (micro-batches)": (_UBATCHING, "_THREAD_ID_TO_CONTEXT"),
    "builder_workspace": ("vllm.v1.attention.backends.flashinfer", "FlashInferMetadataBuilder"),
}
