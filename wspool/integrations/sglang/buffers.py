"""SGLang's named workspaces served from wspool's pools, and the wrappers that give them facts.

SGLang 0.5.23 keeps its workspaces in one named-buffer registry,
``RuntimeContext.get_buffer(name, factory)``; :func:`wrap_get_buffer` serves
each name of :data:`BUFFERS` from a pool, with the dtype of SGLang's factory
and the size of the pool's rule, and every other name SGLang's own way.
:func:`wrap_constructor` gives a backend's rules the model runner's facts
(:mod:`wspool.integrations.sglang.facts`) and lets its constructor grow pools
after a capture froze the registry (that thread or task only);
:func:`wrap_capture` freezes the registry after each CUDA-graph capture.
docs/sglang.md lists every name, pool and rule.

Device semantics: the device SGLang's factory names, unless ``WSPOOL_SGLANG_DEVICE``
named another when the integration loaded. Lanes: the calling context's.
Capture: growth is refused after a capture, except inside a backend's
constructor (the graphs captured before keep their buffers, retired, not freed).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

import wspool
from wspool.integrations.patching import (
    Handles,
    SaidOnce,
    Workspace,
    declared_rules,
    device_variable,
    require_own_buffers,
)
from wspool.integrations.reserving import write_snapshot
from wspool.integrations.sglang import facts as facts_of
from wspool.integrations.sglang import wrappers as sglang_wrappers
from wspool.units import format_size

__all__ = [
    "BUFFERS",
    "CUTE_DSL_WORKSPACE",
    "DEVICE_ENV_VAR",
    "SGLANG_POOLS",
    "SglangPools",
    "configure",
    "device_override",
    "forget_globals",
    "serve",
    "wrap_capture",
    "wrap_constructor",
    "wrap_get_buffer",
]

#: Names the device every pool buffer is allocated on (``cpu`` in tests); read when the integration loads.
DEVICE_ENV_VAR = "WSPOOL_SGLANG_DEVICE"

# SGLang configures the root logger (logging.basicConfig), so this module's own logger shows with its lines.
logger = logging.getLogger("wspool.integrations.sglang")


#: SGLang's ``get_buffer`` names served from pools. ``flashinfer`` and ``flashinfer_mla`` are the
#: FlashInfer float workspaces wspool's own kernels and the vLLM plugin use (one buffer by default:
#: ``pools.flashinfer.shared_with``); the zeroed trtllm-gen and DSA workspaces have pools of their own.
BUFFERS: Mapping[str, Workspace] = MappingProxyType(
    {
        w.name: w
        for w in (
            Workspace("flashinfer_workspace", "flashinfer", "sglang", deterministic_rule="sglang_deterministic"),
            Workspace("flashinfer_mla_workspace", "flashinfer_mla", "sglang_mla"),
            Workspace("trtllm_mla_zero_workspace", "sglang_trtllm_mla", "default", own_buffer=True),
            Workspace("trtllm_mha_zero_workspace", "sglang_trtllm_mha", "default", own_buffer=True),
            Workspace("dsa_flashinfer_sparse_mla_workspace", "sglang_dsa_sparse_mla", "default", own_buffer=True),
            Workspace("dsa_trtllm_workspace", "sglang_dsa_trtllm", "default"),
            Workspace("trtllm_dsv4_zero_workspace", "sglang_trtllm_dsv4", "default", own_buffer=True),
        )
    }
)
#: ``trtllm_mla_backend.global_cute_dsl_workspace_buffer``: cute-dsl's split-KV scratch, kept
#: apart from trtllm-gen's zeroed counters by SGLang and here too; FlashInfer's MLA float pool.
CUTE_DSL_WORKSPACE = Workspace("global_cute_dsl_workspace_buffer", "flashinfer_mla", "sglang_cute_dsl")


#: The rules the integration declares, each sized by what SGLang's own code allocates at the call, below
#: the configuration (YAML, ``WSPOOL_*`` and ``SGLANG_FLASHINFER_WORKSPACE_SIZE`` override each);
#: ``configs/sglang.yaml`` writes them out.
SGLANG_POOLS = declared_rules(
    (
        (w.pool, rule)
        for w in (*BUFFERS.values(), CUTE_DSL_WORKSPACE)
        for rule in (w.rule, w.deterministic_rule)
        if rule
    ),
    "sglang_bytes",
)

_MiB = 1 << 20
_CALL_FACTS = frozenset((*facts_of.FACT_NAMES, "sglang_bytes"))
_DOCS = "see docs/sglang.md"


def configure(
    *,
    device: str | torch.device | None = None,
    deterministic: Callable[[], bool] | None = None,
    parallel: Callable[[], Any] | None = None,
    spec: Callable[[], Any] | None = None,
    schedule: Callable[[], Any] | None = None,
    prefill_buffer_tokens: Callable[[], Any] | None = None,
) -> None:
    """Tell the integration where SGLang keeps what it reads, and forget what it said once (load and unload do).

    Args:
        device: Overrides every pool buffer's device (``"cpu"`` in tests); ``None``: the factory's.
        deterministic: Whether SGLang's deterministic inference is on; ``None``: never.
        parallel: ``sglang.srt.runtime_context.get_parallel`` (attention TP and DCP widths).
        spec: ``sglang.srt.runtime_context.get_spec`` (speculative draft tokens).
        schedule: ``sglang.srt.runtime_context.get_schedule`` (``max_prefill_tokens``).
        prefill_buffer_tokens: ``sglang.srt.runtime_context.max_prefill_buffer_tokens`` (the chunk ceiling).
    """
    facts_of.RUNTIME.read(
        device=device,
        deterministic=deterministic,
        parallel=parallel,
        spec=spec,
        schedule=schedule,
        prefill_buffer_tokens=prefill_buffer_tokens,
    )
    SaidOnce.forget("SGLang")


class SglangPools:
    """Per registry: the integration's pools declared and checked, its handles, and the freeze a capture set.

    Raises:
        ConfigError: A declared rule is invalid, or a pool SGLang zeroes shares a buffer.
    """

    def __init__(self, registry: wspool.PoolRegistry) -> None:
        for pool, rules in SGLANG_POOLS.items():
            registry.declare_pool(pool, rules)
        require_own_buffers(
            registry,
            {
                w.pool: f"SGLang zeroes {w.name} because a kernel keeps semaphores or counters in it"
                for w in BUFFERS.values()
                if w.own_buffer
            },
        )
        self.registry = registry
        # The freeze epoch a capture left (None: no capture froze it): a recapture thaws only that freeze.
        self.capture_freeze: int | None = None

    @classmethod
    def of(cls, registry: wspool.PoolRegistry) -> SglangPools:
        """Return ``registry``'s, declaring the pools on first use."""
        return registry.state(cls, lambda: cls(registry))


