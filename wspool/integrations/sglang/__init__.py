"""wspool in SGLang 0.5.23: the ``sglang.srt.plugins`` entry point and what it patches.

SGLang calls :func:`register` early in every process it starts (one scheduler
per TP x PP rank, and its helpers) through ``load_plugins()`` and the
``sglang.srt.plugins`` entry point ``wspool``; ``SGLANG_PLUGINS``, when set,
must name ``wspool``. :data:`TARGETS` form one group on the one seam
(:mod:`wspool.integrations.patching`), patched all or nothing: a SGLang whose
targets differ keeps its own behaviour everywhere, with one warning naming
them (SGLang's ``HookRegistry`` applies hooks one by one with no undo, so it
is not used). SGLang's named workspaces are served by
:mod:`~wspool.integrations.sglang.buffers`, with the runner's facts from
:mod:`~wspool.integrations.sglang.facts`, and its FlashInfer wrappers take
int workspaces in :mod:`~wspool.integrations.sglang.wrappers`. docs/sglang.md
lists them.

Thread semantics: SGLang loads plugins at start-up, before serving; loading is
idempotent and never raises.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import wspool
from wspool.bounds import FactLimit, Reservation
from wspool.integrations import RESERVE_ENV_VAR
from wspool.integrations.patching import Integration, entry_points
from wspool.integrations.reserving import engine_plan, reserve_for_engine
from wspool.integrations.sglang import buffers, wrappers
from wspool.integrations.sglang import facts as facts_of
from wspool.integrations.sglang.buffers import (
    BUFFERS,
    CUTE_DSL_WORKSPACE,
    DEVICE_ENV_VAR,
    SGLANG_POOLS,
    configure,
    serve,
)
from wspool.settings.profiles import engine_spec
from wspool.targets import Target, TargetGroup

__all__ = [
    "BUFFERS",
    "CUTE_DSL_WORKSPACE",
    "DEVICE_ENV_VAR",
    "ENABLE_ENV_VAR",
    "GROUPS",
    "INTEGRATION",
    "SGLANG_POOLS",
    "TARGETS",
    "SglangIntegration",
    "configure",
    "limits_from_server",
    "logger",
    "patched",
    "register",
    "reservation_plan",
    "reserve_before_kv_pool",
    "serve",
    "unregister",
]

#: The integration's logger (SGLang shows it with its own lines).
logger = logging.getLogger("wspool.integrations.sglang")

_RUNNER = "sglang.srt.model_executor.runner."
_KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"
_FACTS = "the runner's facts"
_CUTE = buffers.CUTE_DSL_WORKSPACE


def _init(
    module: str,
    cls: str,
    *more: str,
    make: Callable[[Any], Any] = buffers.wrap_constructor,
    what: str = _FACTS,
    **kw: Any,
) -> Target:
    """A backend constructor target: ``__init__(self, model_runner, skip_prefill, *more)``."""
    params = ("self", "model_runner", "skip_prefill", *more)
    return Target(f"sglang.srt.layers.attention.{module}", f"{cls}.__init__", params, make, what, **kw)


#: What the integration patches, in order; a missing one means none is patched.
TARGETS: tuple[Target, ...] = (
    Target(
        "sglang.srt.runtime_context",
        "RuntimeContext.get_buffer",
        ("self", "name", "factory"),
        buffers.wrap_get_buffer,
        f"pools for {', '.join(buffers.BUFFERS)}; other names SGLang's own",
        requires=("get_parallel", "get_spec", "get_exec", "get_schedule", "max_prefill_buffer_tokens"),
    ),
    _init(
        "flashinfer_backend", "FlashInferAttnBackend", "kv_indptr_buf", "kv_last_page_len_buf", "init_new_workspace",
        make=lambda f: buffers.wrap_constructor(f, new_workspace=True, wrappers=True),
        what=f"{_FACTS}; init_new_workspace=True -> a lane; its wrappers' int workspaces -> pool flashinfer_int",
    ),
    _init("flashinfer_mla_backend", "FlashInferMLAAttnBackend", "kv_indptr_buf", "q_indptr_decode_buf"),
    _init(
        "trtllm_mla_backend", "TRTLLMMLABackend", "kv_indptr_buf", "q_indptr_decode_buf", "backend",
        make=lambda f: buffers.wrap_constructor(f, cute_dsl=True),
        what=f"{_FACTS}; {_CUTE.name} -> pool {_CUTE.pool} (int8)",
        requires=(_CUTE.name, "DEFAULT_WORKSPACE_SIZE_MB"),
    ),
    _init("trtllm_mha_backend", "TRTLLMHAAttnBackend", "kv_indptr_buf", "kv_last_page_len_buf", "speculative_step_id"),
    _init(
        "dsa_backend", "DeepseekSparseAttnBackend",
        "speculative_step_id", "topk", "speculative_num_steps", "seed_dsa_topk_from_draft_extend",
    ),
    _init("deepseek_v4_trtllm_backend", "DeepseekV4TrtllmAttnBackend", "speculative_step_id", "topk",
          "speculative_num_steps"),
    Target(_RUNNER + "decode_cuda_graph_runner", "DecodeCudaGraphRunner.capture", ("self",), buffers.wrap_capture,
           "freezes"),
    Target(_RUNNER + "prefill_cuda_graph_runner", "PrefillCudaGraphRunner.capture", ("self",), buffers.wrap_capture,
           "freezes"),
    *wrappers.SEAMS,
    # _reserving is defined below, beside what it calls.
    Target(_KV_CONFIGURATOR, "KVCacheConfigurator._profile_available_bytes", ("self", "pre_model_load_memory"),
           lambda f: _reserving(f), f"first reserves wspool's pools for the limits ({RESERVE_ENV_VAR}=0: off)"),
)  # fmt: skip

#: One group: SGLang's targets only work together.
GROUPS: tuple[TargetGroup, ...] = (TargetGroup("SGLang's workspaces", TARGETS),)


def _read_deterministic(get_exec: Callable[[], Any]) -> Callable[[], bool]:
    def deterministic() -> bool:
        try:
            return bool(get_exec().deterministic.enable_deterministic_inference)
        except Exception:  # nothing published (a bare test process): SGLang's default, off
            return False

    return deterministic


#: SGLang's FlashInfer workspace size, and the architectures its FlashInfer backend gives 512 MiB
#: (``flashinfer_backend.py``); deterministic inference gives 2 GiB.
_FLASHINFER_BYTES, _QWEN_BYTES, _DETERMINISTIC_BYTES = 384 << 20, 512 << 20, 2048 << 20
_QWEN_ARCHITECTURES = frozenset(
    ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM", "Qwen3VLForConditionalGeneration",
     "Qwen3VLMoeForConditionalGeneration")
)  # fmt: skip


def _sglang_bytes(architectures: Iterable[str], backend: str, deterministic: bool) -> int:
    """What SGLang's factory allocates for the FlashInfer workspace of ``backend`` (its own constants)."""
    try:
        from sglang.srt.environ import envs

        configured = int(envs.SGLANG_FLASHINFER_WORKSPACE_SIZE.get())
    except Exception:  # SGLang absent or changed: its documented default
        configured = _FLASHINFER_BYTES
    if backend == "flashinfer" and deterministic:
        return _DETERMINISTIC_BYTES
    if backend == "flashinfer" and _QWEN_ARCHITECTURES.intersection(architectures):
        return _QWEN_BYTES
    return configured


