"""The facts of a vLLM engine that wspool's sizing rules read.

vLLM's workspace functions take no shape, so the rules see what vLLM's
configuration says (:func:`facts_from_config`) and, where a wrapped call site
knows more, the shape of the query the MLA decode kernel receives
(:func:`decode_kernel_shape`, :func:`folded_kernel_shape`): one row per request
(:data:`REQUESTS`) or per ``fold`` tokens (:data:`TOKENS`). ``batch_size`` is
the layout's configured maximum (never the step's smaller batch), so a buffer
sized before capture never grows under a graph; a call from no wrapped site
gets :meth:`ConfigFacts.widest`. docs/vllm.md ("Facts: sizes that follow the
engine") tables each fact and where it comes from.

Thread semantics: the configuration's facts are cached per process and read
again when vLLM's current configuration object changes; call-time facts are
per thread. Nothing here touches CUDA or imports vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

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


def _num_heads(config: Any) -> int | None:
    model = getattr(config, "model_config", None)
    parallel = getattr(config, "parallel_config", None)
    get_heads = getattr(model, "get_num_attention_heads", None)
    if get_heads is None or parallel is None:
        return None
    try:
        return positive_int(get_heads(parallel))
    except Exception:  # a model config without an HF config behind it: leave the fact out
        return None


def facts_from_config(config: Any) -> dict[str, int]:
    """Return the facts a vLLM configuration gives (see the module's table); missing ones are left out.

    Args:
        config: A ``vllm.config.VllmConfig``, or any object with the same attributes.

    Returns:
        ``{fact: value}`` with positive integers only.
    """
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


@dataclass(frozen=True)
class KernelShape:
    """The query one MLA decode kernel call receives: ``[rows, q_len, heads, dim]``.

    Attributes:
        layout: :data:`REQUESTS` (a row per request) or :data:`TOKENS` (a row per ``fold`` tokens).
        rows: The kernel's batch in this call.
        q_len: Query tokens per row (1 in the :data:`TOKENS` layout).
        heads: Query heads per row: after DCP's all-gather, and ``fold`` times a token's heads.
        cp_world: The DCP world size (1 without DCP).
        fold: Query tokens folded into one row's heads (1: none).
    """

    layout: Layout
    rows: int
    q_len: int
    heads: int
    cp_world: int
    fold: int = 1


def decode_kernel_shape(tokens: int, heads: int, cp_world: int, metadata: Any) -> KernelShape | None:
    """Return the shape vLLM's ``FlashInferMLAImpl.forward_mqa`` hands the kernel, from its query and metadata.

    Follows vLLM's branches (0.33 and 0.34): a non-causal block, and a causal
    DCP batch whose requests have uneven query lengths (0.34), run one row per
    token; everything else one row per request (uniform ``[requests, q_len]``,
    or the compact ragged query of causal speculative decode without DCP,
    tiled per request by the kernel up to ``max_query_len``). vLLM 0.33 views
    an uneven causal DCP batch as uniform rows; one row per token is never
    smaller for it.

    Args:
        tokens: The query's decode tokens (``q.shape[0]``).
        heads: The query's heads (``q.shape[-2]``: after DCP's all-gather).
        cp_world: ``self.dcp_world_size``.
        metadata: vLLM's ``FlashInferMLAMetadata`` of the call.

    Returns:
        The kernel's shape, or ``None`` where the metadata lacks what the branches read.
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
    """Return the shape of a decode with ``fold`` query tokens of a request folded into each row's heads.

    Kimi K3's draft decode (vLLM 0.34, ``drafter.attention.folded_decode``)
    reshapes ``[tokens, heads, dim]`` to ``[tokens / fold, 1, fold * heads, dim]``.
    """
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
    """Return the facts of a kernel call at its layout's configured maximum, over the configuration's others.

    Args:
        configured: The configuration's facts (:func:`facts_from_config`).
        shape: What the kernel receives in this call.

    Returns:
        The configuration's facts with ``q_heads``, ``num_heads`` (``q_heads //
        cp_world``), ``cp_world``, ``q_len`` and ``batch_size`` replaced by the
        kernel's: ``batch_size`` is the most rows the layout can have (the
        call's own where they are more), ``q_len`` at least the configured one
        for rows per request.
    """
    return _with_kernel(configured, _kernel_key(configured, shape))


def widest_facts(configured: Mapping[str, int]) -> dict[str, int]:
    """Return the configuration's facts for a call whose kernel shape is unknown: the most rows at the full q_len.

    ``batch_size`` becomes ``max(max_num_seqs, min(max_num_seqs * q_len,
    max_num_batched_tokens))``: at ``q_len`` per row, at least the rows of either
    layout, so a rule that grows with rows and ``q_len`` is never sized short.
    """
    seqs = configured.get("batch_size")
    tokens = _token_bound(configured)
    if seqs is None or tokens is None:
        return dict(configured)
    return {**configured, "batch_size": max(seqs, tokens)}


_Entry = tuple[Any, Mapping[str, int], Mapping[str, int], dict[tuple[int, int, int, int], Mapping[str, int]]]


class ConfigFacts:
    """The facts of the current vLLM configuration, cached until the configuration object changes.

    Args:
        get_config: Returns the current configuration or ``None``
            (``vllm.config.get_current_vllm_config_or_none``); ``None``: no facts.
    """

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
        """Return :func:`kernel_facts` of the current configuration and ``shape``.

        The same mapping is returned for every call that resolves to the same
        facts (in the steady state, every call of a layout), so the per-call
        path builds nothing new.
        """
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