def _from_pool(w: Workspace, request: facts_of.Request) -> torch.Tensor:
    """Return ``w``'s pool buffer as ``request.dtype``: the same tensor while the buffer is the same."""
    pools = SglangPools.of(wspool.get_registry())
    runtime = facts_of.RUNTIME
    device: Any = runtime.device or request.device
    lane = wspool.current_lane()
    known = {**facts_of.current_facts(), "sglang_bytes": request.nbytes}
    rule = w.deterministic_rule if w.deterministic_rule and runtime.deterministic() else w.rule
    handle, view, held = Handles.of(pools.registry).serve(
        w, rule, device, lane, known, engine="SGLang", fact_names=facts_of.FACT_NAMES, docs=_DOCS,
        dtype=request.dtype, call_facts=_CALL_FACTS,
    )  # fmt: skip
    buffer = handle.pool.buffer
    assert buffer is not None
    first = SaidOnce.of(pools.registry).first("SGLang", "served", w.name, rule, device, lane)
    if buffer is not held or first:
        setting = f"pools.{w.pool}.rules.{rule}"
        if buffer.numel() < request.nbytes:
            logger.warning(
                "wspool: SGLang's %s gets %s from %s, less than the %s SGLang allocates here; raise it "
                "(WSPOOL_POOLS__%s__RULES__%s) if FlashInfer reports a workspace overflow",
                w.name,
                format_size(buffer.numel()),
                setting,
                format_size(request.nbytes),
                w.pool.upper(),
                rule.upper(),
            )
        else:
            logger.info(
                "wspool: SGLang's %s is %s of pool %s (%s on %s, lane %s; SGLang's own: %s)",
                w.name,
                format_size(buffer.numel()),
                w.pool,
                setting,
                device,
                lane,
                format_size(request.nbytes),
            )
    return view