def reservation_plan(
    backends: Iterable[str | None], architectures: Iterable[str], deterministic: bool
) -> tuple[dict[str, list[str]], int | None]:
    """Return the pools and rules SGLang's FlashInfer ``backends`` call, and the size SGLang's factory gives them.

    ``flashinfer`` -> pool ``flashinfer``, rule ``sglang`` (``sglang_deterministic``);
    ``flashinfer_mla`` -> pool ``flashinfer_mla``, rule ``sglang_mla``. Other backends'
    workspaces are not reserved (they grow on first use).
    """
    found = {b for b in backends if b}
    archs = list(architectures)
    rules: dict[str, list[str]] = {}
    sizes = []
    if "flashinfer" in found:
        rules["flashinfer"] = ["sglang_deterministic" if deterministic else "sglang"]
        sizes.append(_sglang_bytes(archs, "flashinfer", deterministic))
    if "flashinfer_mla" in found:
        rules["flashinfer_mla"] = ["sglang_mla"]
        sizes.append(_sglang_bytes(archs, "flashinfer_mla", deterministic))
    return rules, (max(sizes) if sizes else None)


def limits_from_server(configurator: Any, sglang_bytes: int | None) -> dict[str, FactLimit]:
    """Return the limits SGLang's configuration puts on the facts its workspaces' rules read.

    ``sglang_bytes`` is SGLang's own size; the model's geometry per attention-TP
    rank, page size and element sizes are fixed; ``batch_size`` goes up to
    ``--max-running-requests`` (where set), ``q_len`` to the speculative draft tokens.
    """
    context = importlib.import_module("sglang.srt.runtime_context")
    runner = SimpleNamespace(
        model_config=getattr(configurator, "model_config", None),
        page_size=getattr(configurator, "page_size", None),
        kv_cache_dtype=getattr(configurator, "kv_cache_dtype", None),
        dtype=getattr(configurator, "model_dtype", None),
        max_running_requests=None,
    )
    facts = facts_of.facts_from_runner(runner, parallel=_context_value(context.get_parallel), spec=_spec(context))
    limits = {name: FactLimit(v, v, (v,), f"SGLang's configuration ({name})") for name, v in facts.items()}
    q_len = facts.get("q_len", 1)
    limits["q_len"] = FactLimit(1, q_len, None, "SGLang's --speculative-num-draft-tokens")
    schedule = _context_value(context.get_schedule)
    requests = getattr(schedule, "max_running_requests", None)
    if isinstance(requests, int) and requests > 0:
        limits["batch_size"] = FactLimit(1, requests, None, "SGLang's --max-running-requests")
    if sglang_bytes is not None:
        limits["sglang_bytes"] = FactLimit(
            sglang_bytes, sglang_bytes, (sglang_bytes,), "SGLANG_FLASHINFER_WORKSPACE_SIZE"
        )
    return limits


