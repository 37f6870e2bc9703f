"""SGLang's FlashInfer wrappers with right-sized int workspaces from pool ``flashinfer_int``.

A FlashInfer wrapper keeps its plan in an 8 MiB int workspace and an 8 MiB
pinned copy, though a plan uses a few KiB to about 600 KiB. The SGLang
integration patches :data:`SEAMS` and calls :func:`bind_eager_wrappers` from
``FlashInferAttnBackend``'s constructor, so each wrapper takes a region of its
own, sized by a rule for the largest plan it can make: eager wrappers when the
backend is built, CUDA-graph wrappers before their first plan, MLA wrappers at
their first plan (each plan then runs with its region supplied). A wrapper is
bound once and never shares. This module gives the facts and the seams;
:mod:`wspool.flashinfer.wrapper_buffers` binds and records. docs/sglang.md
("FlashInfer wrappers' int workspaces") lists each wrapper, its facts and what
stays FlashInfer's.

Device semantics: a region lives on the device of the wrapper's float
workspace. Thread semantics: SGLang builds, captures and plans from its
scheduler thread; a supplied region holds for the calling context only.
Capture semantics: a region that would be allocated during capture raises
:class:`~wspool.errors.WorkspaceFrozenError`; the registry's freeze does not
refuse regions. Per step: one look-up and one context variable per MLA plan.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import wspool
from wspool.errors import RuleError
from wspool.flashinfer import kernels, wrapper_buffers
from wspool.flashinfer.backends import PRIVATE_NAMES_READ
from wspool.flashinfer.wrapper_buffers import WrapperBinding, bind_recorded, binding_of, wrapper_record
from wspool.integrations.patching import SaidOnce
from wspool.integrations.sglang import facts as facts_of
from wspool.targets import Target
from wspool.units import format_size, positive_int

__all__ = [
    "SEAMS",
    "bind_eager_wrappers",
    "binding_graph_wrappers",
    "supplying_mla_decode",
    "supplying_mla_prefill",
]

logger = logging.getLogger(__name__)

_PAGED = "sglang.srt.layers.attention.flashinfer_backend"
_MLA = "sglang.srt.layers.attention.flashinfer_mla_backend"

# -- paged wrappers ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Planned:
    """What a backend's indices updater plans with: heads and the query and KV dtypes."""

    num_qo_heads: int
    num_kv_heads: int
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, backend: Any) -> _Planned:
        updater = backend.indices_updater_decode  # the prefill updater reads the same (absent with skip_prefill)
        return cls(updater.num_qo_heads, updater.num_kv_heads, (updater.q_data_type, updater.data_type))

    def facts(self, batch: int, tokens: int) -> dict[str, int]:
        return {
            "batch_size": batch,
            "num_tokens": tokens,
            "num_qo_heads": self.num_qo_heads,
            "num_kv_heads": self.num_kv_heads,
        }


def _decode_rule(backend: Any, planned: _Planned) -> str | None:
    return wrapper_buffers.paged_int_rule(
        "decode",
        use_tensor_cores=bool(backend.decode_use_tensor_cores),
        backend=backend.decode_backend,
        dtypes=planned.dtypes,
    )


def _prefill_rule(backend: str, planned: _Planned) -> str | None:
    return wrapper_buffers.paged_int_rule("prefill", use_tensor_cores=False, backend=backend, dtypes=planned.dtypes)


def _float_workspace(wrapper: Any) -> torch.Tensor:
    # Given back to reset_workspace_buffer unchanged: whatever SGLang built the wrapper on.
    return kernels.wrapper_float_workspace(wrapper)


def _bind_paged(wrapper: Any, kind: str, rule: str, facts: Mapping[str, int]) -> int | None:
    """Bind one paged or ragged wrapper (kept as it is when already bound); return its region's bytes.

    ``None``: the registry keeps FlashInfer's buffers (``wrapper_buffers.keep_flashinfer_buffers``).
    """
    current = binding_of(wrapper)
    if current is None:  # never rebind: a captured graph holds the region's address
        try:
            bind_recorded(
                wrapper, _float_workspace(wrapper), kind=kind, rule=rule, facts=facts, lane=wspool.current_lane(),
                label=f"sglang-{kind}",
            )  # fmt: skip
        except RuleError as exc:
            given = ", ".join(f"{k}={v}" for k, v in facts.items())
            raise RuleError(
                f"{exc} (for SGLang's {kind} wrapper the integration passes {given} and the device's facts; "
                "see docs/sglang.md)"
            ) from exc
        current = binding_of(wrapper)
    return None if current is None else current.region.nbytes


