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
from collections.abc import Callable, Mapping
from typing import Any

from wspool.integrations import SGLANG
from wspool.integrations.patching import Integration, describe_config
from wspool.integrations.sglang import buffers, wrappers
from wspool.integrations.sglang.buffers import (
    BUFFERS,
    CUTE_DSL_WORKSPACE,
    DEVICE_ENV_VAR,
    SGLANG_POOLS,
    configure,
    serve,
)
from wspool.registry import PoolRegistry
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
    "logger",
    "patched",
    "register",
    "serve",
    "unregister",
]

#: The integration's logger (SGLang shows it with its own lines).
logger = logging.getLogger("wspool.integrations.sglang")

_RUNNER = "sglang.srt.model_executor.runner."
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


class SglangIntegration(Integration):
    """SGLang's integration: :data:`TARGETS`, all or nothing."""

    info = SGLANG
    all_or_nothing = True

    def groups(self) -> tuple[TargetGroup, ...]:
        """Return :data:`GROUPS`."""
        return GROUPS

    def check(self, registry: PoolRegistry, environ: Mapping[str, str]) -> str:
        """Check :data:`DEVICE_ENV_VAR`, declare the pools and check those SGLang zeroes own their buffers."""
        buffers.device_override(environ)
        buffers.SglangPools.of(registry)
        return f"{describe_config(environ)}; profile {registry.settings.profile}"

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
ENABLE_ENV_VAR = SGLANG.switch_var


def register() -> None:
    """Install wspool's workspaces into SGLang (the ``sglang.srt.plugins`` entry point); never raises.

    Idempotent. Reads the switch, checks SGLang's version and wspool's
    configuration, then patches every target or none; logs one line.
    """
    INTEGRATION.load()


def unregister() -> list[str]:
    """Put SGLang's originals back (for tests); return the names restored.

    A module global wspool set is reset to ``None``; backends built meanwhile keep their buffers.
    """
    return INTEGRATION.unload()


def patched() -> list[str]:
    """Return the names of the SGLang attributes wspool replaced in this process."""
    return INTEGRATION.patched()