def _context_value(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except Exception:  # not published (a bare process): the facts it gives are left out
        return None


def _spec(context: Any) -> Any:
    return _context_value(context.get_spec)


def reserve_before_kv_pool(configurator: Any) -> Reservation | None:
    """Reserve the pools SGLang's attention backends call before it measures memory for its KV pool; never raises."""
    if getattr(configurator, "is_draft_worker", False):
        return None  # the target model's worker reserves; a draft worker shares its process's pools
    planned = engine_plan("SGLang", lambda: _reservation_of(configurator), buffers.SglangPools.of)
    if planned is None:
        return None
    (rules, sglang_bytes, limits), registry = planned
    override = buffers.device_override()
    gpu = getattr(configurator, "gpu_id", 0)
    device = override or (f"cuda:{gpu}" if str(getattr(configurator, "device", "cuda")) == "cuda" else "cpu")
    engine = None if sglang_bytes is None else sglang_bytes * sum(len(r) for r in rules.values())
    return reserve_for_engine(
        "SGLang", limits, rules, device=device, lanes=[wspool.current_lane()], engine_bytes=engine, registry=registry
    )


def _reservation_of(configurator: Any) -> tuple[dict[str, list[str]], int | None, dict[str, FactLimit]]:
    """The pools and rules SGLang's backends call, SGLang's own size, and the limits of its configuration."""
    context = importlib.import_module("sglang.srt.runtime_context")
    kernel = _context_value(context.get_exec)
    names = [getattr(getattr(kernel, "kernel", None), key, None) for key in _BACKEND_KEYS]
    deterministic = bool(getattr(getattr(kernel, "deterministic", None), "enable_deterministic_inference", False))
    hf = getattr(getattr(configurator, "model_config", None), "hf_config", None)
    rules, sglang_bytes = reservation_plan(names, getattr(hf, "architectures", None) or (), deterministic)
    return rules, sglang_bytes, limits_from_server(configurator, sglang_bytes)


_BACKEND_KEYS = ("attention_backend", "decode_attention_backend", "prefill_attention_backend")


def _reserving(original: Callable[..., Any]) -> Callable[..., Any]:
    def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> Any:
        reserve_before_kv_pool(self)
        return original(self, pre_model_load_memory)

    _profile_available_bytes.__name__ = original.__name__
    _profile_available_bytes.__qualname__ = getattr(original, "__qualname__", original.__name__)
    _profile_available_bytes.__doc__ = original.__doc__
    _profile_available_bytes.__wrapped__ = original  # type: ignore[attr-defined]
    return _profile_available_bytes


class SglangIntegration(Integration):
    """SGLang's integration: :data:`TARGETS`, all or nothing."""

    info = engine_spec("sglang")
    all_or_nothing = True
    pools = buffers.SglangPools

    def groups(self) -> tuple[TargetGroup, ...]:
        """Return :data:`GROUPS`."""
        return GROUPS

    def activate(self) -> list[str]:
        """Point the replacements at SGLang's runtime context."""
        context = importlib.import_module("sglang.srt.runtime_context")
        buffers.configure(
            device=buffers.device_override(),
            deterministic=_read_deterministic(context.get_exec),
            parallel=context.get_parallel,
            spec=context.get_spec,
            schedule=context.get_schedule,
            prefill_buffer_tokens=context.max_prefill_buffer_tokens,
        )
        return []

    def deactivate(self) -> None:
        """Forget SGLang's runtime context and reset the module globals wspool set."""
        buffers.forget_globals()
        buffers.configure()


#: The integration of this process.
INTEGRATION = SglangIntegration(logger)


#: ``0`` (or ``false``, ``off``, ``no``) leaves SGLang untouched although the integration loads; other values
#: are refused.
ENABLE_ENV_VAR = SglangIntegration.info.switch_var


register, unregister, patched = entry_points(INTEGRATION)