def _describe(bound: Iterable[tuple[str, int | None]]) -> str:
    sizes: dict[str, list[int]] = {}
    for kind, nbytes in bound:
        if nbytes is not None:
            sizes.setdefault(kind, []).append(nbytes)
    return ", ".join(f"{len(n)} {kind} ({format_size(max(n))})" for kind, n in sizes.items()) or "none"


def _not_as_read(backend: Any, exc: AttributeError) -> None:
    SaidOnce.of().say(
        logger,
        ("SGLang", "layout"),
        logging.WARNING,
        "wspool: SGLang's FlashInfer wrappers keep FlashInfer's int workspaces: %s is not as wspool read it (%s)",
        type(backend).__name__,
        exc,
    )


def bind_eager_wrappers(backend: Any) -> None:
    """Give a ``FlashInferAttnBackend``'s eager wrappers right-sized int workspaces (its constructor has just run).

    Facts: B, the requests the backend's ``kv_indptr`` holds (SGLang writes every
    plan's indptr into it, the multi-step draft's ``topk`` branches included);
    decode plans one query row per request, extend at most
    :func:`~wspool.integrations.sglang.facts.prefill_rows`.
    A backend whose attributes are not as read keeps FlashInfer's buffers (said once).

    Raises:
        RuleError: A ``flashinfer_int`` rule cannot be resolved, naming the setting.
        WorkspaceLimitError: Past ``pools.flashinfer_int.max_bytes`` or the device's memory.
    """
    try:
        planned = _Planned.of(backend)
        batch = int(backend.kv_indptr[0].numel()) - 1
        decode_rule, prefill_rule = _decode_rule(backend, planned), _prefill_rule(backend.prefill_backend, planned)
        ragged = backend.prefill_wrapper_ragged
        ragged_backend = kernels.wrapper_backend(ragged)
        if ragged_backend is None:
            raise AttributeError(f"{type(ragged).__name__} has no _backend (read from {PRIVATE_NAMES_READ})")
        wrappers = [
            *(("decode", w, decode_rule) for w in backend.decode_wrappers),
            *(
                ("prefill", w, prefill_rule)
                for w in (*backend.prefill_wrappers_paged, *backend.prefill_wrappers_verify)
            ),
            ("ragged", ragged, _prefill_rule(ragged_backend, planned)),
        ]
        dllm = backend.dllm_config
        per_request = max(
            facts_of.current_facts().get("q_len", 1), positive_int(getattr(dllm, "block_size", None)) or 0
        )
        rows = facts_of.prefill_rows(
            int(backend.max_context_len),
            batch,
            per_request,
            whole_prompts=bool(backend.is_multimodal) or dllm is not None,
        )
    except AttributeError as exc:
        _not_as_read(backend, exc)
        return
    bound: list[tuple[str, int | None]] = []
    kept: list[str] = []
    for kind, wrapper, rule in wrappers:
        facts = planned.facts(batch, batch if kind == "decode" else rows or 0)
        if rule is None:
            kept.append(f"{kind} ({ragged_backend})" if kind == "ragged" else kind)
        elif kind != "decode" and rows is None:
            kept.append(kind)
            SaidOnce.of().say(
                logger,
                ("SGLang", "limits"),
                logging.WARNING,
                "wspool: SGLang's FlashInfer prefill wrappers keep FlashInfer's int "
                "workspaces: SGLang's scheduling limits (max_prefill_tokens) are not published in this process",
            )
        elif (nbytes := _bind_paged(wrapper, kind, rule, facts)) is None:
            kept.append(f"{kind} (the registry keeps FlashInfer's buffers)")
        else:
            bound.append((kind, nbytes))
    logger.info(
        "wspool: %s's FlashInfer wrappers take int workspaces from pool %s: %s (batch %d, extend rows %s); "
        "FlashInfer's own: %s",
        type(backend).__name__,
        wrapper_buffers.INT_POOL,
        _describe(bound),
        batch,
        rows,
        ", ".join(sorted(set(kept))) or "none",
    )


