"""The facts of a vLLM engine that wspool's sizing rules read.

vLLM's workspace functions take no shape (``_get_workspace_buffer(return_lse)``),
so the rules see what vLLM's configuration says and, where vLLM's call site
knows more, what that call site says:

=================  ===============================================================  =====================
fact               from the configuration                                           at call time
=================  ===============================================================  =====================
``num_heads``      ``model_config.get_num_attention_heads(parallel_config)``        ``q.shape[-2] // cp_world``
                   (this rank's query heads, before DCP's all-gather)               in ``forward_mqa``
``cp_world``       ``parallel_config.decode_context_parallel_size``                 ``self.dcp_world_size``
``batch_size``     ``scheduler_config.max_num_seqs`` (the largest batch)            (not read: see below)
``q_len``          ``1 + speculative_config.num_speculative_tokens``                (not read)
``kv_dtype_size``  ``cache_config.cache_dtype`` (``auto``: the model's dtype)       (not read)
``q_heads``        (none)                                                           ``q.shape[-2]``: the
                                                                                    heads the kernel sees
=================  ===============================================================  =====================

The batch is the configured maximum, never the step's own batch: a buffer
sized for the largest batch is allocated once, before CUDA-graph capture, and
never grows under a captured graph. A fact that the configuration does not
give is left out, and a rule that reads it raises a
:class:`~wspool.errors.RuleError` naming it.

Thread semantics: the configuration's facts are cached per process and read
again when ``get_current_vllm_config_or_none()`` returns another object (a
benign race: two threads may both read it). The call-time facts are per thread.
Nothing here touches CUDA or imports vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "FACT_NAMES",
    "ConfigFacts",
    "call_facts",
    "facts_from_config",
    "set_call_facts",
]

#: The facts this module can give a rule, in the order of the table above.
FACT_NAMES = ("num_heads", "cp_world", "batch_size", "q_len", "kv_dtype_size", "q_heads")

_KV_DTYPE_SIZES = {
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "nvfp4": 1,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "float": 4,
    "float32": 4,
}


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _kv_dtype_size(config: Any) -> int | None:
    cache_dtype = getattr(getattr(config, "cache_config", None), "cache_dtype", None)
    if isinstance(cache_dtype, str) and cache_dtype != "auto":
        return _KV_DTYPE_SIZES.get(cache_dtype)
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    itemsize = getattr(dtype, "itemsize", None)
    return _positive_int(itemsize)


def _num_heads(config: Any) -> int | None:
    model = getattr(config, "model_config", None)
    parallel = getattr(config, "parallel_config", None)
    get_heads = getattr(model, "get_num_attention_heads", None)
    if get_heads is None or parallel is None:
        return None
    try:
        return _positive_int(get_heads(parallel))
    except Exception:  # a model config without an HF config behind it: leave the fact out
        return None


def facts_from_config(config: Any) -> dict[str, int]:
    """Return the facts a vLLM configuration gives (see the module's table); missing ones are left out.

    Args:
        config: A ``vllm.config.VllmConfig``, or any object with the same attributes.

    Returns:
        ``{fact: value}`` with positive integers only.
    """
    facts: dict[str, int | None] = {
        "num_heads": _num_heads(config),
        "cp_world": _positive_int(
            getattr(getattr(config, "parallel_config", None), "decode_context_parallel_size", None)
        ),
        "batch_size": _positive_int(getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None)),
        "kv_dtype_size": _kv_dtype_size(config),
    }
    speculative = getattr(config, "speculative_config", None)
    tokens = 0 if speculative is None else getattr(speculative, "num_speculative_tokens", None)
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
        facts["q_len"] = 1 + tokens
    return {name: value for name, value in facts.items() if value is not None}


class ConfigFacts:
    """The facts of the current vLLM configuration, cached until the configuration object changes.

    Args:
        get_config: Returns the current configuration or ``None``
            (``vllm.config.get_current_vllm_config_or_none``); ``None``: no facts.
    """

    def __init__(self, get_config: Callable[[], Any] | None) -> None:
        self._get_config = get_config
        self._cached: tuple[Any, Mapping[str, int]] = (object(), {})

    def get(self) -> Mapping[str, int]:
        """Return the facts of the current configuration (an empty mapping without one)."""
        if self._get_config is None:
            return {}
        config = self._get_config()
        cached_config, facts = self._cached
        if config is not cached_config:
            facts = {} if config is None else facts_from_config(config)
            self._cached = (config, facts)
        return facts


_CALL = threading.local()


def call_facts() -> Mapping[str, int] | None:
    """Return the facts the current thread's vLLM call site set, or ``None`` outside one."""
    return getattr(_CALL, "facts", None)


def set_call_facts(facts: Mapping[str, int] | None) -> Mapping[str, int] | None:
    """Set the current thread's call-time facts; return the previous ones (to restore them after the call)."""
    previous = getattr(_CALL, "facts", None)
    _CALL.facts = facts
    return previous