def serve(name: str, factory: Callable[[], Any], own: Callable[[], Any]) -> Any:
    """Return SGLang's buffer ``name``: from its pool for the names of :data:`BUFFERS`, else ``own()``.

    Args:
        name: ``get_buffer``'s name.
        factory: SGLang's factory; for a pooled name it runs under PyTorch's
            fake-tensor mode only (nothing allocated), to learn its size, dtype and device.
        own: SGLang's own ``get_buffer`` for this call, for every other name.

    Returns:
        For a pooled name, a zero-filled (when allocated) view of the pool's
        buffer with the factory's dtype, at least as large as the rule; the
        same tensor while the buffer is the same. For any other name, ``own()``'s result.

    Raises:
        RuleError: The rule reads a fact SGLang did not give (named in the message).
        WorkspaceFrozenError: The pool would have to grow after a capture, outside a backend's constructor.
    """
    w = BUFFERS.get(name)
    if w is None:
        return own()
    try:
        request = facts_of.probe_factory(factory)
    except Exception as exc:  # an unforeseen factory: SGLang's own buffer, said once
        why = f"its factory cannot be sized ({exc})"
    else:
        if len(request.shape) == 1 and request.dtype in (torch.uint8, torch.int8):
            return _from_pool(w, request)
        why = f"it is {request.dtype} {list(request.shape)}, not a flat byte buffer"
    said = SaidOnce.of()
    said.say(logger, ("SGLang", "kept", name), logging.WARNING, "wspool: SGLang's %s stays SGLang's own: %s", name, why)
    return own()