def _bind_graph_wrappers(backend: Any, bs: int, num_tokens: int) -> None:
    """Bind the wrappers ``_prepare_cuda_graph_metadata`` just made (``forward_metadata`` holds them)."""
    try:
        metadata = backend.forward_metadata
        planned = _Planned.of(backend)
        if hasattr(metadata, "decode_wrappers"):
            # A decode graph wrapper's indptr holds num_tokens requests (the draft's topk branches).
            rows = max(bs, num_tokens)
            kind, wrappers, rule = "graph-decode", metadata.decode_wrappers, _decode_rule(backend, planned)
            facts = planned.facts(rows, rows)
        else:
            # Verify, draft extend, diffusion and full-graph prefill: bs requests, the capture's tokens.
            kind, wrappers = "graph-prefill", metadata.prefill_wrappers
            rule, facts = _prefill_rule(backend.prefill_backend, planned), planned.facts(bs, max(bs, num_tokens))
    except AttributeError as exc:
        _not_as_read(backend, exc)
        return
    if rule is not None:
        bound = [(kind, _bind_paged(w, kind, rule, facts)) for w in wrappers]
        logger.debug("wspool: %s batch %d tokens %d: %s", type(backend).__name__, bs, num_tokens, _describe(bound))


def binding_graph_wrappers(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FlashInferAttnBackend._prepare_cuda_graph_metadata``: bind the graph wrappers it makes.

    SGLang calls it while capturing (before the capture's first plan, outside
    ``torch.cuda.graph``) and for a model adapter's decode wrappers; wrappers it
    reuses (full-graph prefill's, made for the largest bucket, captured first)
    are bound already and stay as they are.
    """

    @functools.wraps(original)
    def _prepare_cuda_graph_metadata(self: Any, bs: int, num_tokens: int, forward_mode: Any, spec_info: Any) -> Any:
        result = original(self, bs, num_tokens, forward_mode, spec_info)
        _bind_graph_wrappers(self, bs, num_tokens)
        return result

    return _prepare_cuda_graph_metadata


# -- MLA wrappers --------------------------------------------------------------------------


def _bind_mla(wrapper: Any) -> WrapperBinding | None:
    """Give an MLA wrapper its region and pinned copy before its first plan (nothing where the hook is not in place).

    A wrapper left with FlashInfer's buffers is recorded, and its later plans pass straight through.
    """
    record = bind_recorded(
        wrapper, _float_workspace(wrapper), kind="mla", rule="mla", facts={}, lane=wspool.current_lane(), label="mla"
    )
    binding = binding_of(wrapper)
    if binding is None:
        SaidOnce.of().say(
            logger,
            ("SGLang", "mla"),
            logging.INFO,
            "wspool: SGLang's FlashInfer MLA wrappers keep FlashInfer's int workspaces: %s",
            record.why,
        )
    else:
        size = format_size(binding.region.nbytes)
        SaidOnce.of().say(
            logger,
            ("SGLang", "mla"),
            logging.INFO,
            "wspool: SGLang's FlashInfer MLA wrappers take %s int workspaces from pool %s at their first plan",
            size,
            wrapper_buffers.INT_POOL,
        )
    return binding


def _nothing() -> None:
    return None


def supplying_mla_decode(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FlashInferMLAIndicesUpdaterDecode.call_begin_forward``: bind the wrapper once, plan inside supplying."""

    supplied = wrapper_buffers.SUPPLIED_BY_THREAD  # set inline around exactly the plan call: it runs every step
    thread = threading.get_ident
    # The last bound wrapper met and its binding, one tuple (threads replace it whole): known by identity, without
    # a look-up. An MLA wrapper's binding never changes once made (bind_mla_wrapper keeps it); the tuple is let go
    # when its wrapper dies, so it keeps no region alive.
    seen: tuple[Callable[[], Any], WrapperBinding | None] = (_nothing, None)

    def forget(_dead: Any) -> None:
        nonlocal seen
        seen = (_nothing, None)

    # SGLang 0.5.23's parameters, written out: forwarding them costs less than packing *args and **kwargs.
    @functools.wraps(original)
    def call_begin_forward(
        self: Any,
        wrapper: Any,
        paged_kernel_lens: Any,
        paged_kernel_lens_sum: Any,
        q_indptr: Any,
        kv_indptr: Any,
        init_metadata_replay: bool = False,
        spec_info: Any = None,
        *,
        plan: Any,
        req_pool_indices: Any,
        **fast_decode_kwargs: Any,
    ) -> Any:
        nonlocal seen
        ref, binding = seen
        if ref() is not wrapper:
            binding = binding_of(wrapper)
            if binding is None and wrapper_record(wrapper) is None:
                binding = _bind_mla(wrapper)  # None: it keeps FlashInfer's buffers and plans as written
            if binding is not None:
                seen = (weakref.ref(wrapper, forget), binding)
        # None supplies nothing, even inside an outer supply: that wrapper's region is not this one's.
        key = thread()
        previous = supplied.get(key)
        supplied[key] = binding
        try:
            if fast_decode_kwargs:  # graph replays pass their host arrays; an eager step passes none
                return original(
                    self,
                    wrapper,
                    paged_kernel_lens,
                    paged_kernel_lens_sum,
                    q_indptr,
                    kv_indptr,
                    init_metadata_replay,
                    spec_info,
                    plan=plan,
                    req_pool_indices=req_pool_indices,
                    **fast_decode_kwargs,
                )
            # Without ** the call is a plain vectorcall: no keyword dictionary is merged.
            return original(
                self,
                wrapper,
                paged_kernel_lens,
                paged_kernel_lens_sum,
                q_indptr,
                kv_indptr,
                init_metadata_replay,
                spec_info,
                plan=plan,
                req_pool_indices=req_pool_indices,
            )
        finally:
            supplied[key] = previous  # a None entry reads as nothing supplied

    return call_begin_forward


def supplying_mla_prefill(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FlashInferMLAIndicesUpdaterPrefill.call_begin_forward``: as the decode one, for ``wrapper_paged``.

    With ``use_ragged`` the call plans the ragged wrapper instead, so the MLA
    wrapper is not bound for it.
    """

    @functools.wraps(original)
    def call_begin_forward(
        self: Any,
        wrapper_ragged: Any,
        wrapper_paged: Any,
        req_pool_indices: Any,
        paged_kernel_lens: Any,
        paged_kernel_lens_sum: Any,
        seq_lens: Any,
        prefix_lens: Any,
        kv_indptr: Any,
        qo_indptr: Any,
        use_ragged: bool,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        binding = binding_of(wrapper_paged)
        if binding is None and not use_ragged and wrapper_record(wrapper_paged) is None:
            binding = _bind_mla(wrapper_paged)
        return wrapper_buffers.call_supplying(
            binding,
            original,
            self,
            wrapper_ragged,
            wrapper_paged,
            req_pool_indices,
            paged_kernel_lens,
            paged_kernel_lens_sum,
            seq_lens,
            prefix_lens,
            kv_indptr,
            qo_indptr,
            use_ragged,
            *args,
            **kwargs,
        )

    return call_begin_forward


# -- the seams -----------------------------------------------------------------------------


_INT = "int workspaces from pool flashinfer_int"

#: The methods wrapped besides ``FlashInferAttnBackend.__init__`` (which calls :func:`bind_eager_wrappers`),
#: each ``(module, "Class.method", SGLang 0.5.23's parameter names, the replacement's maker, what it becomes)``:
#: the SGLang integration patches them with its other targets.
SEAMS: tuple[Target, ...] = (
    Target(
        _PAGED, "FlashInferAttnBackend._prepare_cuda_graph_metadata",
        ("self", "bs", "num_tokens", "forward_mode", "spec_info"), binding_graph_wrappers,
        f"CUDA-graph wrappers' {_INT}",
    ),
    Target(
        _MLA, "FlashInferMLAIndicesUpdaterDecode.call_begin_forward",
        ("self", "wrapper", "paged_kernel_lens", "paged_kernel_lens_sum", "q_indptr", "kv_indptr",
         "init_metadata_replay", "spec_info", "plan", "req_pool_indices", "fast_decode_kwargs"),
        supplying_mla_decode, f"MLA decode plans with {_INT}",
    ),
    Target(
        _MLA, "FlashInferMLAIndicesUpdaterPrefill.call_begin_forward",
        ("self", "wrapper_ragged", "wrapper_paged", "req_pool_indices", "paged_kernel_lens", "paged_kernel_lens_sum",
         "seq_lens", "prefix_lens", "kv_indptr", "qo_indptr", "use_ragged", "spec_info", "attn_dcp_metadata",
         "fast_verify_plan_kwargs", "plan", "qo_indptr_cpu", "kv_indptr_cpu", "kv_len_arr_cpu"),
        supplying_mla_prefill, f"MLA prefill plans with {_INT}",
    ),
)  # fmt: skip
