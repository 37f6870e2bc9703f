"""The facts of a vLLM engine that wspool's sizing rules read.

The rules see vLLM's configuration and, at a wrapped call site, the shape of
the query the MLA decode kernel receives. ``batch_size`` is the layout's
configured maximum, so a buffer sized before capture never grows under a
graph; docs/vllm.md ("Facts: sizes that follow the engine") tables each fact.
The configuration's facts are cached per process until vLLM's configuration
object changes; call-time facts are per thread. Nothing here touches CUDA or
imports vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from wspool.bounds import FactLimit
from wspool.units import ceil_div, positive_int

__all__ = [
    "FACT_NAMES",
    "REQUESTS",
    "TOKENS",
    "ConfigFacts",
    "KernelShape",
    "call_facts",
    "decode_kernel_shape",
    "facts_from_config",
    "folded_kernel_shape",
    "kernel_facts",
    "limits_from_config",
    "set_call_facts",
    "widest_facts",
]

#: The facts this module can give a rule, in the order of the table above.
FACT_NAMES = ("num_heads", "cp_world", "batch_size", "q_len", "batch_tokens", "kv_dtype_size", "q_heads")

Layout = Literal["requests", "tokens"]

#: One kernel row per request, holding all its query tokens.
REQUESTS: Layout = "requests"
#: One kernel row per ``fold`` query tokens (one token in the row, ``fold`` tokens folded into the heads).
TOKENS: Layout = "tokens"

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

# Cached kernel facts per configuration; bounded so odd shapes cannot grow it without end.
_KERNEL_CACHE_LIMIT = 256


def _kv_dtype_size(config: Any) -> int | None:
    cache_dtype = getattr(getattr(config, "cache_config", None), "cache_dtype", None)
    if isinstance(cache_dtype, str) and cache_dtype != "auto":
        return _KV_DTYPE_SIZES.get(cache_dtype)
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    itemsize = getattr(dtype, "itemsize", None)
    return positive_int(itemsize)


def _heads(model: Any, parallel: Any) -> int | None:
    """A model config's attention heads per rank under ``parallel`` (``None``: it cannot say)."""
    get_heads = getattr(model, "get_num_attention_heads", None)
    if get_heads is None or parallel is None:
        return None
    try:
        return positive_int(get_heads(parallel))
    except Exception:  # a model config without an HF config behind it: leave the fact out
        return None


def _num_heads(config: Any) -> int | None:
    return _heads(getattr(config, "model_config", None), getattr(config, "parallel_config", None))


def facts_from_config(config: Any) -> dict[str, int]:
    """Return the positive facts a ``VllmConfig`` (or look-alike) gives; missing ones are left out."""
    scheduler = getattr(config, "scheduler_config", None)
    facts: dict[str, int | None] = {
        "num_heads": _num_heads(config),
        "cp_world": positive_int(
            getattr(getattr(config, "parallel_config", None), "decode_context_parallel_size", None)
        ),
        "batch_size": positive_int(getattr(scheduler, "max_num_seqs", None)),
        "batch_tokens": positive_int(getattr(scheduler, "max_num_batched_tokens", None)),
        "kv_dtype_size": _kv_dtype_size(config),
    }
    speculative = getattr(config, "speculative_config", None)
    tokens = 0 if speculative is None else getattr(speculative, "num_speculative_tokens", None)
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
        facts["q_len"] = 1 + tokens
    return {name: value for name, value in facts.items() if value is not None}


def _draft_heads(config: Any) -> int | None:
    speculative = getattr(config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None)
    parallel = getattr(speculative, "draft_parallel_config", None) or getattr(config, "parallel_config", None)
    return _heads(draft, parallel)  # None: the target's heads bound it