def wrap_get_buffer(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``RuntimeContext.get_buffer``: the names of :data:`BUFFERS` from pools, every other SGLang's own.

    Every other name is SGLang 0.5.23's get-or-create in ``self.resources.buffers``,
    done here without a second call, since SGLang asks for some per layer. A pooled
    name is never kept there, except SGLang's own buffer where its factory could not
    be sized, which is what serving it again would return: the look-up comes first.
    """
    pooled = frozenset(BUFFERS)

    def get_buffer(self: Any, name: str, factory: Any) -> Any:
        buf = self.resources.buffers.get(name)
        return make(self, name, factory) if buf is None else buf

    # Apart from get_buffer, whose arguments a closure here would make cells of on every call.
    def make(self: Any, name: str, factory: Any) -> Any:
        if name in pooled:
            return serve(name, factory, lambda: original(self, name, factory))
        buf = self.resources.buffers[name] = factory()
        return buf

    get_buffer.__wrapped__ = original  # type: ignore[attr-defined]
    get_buffer.__doc__ = original.__doc__
    return get_buffer


_private_lanes = itertools.count(1)


def _install_cute_dsl(module: Any, runner: Any) -> None:
    """Put a pool buffer where SGLang lazily puts its cute-dsl workspace, as SGLang would size it."""
    if getattr(module, CUTE_DSL_WORKSPACE.name, None) is not None:
        return
    # SGLang's own: torch.zeros(DEFAULT_WORKSPACE_SIZE_MB MiB, dtype=torch.int8, device=model_runner.device).
    request = facts_of.Request((int(module.DEFAULT_WORKSPACE_SIZE_MB) * _MiB,), torch.int8, torch.device(runner.device))
    buffer = _from_pool(CUTE_DSL_WORKSPACE, request)
    setattr(module, CUTE_DSL_WORKSPACE.name, buffer)
    _globals_set.append((module, CUTE_DSL_WORKSPACE.name, buffer))


@dataclass
class _AfterParent:
    """Work a subclass's constructor leaves for its parent's, to run right after the parent's body."""

    instance: Any
    run: Callable[[], None]
    done: bool = False


_AFTER_PARENT: contextvars.ContextVar[_AfterParent | None] = contextvars.ContextVar(
    "wspool_sglang_after_parent", default=None
)


def wrap_constructor(
    original: Callable[..., Any], *, new_workspace: bool = False, cute_dsl: bool = False, wrappers: bool = False
) -> Any:
    """Wrap a backend's ``__init__``: its runner's facts, a growth window, and its special cases.

    ``wrappers``: the FlashInfer wrappers the constructor built take int workspaces
    from wspool (:func:`~wspool.integrations.sglang.wrappers.bind_eager_wrappers`),
    in the lane the backend was built in.
    """
    signature = inspect.signature(original)
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        runner = bound.arguments["model_runner"]

        def construct() -> None:
            original(*bound.args, **bound.kwargs)
            if wrappers:
                sglang_wrappers.bind_eager_wrappers(self)

        with facts_of.building(runner), wspool.get_registry().allowing_growth():
            if new_workspace and bound.arguments["init_new_workspace"]:
                # SGLang's torch.empty here is a buffer no other backend shares: a lane of its own.
                bound.arguments["init_new_workspace"] = False
                with wspool.lane(f"sglang-new-workspace-{next(_private_lanes)}"):
                    construct()
            elif cute_dsl and bound.arguments["backend"] == "cute-dsl":
                # SGLang allocates the cute-dsl buffer after its parent's MLA workspace; so does wspool,
                # so a pool shared by both grows once, to the larger.
                after = _AfterParent(self, lambda: _install_cute_dsl(module, runner))
                token = _AFTER_PARENT.set(after)
                try:
                    original(*bound.args, **bound.kwargs)
                finally:
                    _AFTER_PARENT.reset(token)
                if not after.done:
                    SaidOnce.of().say(
                        logger,
                        ("SGLang", "kept", CUTE_DSL_WORKSPACE.name),
                        logging.WARNING,
                        "wspool: SGLang's %s stays SGLang's own: %s's parent constructor is not one wspool wraps",
                        CUTE_DSL_WORKSPACE.name,
                        type(self).__name__,
                    )
            else:
                construct()
            pending = _AFTER_PARENT.get()
            if pending is not None and pending.instance is self and not pending.done:
                pending.done = True
                pending.run()

    return __init__


def wrap_capture(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a CUDA-graph runner's ``capture``: growth allowed while it runs, the registry frozen after.

    A recapture thaws the freeze the last capture left, unless the registry was
    unfrozen or frozen by someone else since; a failed capture still freezes
    (graphs captured before it may replay).
    """

    @functools.wraps(original)
    def capture(self: Any) -> Any:
        registry = wspool.get_registry()
        pools = SglangPools.of(registry)
        state = registry.freeze_state
        if registry.is_frozen and pools.capture_freeze == state.epoch:
            registry.unfreeze()
        try:
            return original(self)
        finally:
            if not registry.is_frozen:
                registry.freeze()
                pools.capture_freeze = state.epoch
            write_snapshot("captured", registry)

    return capture


# (module, global, buffer) for each SGLang module global set to a pool buffer.
_globals_set: list[tuple[Any, str, torch.Tensor]] = []


def forget_globals() -> None:
    """Reset each SGLang module global wspool set (to ``None``, SGLang's value before its first backend).

    Backends built meanwhile keep the buffers they hold. Also forgets what was said once.
    """
    for module, attr, buffer in _globals_set:
        if getattr(module, attr, None) is buffer:
            setattr(module, attr, None)
    _globals_set.clear()
    SaidOnce.forget("SGLang")


def device_override(environ: Mapping[str, str] | None = None) -> torch.device | None:
    """Return the device :data:`DEVICE_ENV_VAR` names in ``environ`` (default ``os.environ``), or ``None`` if unset.

    Raises:
        ConfigError: It names no device.
    """
    return device_variable(DEVICE_ENV_VAR, environ)
