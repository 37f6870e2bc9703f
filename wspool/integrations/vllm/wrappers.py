"""vLLM's FlashInfer paged wrappers on right-sized int workspaces from pool ``flashinfer_int`` (vLLM 0.33, 0.34).

The plugin wraps the builder's ``_get_decode_wrapper`` and ``_get_prefill_wrapper``:
a wrapper returned for the first time takes a region, on the device of the
builder's float workspace, before vLLM plans it; wrappers no rule bounds keep
FlashInfer's buffers (:func:`~wspool.flashinfer.wrapper_buffers.wrapper_record`
says why). This module gives the facts; :mod:`wspool.flashinfer.wrapper_buffers`
binds. vLLM calls the getters outside capture, so a region is in place before
any graph captures its wrapper. One thread per builder. Facts per wrapper:
docs/vllm.md ("FlashInfer wrappers' int workspaces").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from wspool.flashinfer.wrapper_buffers import (
    WrapperRecord,
    bind_recorded,
    paged_int_rule,
    planner_backend,
    record_wrapper,
    wrapper_record,
)
from wspool.integrations.patching import SaidOnce, marked
from wspool.integrations.vllm.facts import facts_from_config

__all__ = ["step_bounds", "wrap_get_decode_wrapper", "wrap_get_prefill_wrapper"]

logger = logging.getLogger("vllm.wspool")

#: The names vLLM's FlashInfer backend module gives the classes it builds.
_DECODE_CLASS = "BatchDecodeWithPagedKVCacheWrapper"
_PREFILL_CLASS = "BatchPrefillWithPagedKVCacheWrapper"
_DCP_CLASS = "BatchDCPPrefillWrapper"


def step_bounds(config: Any) -> tuple[int, int]:
    """Return ``(max_num_seqs, T)``: the most requests and query tokens one step of ``config`` plans (docs/vllm.md).

    ``LookupError`` where the configuration lacks either scheduler bound.
    """
    facts = facts_from_config(config)
    seqs, batched = facts.get("batch_size"), facts.get("batch_tokens")
    if seqs is None or batched is None:
        raise LookupError("vLLM's scheduler_config gives no max_num_seqs or max_num_batched_tokens")
    return seqs, max(batched, seqs * facts.get("q_len", 1))


def _left_alone(record: WrapperRecord, level: int = logging.INFO) -> WrapperRecord:
    said = f"vLLM's {record.kind} wrapper keeps FlashInfer's 8 MiB int workspace and pinned copy: {record.why}"
    SaidOnce.of().say(logger, ("vLLM", said), level, "wspool: %s", said)
    return record


def _leave(wrapper: Any, kind: str, facts: Mapping[str, int], why: str, level: int = logging.INFO) -> WrapperRecord:
    return _left_alone(record_wrapper(wrapper, WrapperRecord(kind, None, facts, why)), level)


def _bind(
    builder: Any, wrapper: Any, *, kind: str, planner: str, facts: Mapping[str, int], dtypes: tuple[Any, ...]
) -> WrapperRecord:
    """Give ``wrapper`` a region for ``facts`` where its planner has a rule; record and return what was done."""
    # The backend it was built with: FlashInfer keeps it until its first plan resolves "auto".
    backend = getattr(wrapper, "_backend", None)
    workspace = getattr(builder, "_workspace_buffer", None)
    if not isinstance(backend, str) or not isinstance(workspace, torch.Tensor):
        return _leave(
            wrapper, kind, facts, "its backend or the builder's float workspace is not where wspool reads them"
        )
    device = workspace.device
    rule = paged_int_rule(
        planner,
        use_tensor_cores=bool(getattr(wrapper, "use_tensor_cores", False)),
        backend=planner_backend(backend, device),
        dtypes=dtypes,
    )
    if rule is None:
        why = f"backend {backend!r} on {device} may plan with fa3, trtllm-gen or another planner no rule bounds"
        return _leave(wrapper, kind, facts, why)
    from wspool.integrations.vllm import INTEGRATION  # the package that installed this wrapper: loaded

    record = bind_recorded(
        wrapper,
        workspace,
        kind=kind,
        rule=rule,
        facts=facts,
        lane=INTEGRATION.getters.current_lane(),
        label=f"vllm-{kind}",
    )
    return record if record.rule is not None else _left_alone(record)


def _facts(builder: Any, batch_size: int, num_tokens: int, num_qo_heads: int) -> dict[str, int]:
    return {
        "batch_size": batch_size,
        "num_tokens": num_tokens,
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": int(builder.num_kv_heads),
        "head_dim": int(builder.head_dim),
        "page_size": int(builder.page_size),
    }


def _record_decode(
    namespace: Mapping[str, Any], builder: Any, wrapper: Any, batch_size: int, use_cudagraph: bool, q_len: int
) -> WrapperRecord:
    kind = "decode-graph" if use_cudagraph else "decode"
    try:
        heads = int(builder.num_qo_heads) * int(getattr(builder, "dcp_world_size", 1))
        if use_cudagraph:  # planned at this batch and query length only (vLLM keys the wrapper by them)
            facts = _facts(builder, batch_size, batch_size * q_len, heads)
        else:
            _, step = step_bounds(builder.vllm_config)
            facts = _facts(builder, max(step, batch_size), max(step, batch_size * q_len), heads)
        dtypes = (builder.q_data_type_decode, builder.kv_cache_dtype)
    except (AttributeError, LookupError, TypeError, ValueError) as exc:
        return _leave(wrapper, kind, {}, f"the builder does not give its bounds ({exc})", logging.WARNING)
    if type(wrapper) is not namespace.get(_DECODE_CLASS):
        return _leave(wrapper, kind, facts, f"it is a {type(wrapper).__name__}, not FlashInfer's {_DECODE_CLASS}")
    return _bind(builder, wrapper, kind=kind, planner="decode", facts=facts, dtypes=dtypes)


def _record_prefill(namespace: Mapping[str, Any], builder: Any, wrapper: Any) -> WrapperRecord:
    dcp = type(wrapper) is namespace.get(_DCP_CLASS)
    kind = "dcp-context" if dcp else "prefill"
    try:
        seqs, step = step_bounds(builder.vllm_config)
        heads = int(builder.num_qo_heads) * (int(builder.dcp_world_size) if dcp else 1)
        facts = _facts(builder, seqs, step, heads)
        dtypes = (builder.q_data_type_prefill, builder.kv_cache_dtype)
    except (AttributeError, LookupError, TypeError, ValueError) as exc:
        return _leave(wrapper, kind, {}, f"the builder does not give its bounds ({exc})", logging.WARNING)
    # vLLM's DCP wrapper plans its context pass on a paged prefill wrapper of its own, over the gathered heads.
    target = getattr(wrapper, "_native_context", None) if dcp else wrapper
    if type(target) is not namespace.get(_PREFILL_CLASS):
        return _leave(wrapper, kind, facts, f"it is a {type(target).__name__}, not FlashInfer's {_PREFILL_CLASS}")
    record = _bind(builder, target, kind=kind, planner="prefill", facts=facts, dtypes=dtypes)
    return record_wrapper(wrapper, record)  # a DCP wrapper answers with its context wrapper's record


def wrap_get_decode_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FlashInferMetadataBuilder._get_decode_wrapper``: a decode wrapper gets its region before its first plan.

    A graph wrapper is sized for its batch and query length, the eager one for
    :func:`step_bounds`. Raises as :func:`~wspool.flashinfer.wrapper_buffers.bind_paged_wrapper`.
    """
    namespace: Mapping[str, Any] = getattr(original, "__globals__", {})  # read at each call: tests replace classes

    def _get_decode_wrapper(self: Any, batch_size: int, use_cudagraph: bool = False, q_len_per_req: int = 1) -> Any:
        wrapper = original(self, batch_size, use_cudagraph, q_len_per_req)
        if wrapper_record(wrapper) is None:
            _record_decode(namespace, self, wrapper, batch_size, use_cudagraph, q_len_per_req)
        return wrapper

    return marked(_get_decode_wrapper, original)


def wrap_get_prefill_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FlashInferMetadataBuilder._get_prefill_wrapper``: a prefill wrapper gets a region before its first plan.

    Causal, non-causal and DCP context wrappers are sized for :func:`step_bounds`;
    raises as :func:`~wspool.flashinfer.wrapper_buffers.bind_paged_wrapper`.
    """
    namespace: Mapping[str, Any] = getattr(original, "__globals__", {})

    def _get_prefill_wrapper(self: Any, causal: bool = True) -> Any:
        wrapper = original(self, causal)
        if wrapper_record(wrapper) is None:
            _record_prefill(namespace, self, wrapper)
        return wrapper

    return marked(_get_prefill_wrapper, original)