def limits_from_config(config: Any) -> dict[str, FactLimit]:
    """Return the limits a ``VllmConfig`` puts on the facts its kernel calls pass (for the reservation).

    ``batch_size`` goes up to either layout's most rows (:func:`widest_facts`),
    ``q_len`` to one plus the speculative tokens, ``num_heads`` to the heads per
    rank (the draft model's too), ``q_heads`` to those heads times the DCP world;
    the DCP world, the batched tokens, the KV element size and ``kv_lora_rank``
    are fixed. A fact the configuration does not give has no limit.
    """
    facts = facts_from_config(config)
    widest = widest_facts(facts)
    limits: dict[str, FactLimit] = {}

    def up_to(name: str, high: int | None, source: str) -> None:
        if high is not None and high >= 1:
            limits[name] = FactLimit(1, high, None, source)

    def fixed(name: str, value: int | None, source: str) -> None:
        if value is not None:
            limits[name] = FactLimit(value, value, (value,), source)

    up_to(
        "batch_size",
        widest.get("batch_size"),
        "vLLM's max_num_seqs / max_num_batched_tokens (--max-num-seqs, --max-num-batched-tokens)",
    )
    up_to("q_len", facts.get("q_len", 1), "vLLM's num_speculative_tokens + 1 (--speculative-config)")
    heads = max((h for h in (facts.get("num_heads"), _draft_heads(config)) if h is not None), default=None)
    cp_world = facts.get("cp_world", 1)
    up_to("num_heads", heads, "vLLM's attention heads per rank (the model, --tensor-parallel-size)")
    up_to("q_heads", None if heads is None else heads * cp_world, "heads per rank x --decode-context-parallel-size")
    fixed("cp_world", cp_world, "vLLM's --decode-context-parallel-size")
    fixed("batch_tokens", facts.get("batch_tokens"), "vLLM's --max-num-batched-tokens")
    fixed("kv_dtype_size", facts.get("kv_dtype_size"), "vLLM's --kv-cache-dtype")
    model = getattr(config, "model_config", None)
    rank = positive_int(getattr(getattr(model, "hf_text_config", None), "kv_lora_rank", None))
    fixed("kv_lora_rank", rank, "the model's kv_lora_rank")
    return limits


@dataclass(frozen=True)
class KernelShape:
    """The query one MLA decode kernel call receives: ``[rows, q_len, heads, dim]``.

    ``layout`` is :data:`REQUESTS` (a row per request) or :data:`TOKENS` (a row per
    ``fold`` tokens, ``q_len`` 1); ``heads`` counts after DCP's all-gather and folding.
    """

    layout: Layout
    rows: int
    q_len: int
    heads: int
    cp_world: int
    fold: int = 1


