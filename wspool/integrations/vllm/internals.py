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
from typing import Any, NamedTuple

__all__ = [
    "ACCESSORS",
    "READ_FROM",
    "VllmLanes",
    "attention_backends",
    "builder_workspace",
    "lanes",
    "set_builder_workspace",
]

#: The vLLM versions every name below was read from.
READ_FROM = "vLLM 0.33.0 and 0.34.0"

_WORKSPACE = "vllm.v1.worker.workspace"
_UBATCHING = "vllm.v1.worker.ubatching"
_LAYER_BASE = "vllm.model_executor.layers.attention_layer_base"


def _module_attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


class VllmLanes(NamedTuple):
    """How vLLM tells its workspace lanes apart: read per call by the getters.

    Attributes:
        contexts: The micro-batch contexts by thread (empty unless dual-batch overlap runs).
        lane_of: Returns the calling context's workspace lane (``0`` by default).
        ubatch_id: Returns the calling thread's micro-batch (``0`` outside one).
    """

    contexts: dict[Any, Any]
    lane_of: Callable[[], int]
    ubatch_id: Callable[[], int]


def lanes() -> VllmLanes | None:
    """Return vLLM's lanes, or ``None`` where this vLLM lacks them.

    Reads ``vllm.v1.worker.workspace._workspace_lane`` (a ``ContextVar``) and
    ``vllm.v1.worker.ubatching._THREAD_ID_TO_CONTEXT``, with vLLM's public
    ``dbo_current_ubatch_id`` (vLLM 0.33.0 and 0.34.0).
    """
    lane_var = _module_attr(_WORKSPACE, "_workspace_lane")
    contexts = _module_attr(_UBATCHING, "_THREAD_ID_TO_CONTEXT")
    ubatch_id = _module_attr(_UBATCHING, "dbo_current_ubatch_id")
    if not isinstance(lane_var, ContextVar) or not isinstance(contexts, dict) or not callable(ubatch_id):
        return None
    return VllmLanes(contexts, lane_var.get, ubatch_id)


def attention_backends(config: Any) -> set[str] | None:
    """Return the names of the attention backends the loaded model's layers use (``"FLASHINFER_MLA"``...).

    Reads ``vllm.config.get_layers_from_vllm_config`` over ``AttentionLayerBase``
    and each layer's ``get_attn_backend().get_name()`` (vLLM 0.33.0 and 0.34.0);
    ``None`` where those are absent or the model is not loaded yet.
    """
    get_layers = _module_attr("vllm.config", "get_layers_from_vllm_config")
    base = _module_attr(_LAYER_BASE, "AttentionLayerBase")
    if not callable(get_layers) or not isinstance(base, type):
        return None
    try:
        layers = get_layers(config, base)
        names = {layer.get_attn_backend().get_name() for layer in layers.values()}
    except Exception:  # a layer without a backend yet, or a configuration without a forward context
        return None
    return {name for name in names if isinstance(name, str)} or None


def builder_workspace(builder: Any) -> Any:
    """Return ``FlashInferMetadataBuilder._workspace_buffer``, ``None`` before the first call (vLLM 0.33/0.34)."""
    return getattr(builder, "_workspace_buffer", None)


def set_builder_workspace(builder: Any, buffer: Any) -> None:
    """Set ``FlashInferMetadataBuilder._workspace_buffer``, where vLLM's getter caches it (vLLM 0.33/0.34)."""
    builder._workspace_buffer = buffer


#: Every accessor with the module and name it reads (for the test that they still exist).
ACCESSORS: dict[str, tuple[str, str]] = {
    "lanes": (_WORKSPACE, "_workspace_lane"),
    "lanes (micro-batches)": (_UBATCHING, "_THREAD_ID_TO_CONTEXT"),
    "builder_workspace": ("vllm.v1.attention.backends.flashinfer", "FlashInferMetadataBuilder"),
    "attention_backends": ("vllm.config", "get_layers_from_vllm_config"),
    "attention_backends (layers)": (_LAYER_BASE, "AttentionLayerBase"),
}