def decode_kernel_shape(tokens: int, heads: int, cp_world: int, metadata: Any) -> KernelShape | None:
    """Return the shape ``FlashInferMLAImpl.forward_mqa`` hands the kernel, following its branches (docs/vllm.md).

    ``tokens`` and ``heads`` are ``q.shape[0]`` and ``q.shape[-2]``; ``metadata`` is
    the call's ``FlashInferMLAMetadata``. ``None`` where it lacks what the branches read.
    """
    decode = getattr(metadata, "decode", None)
    num_decodes = positive_int(getattr(metadata, "num_decodes", None))
    max_query_len = positive_int(getattr(decode, "max_query_len", None))
    num_decode_tokens = getattr(metadata, "num_decode_tokens", tokens)
    if decode is None or num_decodes is None or max_query_len is None or not isinstance(num_decode_tokens, int):
        return None
    if not getattr(metadata, "causal", True):
        return KernelShape(TOKENS, tokens, 1, heads, cp_world)
    if max_query_len > 1 and cp_world == 1:
        return KernelShape(REQUESTS, num_decodes, max_query_len, heads, cp_world)
    if num_decode_tokens != num_decodes * max_query_len:
        return KernelShape(TOKENS, tokens, 1, heads, cp_world)
    return KernelShape(REQUESTS, num_decodes, max(1, tokens // num_decodes), heads, cp_world)


def folded_kernel_shape(tokens: int, heads: int, cp_world: int, fold: int) -> KernelShape:
    """Return the shape of Kimi K3's draft decode: ``[tokens / fold, 1, fold * heads, dim]``."""
    fold = max(1, fold)
    return KernelShape(TOKENS, max(1, tokens // fold), 1, heads * fold, cp_world, fold)


def _token_bound(configured: Mapping[str, int]) -> int | None:
    """The most decode tokens a step holds: ``min(max_num_seqs * q_len, max_num_batched_tokens)``."""
    seqs = configured.get("batch_size")
    tokens = configured.get("batch_tokens")
    if seqs is None:
        return tokens
    by_seqs = seqs * configured.get("q_len", 1)
    return by_seqs if tokens is None else min(by_seqs, tokens)


def _kernel_key(configured: Mapping[str, int], shape: KernelShape) -> tuple[int, int, int, int]:
    """(batch_size, q_len, q_heads, cp_world) of a kernel call at its layout's configured maximum."""
    if shape.layout == REQUESTS:
        bound = configured.get("batch_size")
        q_len = max(shape.q_len, configured.get("q_len", 1))
    else:
        tokens = _token_bound(configured)
        bound = None if tokens is None else ceil_div(tokens, shape.fold)
        q_len = shape.q_len
    return max(shape.rows, bound or 0), q_len, shape.heads, max(1, shape.cp_world)


def _with_kernel(configured: Mapping[str, int], key: tuple[int, int, int, int]) -> dict[str, int]:
    batch_size, q_len, heads, cp_world = key
    return {
        **configured,
        "q_heads": heads,
        "num_heads": max(1, heads // cp_world),
        "cp_world": cp_world,
        "batch_size": batch_size,
        "q_len": q_len,
    }


def kernel_facts(configured: Mapping[str, int], shape: KernelShape) -> dict[str, int]:
    """Return the configured facts with the kernel call's shape facts, ``batch_size`` at the layout's maximum rows."""
    return _with_kernel(configured, _kernel_key(configured, shape))


def widest_facts(configured: Mapping[str, int]) -> dict[str, int]:
    """Return the configuration's facts for a call of unknown kernel shape: either layout's most rows at full q_len."""
    seqs = configured.get("batch_size")
    tokens = _token_bound(configured)
    if seqs is None or tokens is None:
        return dict(configured)
    return {**configured, "batch_size": max(seqs, tokens)}


_Entry = tuple[Any, Mapping[str, int], Mapping[str, int], dict[tuple[int, int, int, int], Mapping[str, int]]]


class ConfigFacts:
    """The facts of the current vLLM configuration (from ``get_config``), cached until that object changes."""

    def __init__(self, get_config: Callable[[], Any] | None) -> None:
        self._get_config = get_config
        # (configuration, its facts, widest_facts of them, kernel facts by _kernel_key), replaced as one.
        self._cached: _Entry = (object(), {}, {}, {})

    def _entry(self) -> _Entry:
        config = None if self._get_config is None else self._get_config()
        cached = self._cached
        if config is not cached[0]:
            facts = {} if config is None else facts_from_config(config)
            cached = (config, facts, widest_facts(facts), {})
            self._cached = cached
        return cached

    def get(self) -> Mapping[str, int]:
        """Return the facts of the current configuration (an empty mapping without one)."""
        return self._entry()[1]

    def widest(self) -> Mapping[str, int]:
        """Return :func:`widest_facts` of the current configuration (for calls from no wrapped call site)."""
        return self._entry()[2]

    def for_kernel(self, shape: KernelShape) -> Mapping[str, int]:
        """Return :func:`kernel_facts` of the current configuration and ``shape``, one mapping per distinct result."""
        _, facts, _, by_key = self._entry()
        key = _kernel_key(facts, shape)
        found = by_key.get(key)
        if found is None:
            if len(by_key) >= _KERNEL_CACHE_LIMIT:
                by_key.clear()
            found = by_key.setdefault(key, _with_kernel(facts, key))
        return found


_CALL = threading.local()


def call_facts() -> Mapping[str, int] | None:
    """Return the facts the current thread's vLLM call site set, or ``None`` outside one."""
    return getattr(_CALL, "facts", None)


def set_call_facts(facts: Mapping[str, int] | None) -> Mapping[str, int] | None:
    """Set the current thread's call-time facts; return the previous ones (to restore them after the call)."""
    previous = getattr(_CALL, "facts", None)
    _CALL.facts = facts
    return previous
