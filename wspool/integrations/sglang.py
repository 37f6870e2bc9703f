"""The SGLang integration: SGLang 0.5.23's FlashInfer workspaces drawn from wspool's pools.

SGLang calls :func:`register` early in every process it starts (one scheduler
process per TP x PP rank, and its helper processes) through ``load_plugins()``
and the ``sglang.srt.plugins`` entry point ``wspool``; ``SGLANG_PLUGINS``, when
set, must name ``wspool``. SGLang 0.5.23 keeps its workspaces in one named-buffer
registry, ``RuntimeContext.get_buffer(name, factory)``, which the module-level
``runtime_context.get_buffer`` and every backend's by-name copy of it call.
:func:`register` wraps that method, so each name of :data:`BUFFERS` is served
from a pool with the dtype of SGLang's factory, sized by the pool's rule; any
other name gets exactly SGLang's own object. It also wraps the constructors of
the attention backends that ask for those names (so the rules see the model
runner's facts, :mod:`wspool.integrations.sglang_facts`;
``FlashInferAttnBackend(init_new_workspace=True)``, SGLang's own ``torch.empty``,
gets a wspool lane of its own; ``TRTLLMMLABackend(backend="cute-dsl")`` finds
its module global ``global_cute_dsl_workspace_buffer`` holding a pool buffer),
and ``DecodeCudaGraphRunner.capture`` / ``PrefillCudaGraphRunner.capture``,
which every CUDA-graph runner of SGLang inherits. Through the seams of
:mod:`wspool.integrations.sglang_wrappers` (``FlashInferAttnBackend``'s
constructor and graph metadata, the MLA indices updaters' plan calls) each
FlashInfer wrapper SGLang builds takes a right-sized int workspace from pool
``flashinfer_int`` instead of FlashInfer's 8 MiB.

All or nothing: a SGLang whose targets differ from what this module knows keeps
its own behaviour everywhere, with one warning naming them (SGLang's
``HookRegistry`` applies targets one by one and has no undo, so it is not
used). ``WSPOOL_SGLANG=0`` leaves SGLang untouched; loading never raises, and
loading twice patches once.

Device semantics: the device SGLang's factory names (``"cuda"``: the current
device), unless :data:`DEVICE_ENV_VAR` named another when the integration
loaded. Lanes: the calling context's (``main`` unless :func:`wspool.lane` set
one); SGLang's two-batch overlap runs both micro-batches on one stream from one
thread, its children sharing one workspace, so it needs none. CUDA graphs: a
capture runs with growth allowed and leaves the registry frozen; SGLang asks
for workspaces only in its backends' constructors, which may still grow pools
after a capture (a draft model's backend, a speculative runtime state's): the
graphs captured before keep their buffers, held by SGLang's backends and
retired, not freed, by wspool. Any other growth after a capture raises
:class:`~wspool.errors.WorkspaceFrozenError`. Threads: SGLang builds backends
and captures graphs from one thread; :func:`register` and :func:`unregister`
are not meant to race with the calls they patch.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

import wspool
from wspool.errors import ConfigError, RuleError
from wspool.integrations import sglang_facts as facts_of
from wspool.integrations import sglang_wrappers
from wspool.units import format_size

__all__ = [
    "BUFFERS",
    "CUTE_DSL_WORKSPACE",
    "DEVICE_ENV_VAR",
    "ENABLE_ENV_VAR",
    "SGLANG_POOLS",
    "TARGETS",
    "Target",
    "Workspace",
    "configure",
    "patched",
    "register",
    "serve",
    "unregister",
]

#: ``0`` (or ``false``, ``off``, ``no``) leaves SGLang untouched although the integration loads.
ENABLE_ENV_VAR = "WSPOOL_SGLANG"
#: Names the device every pool buffer is allocated on (``cpu`` in tests); read when the integration loads.
DEVICE_ENV_VAR = "WSPOOL_SGLANG_DEVICE"

# SGLang configures the root logger (logging.basicConfig), so this module's own logger shows with its lines.
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workspace:
    """One SGLang workspace and the pool that serves it.

    Attributes:
        name: SGLang's name for it (``get_buffer``'s, or the module global's).
        pool: The wspool pool.
        rule: The pool's rule that sizes it.
        own_buffer: SGLang zeroes it because a kernel keeps semaphores or counters
            in it, so its pool must never share a buffer with a scratch pool.
        deterministic_rule: The rule used instead while SGLang's deterministic
            inference is on (SGLang then overwrites its size variable), if any.
    """

    name: str
    pool: str
    rule: str
    own_buffer: bool = False
    deterministic_rule: str | None = None


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


def _declared_pools() -> dict[str, dict[str, str]]:
    pools: dict[str, dict[str, str]] = {}
    for w in (*BUFFERS.values(), CUTE_DSL_WORKSPACE):
        rules = pools.setdefault(w.pool, {})
        for rule in filter(None, (w.rule, w.deterministic_rule)):
            rules[rule] = "sglang_bytes"  # what SGLang's own code allocates at the call
    return pools


#: The rules the integration declares, below the configuration (YAML, ``WSPOOL_*`` and
#: ``SGLANG_FLASHINFER_WORKSPACE_SIZE`` override each); ``configs/sglang.yaml`` writes them out.
SGLANG_POOLS: Mapping[str, Mapping[str, str]] = MappingProxyType(_declared_pools())

_STATE_KEY = "sglang"
_MiB = 1 << 20


def _never() -> bool:
    return False


class _Settings:
    """What the integration learned when it loaded (defaults: no SGLang)."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.deterministic: Callable[[], bool] = _never


_settings = _Settings()


def configure(
    *,
    device: str | torch.device | None = None,
    deterministic: Callable[[], bool] | None = None,
    parallel: Callable[[], Any] | None = None,
    spec: Callable[[], Any] | None = None,
    schedule: Callable[[], Any] | None = None,
    prefill_buffer_tokens: Callable[[], Any] | None = None,
) -> None:
    """Tell the integration where SGLang keeps what it reads (:func:`register` does; tests call it too).

    Args:
        device: Overrides every pool buffer's device (``"cpu"`` in tests); ``None``: the factory's.
        deterministic: Whether SGLang's deterministic inference is on; ``None``: never.
        parallel: ``sglang.srt.runtime_context.get_parallel`` (attention TP and DCP widths).
        spec: ``sglang.srt.runtime_context.get_spec`` (speculative draft tokens).
        schedule: ``sglang.srt.runtime_context.get_schedule`` (``max_prefill_tokens``).
        prefill_buffer_tokens: ``sglang.srt.runtime_context.max_prefill_buffer_tokens`` (the chunk ceiling).
    """
    _settings.device = None if device is None else torch.device(device)
    _settings.deterministic = deterministic or _never
    facts_of.set_context_readers(parallel, spec)
    sglang_wrappers.configure(schedule, prefill_buffer_tokens)


class _RegistryState:
    """Per registry: the pools declared, the views handed out, and whether a capture froze it."""

    def __init__(self, registry: wspool.PoolRegistry) -> None:
        for pool, rules in SGLANG_POOLS.items():
            registry.declare_pool(pool, rules)
        for w in BUFFERS.values():
            host = registry.buffer_pool(w.pool)
            if w.own_buffer and host != w.pool:
                raise ConfigError(
                    f"pool {w.pool!r} must have its own buffer: SGLang zeroes {w.name} because a kernel keeps "
                    f"semaphores or counters in it, which pool {host!r} would overwrite; set "
                    f"pools.{w.pool}.shared_with / WSPOOL_POOLS__{w.pool.upper()}__SHARED_WITH empty",
                    path=("pools", w.pool, "shared_with"),
                )
        self.views: dict[tuple[str, object, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.frozen_by_capture = False
        self.windows = 0


def _state(registry: wspool.PoolRegistry) -> _RegistryState:
    found = registry.op_state.get(_STATE_KEY)
    if found is None:
        found = registry.op_state.setdefault(_STATE_KEY, _RegistryState(registry))
    return found  # type: ignore[no-any-return]


_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _missing_facts(exc: RuleError, w: Workspace, known: Mapping[str, int]) -> RuleError:
    given = ", ".join(f"{k}={v}" for k, v in known.items()) or "none"
    unknown = ", ".join(n for n in facts_of.FACT_NAMES if n not in known) or "none"
    return RuleError(
        f"{exc} (for SGLang's {w.name} the integration passes the facts it knows: {given}; unknown here: "
        f"{unknown}; see docs/sglang.md)"
    )


def _from_pool(w: Workspace, request: facts_of.Request) -> torch.Tensor:
    """Return ``w``'s pool buffer as ``request.dtype``: the same tensor while the buffer is the same."""
    registry = wspool.get_registry()
    state = _state(registry)
    device: Any = _settings.device or request.device
    lane = wspool.current_lane()
    known = {**facts_of.current_facts(), "sglang_bytes": request.nbytes}
    rule = w.deterministic_rule if w.deterministic_rule and _settings.deterministic() else w.rule
    try:
        buffer = registry.workspace(w.pool, device, rule=rule, lane=lane, **known)
    except RuleError as exc:
        raise _missing_facts(exc, w, known) from exc
    key = (w.name, device, lane)
    cached = state.views.get(key)
    if cached is None or cached[0] is not buffer:
        cached = (buffer, buffer if request.dtype == torch.uint8 else buffer.view(request.dtype))
        state.views[key] = cached
        setting = f"pools.{w.pool}.rules.{rule}"
        if buffer.numel() < request.nbytes:
            logger.warning(
                "wspool: SGLang's %s gets %s from %s, less than the %s SGLang allocates here; raise it "
                "(WSPOOL_POOLS__%s__RULES__%s) if FlashInfer reports a workspace overflow",
                w.name, format_size(buffer.numel()), setting, format_size(request.nbytes), w.pool.upper(),
                rule.upper(),
            )  # fmt: skip
        else:
            logger.info(
                "wspool: SGLang's %s is %s of pool %s (%s on %s, lane %s; SGLang's own: %s)",
                w.name, format_size(buffer.numel()), w.pool, setting, device, lane, format_size(request.nbytes),
            )  # fmt: skip
    return cached[1]


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
        _warn_once(name, "wspool: SGLang's %s stays SGLang's own: its factory cannot be sized (%s)", name, exc)
        return own()
    if len(request.shape) != 1 or request.dtype not in (torch.uint8, torch.int8):
        _warn_once(
            name, "wspool: SGLang's %s stays SGLang's own: it is %s %s, not a flat byte buffer",
            name, request.dtype, list(request.shape),
        )  # fmt: skip
        return own()
    return _from_pool(w, request)


def _get_buffer(original: Callable[..., Any]) -> Callable[..., Any]:
    pooled = frozenset(BUFFERS)

    def get_buffer(self: Any, name: str, factory: Any) -> Any:
        if name not in pooled:  # every other name: SGLang's own, with nothing added but this test
            return original(self, name, factory)
        return serve(name, factory, lambda: original(self, name, factory))

    get_buffer.__wrapped__ = original  # type: ignore[attr-defined]
    get_buffer.__doc__ = original.__doc__
    return get_buffer


@contextmanager
def _growth_window() -> Iterator[None]:
    """Let pools grow inside the block even after a capture froze the registry (backend constructors)."""
    registry = wspool.get_registry()
    state = _state(registry)
    thaw = state.frozen_by_capture and state.windows == 0
    if thaw:
        registry.unfreeze()
    state.windows += 1
    try:
        yield
    finally:
        state.windows -= 1
        if thaw:
            registry.freeze()


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


def _constructor(
    original: Callable[..., Any], *, new_workspace: bool = False, cute_dsl: bool = False, wrappers: bool = False
) -> Any:
    """Wrap a backend's ``__init__``: its runner's facts, a growth window, and its special cases.

    ``wrappers``: the FlashInfer wrappers the constructor built take int workspaces
    from wspool (:func:`~wspool.integrations.sglang_wrappers.bind_eager_wrappers`),
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

        with facts_of.building(runner), _growth_window():
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
                    _warn_once(
                        CUTE_DSL_WORKSPACE.name,
                        "wspool: SGLang's %s stays SGLang's own: %s's parent constructor is not one wspool wraps",
                        CUTE_DSL_WORKSPACE.name, type(self).__name__,
                    )  # fmt: skip
            else:
                construct()
            pending = _AFTER_PARENT.get()
            if pending is not None and pending.instance is self and not pending.done:
                pending.done = True
                pending.run()

    return __init__


def _capturing(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a CUDA-graph runner's ``capture``: growth allowed while it runs, the registry frozen after."""

    @functools.wraps(original)
    def capture(self: Any) -> Any:
        registry = wspool.get_registry()
        state = _state(registry)
        if state.frozen_by_capture:  # SGLang captures again: its own freeze ends until this capture does
            registry.unfreeze()
            state.frozen_by_capture = False
        try:
            return original(self)
        finally:
            registry.freeze()
            state.frozen_by_capture = True

    return capture


@dataclass(frozen=True)
class Target:
    """One SGLang attribute the integration replaces.

    Attributes:
        module: The module that holds it.
        path: ``"Class.method"`` in that module.
        parameters: SGLang's parameter names; another signature is not patched.
        make: Builds the replacement from SGLang's original.
        what: What it becomes, for the log line.
        requires: Module attributes the replacement reads, which must exist.
    """

    module: str
    path: str
    parameters: tuple[str, ...]
    make: Callable[[Callable[..., Any]], Any]
    what: str
    requires: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The dotted name: the module, then the path in it."""
        return f"{self.module}.{self.path}"


_RUNNER = "sglang.srt.model_executor.runner."
_FACTS = "the runner's facts"


def _init(module: str, cls: str, *more: str, make: Any = _constructor, what: str = _FACTS, **kw: Any) -> Target:
    """A backend constructor target: ``__init__(self, model_runner, skip_prefill, *more)``."""
    params = ("self", "model_runner", "skip_prefill", *more)
    return Target(f"sglang.srt.layers.attention.{module}", f"{cls}.__init__", params, make, what, **kw)


#: What :func:`register` patches, in order; a missing one means none is patched.
TARGETS: tuple[Target, ...] = (
    Target(
        "sglang.srt.runtime_context",
        "RuntimeContext.get_buffer",
        ("self", "name", "factory"),
        _get_buffer,
        f"pools for {', '.join(BUFFERS)}; other names SGLang's own",
        requires=("get_parallel", "get_spec", "get_exec", "get_schedule", "max_prefill_buffer_tokens"),
    ),
    _init(
        "flashinfer_backend", "FlashInferAttnBackend", "kv_indptr_buf", "kv_last_page_len_buf", "init_new_workspace",
        make=lambda f: _constructor(f, new_workspace=True, wrappers=True),
        what=f"{_FACTS}; init_new_workspace=True -> a lane; its wrappers' int workspaces -> pool flashinfer_int",
    ),
    _init("flashinfer_mla_backend", "FlashInferMLAAttnBackend", "kv_indptr_buf", "q_indptr_decode_buf"),
    _init(
        "trtllm_mla_backend", "TRTLLMMLABackend", "kv_indptr_buf", "q_indptr_decode_buf", "backend",
        make=lambda f: _constructor(f, cute_dsl=True),
        what=f"{_FACTS}; {CUTE_DSL_WORKSPACE.name} -> pool {CUTE_DSL_WORKSPACE.pool} (int8)",
        requires=(CUTE_DSL_WORKSPACE.name, "DEFAULT_WORKSPACE_SIZE_MB"),
    ),
    _init("trtllm_mha_backend", "TRTLLMHAAttnBackend", "kv_indptr_buf", "kv_last_page_len_buf", "speculative_step_id"),
    _init(
        "dsa_backend", "DeepseekSparseAttnBackend",
        "speculative_step_id", "topk", "speculative_num_steps", "seed_dsa_topk_from_draft_extend",
    ),
    _init("deepseek_v4_trtllm_backend", "DeepseekV4TrtllmAttnBackend", "speculative_step_id", "topk",
          "speculative_num_steps"),
    Target(_RUNNER + "decode_cuda_graph_runner", "DecodeCudaGraphRunner.capture", ("self",), _capturing, "freezes"),
    Target(_RUNNER + "prefill_cuda_graph_runner", "PrefillCudaGraphRunner.capture", ("self",), _capturing, "freezes"),
    *(Target(*seam) for seam in sglang_wrappers.SEAMS),
)  # fmt: skip

_lock = threading.Lock()
# Target name -> (the class patched, the attribute, SGLang's original, the replacement).
_patches: dict[str, tuple[type, str, Any, Any]] = {}
# (module, global, buffer) for each SGLang module global set to a pool buffer.
_globals_set: list[tuple[Any, str, torch.Tensor]] = []


def _switch() -> bool:
    raw = os.environ.get(ENABLE_ENV_VAR, "").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ConfigError(f"invalid environment variable {ENABLE_ENV_VAR} = {raw[:80]!r}: expected 1 or 0 (true/false)")


def _device_override() -> torch.device | None:
    raw = os.environ.get(DEVICE_ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        return torch.device(raw)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"invalid environment variable {DEVICE_ENV_VAR} = {raw[:80]!r}: not a device (cpu, cuda, cuda:1...)"
        ) from None


def _locate(target: Target) -> tuple[type, str, Any]:
    """Return (class, attribute, current value) of a target, or raise LookupError saying what is missing."""
    try:
        module = importlib.import_module(target.module)
    except Exception as exc:  # SGLang's own import error (e.g. a missing dependency): keep its behaviour
        raise LookupError(f"module {target.module} does not import ({type(exc).__name__}: {exc})") from None
    for attr in target.requires:
        if not hasattr(module, attr):
            raise LookupError(f"{target.module} has no {attr}")
    class_name, attr = target.path.split(".")
    owner = getattr(module, class_name, None)
    if not isinstance(owner, type):
        raise LookupError(f"{target.module} has no class {class_name}")
    current = owner.__dict__.get(attr)
    if current is None:
        raise LookupError(f"{target.name} is missing")
    try:
        parameters = tuple(inspect.signature(current).parameters)
    except (TypeError, ValueError):
        raise LookupError(f"{target.name} has no signature to check") from None
    if parameters != target.parameters:
        raise LookupError(
            f"{target.name} takes ({', '.join(parameters)}), not ({', '.join(target.parameters)}) as wspool knows"
        )
    return owner, attr, current


def _read_deterministic(get_exec: Callable[[], Any]) -> Callable[[], bool]:
    def deterministic() -> bool:
        try:
            return bool(get_exec().deterministic.enable_deterministic_inference)
        except Exception:  # nothing published (a bare test process): SGLang's default, off
            return False

    return deterministic


def register() -> None:
    """Install wspool's workspaces into SGLang (the ``sglang.srt.plugins`` entry point); never raises.

    Idempotent: what is already patched stays as it is. With ``WSPOOL_SGLANG=0``
    nothing is patched. Logs one line naming what was patched, or one warning
    naming every target that is missing (then nothing is patched and SGLang's
    own behaviour stays), or one error for an invalid setting.
    """
    try:
        if not _switch():
            logger.info("wspool: %s=0: SGLang's FlashInfer workspaces are left as they are", ENABLE_ENV_VAR)
            return
        _register()
    except ConfigError as exc:
        logger.error("wspool: the SGLang integration is not loaded; SGLang's own workspaces stay in use: %s", exc)
    except Exception:  # never break SGLang's start-up: its own behaviour stays
        logger.exception("wspool: the SGLang integration failed to load; SGLang's own workspaces stay in use")


def _register() -> None:
    if patched():
        logger.debug("wspool: the SGLang integration is already loaded")
        return
    device = _device_override()
    _state(wspool.get_registry())  # the configuration and the declared pools, checked before anything changes
    # SGLang's modules import (running their code) before the lock is taken; inside it they are cached.
    missing = []
    try:
        importlib.import_module("torch._subclasses.fake_tensor")
    except ImportError as exc:
        missing.append(f"torch._subclasses.fake_tensor ({exc})")
    located = []
    for target in TARGETS:
        try:
            located.append((target, *_locate(target)))
        except LookupError as exc:
            missing.append(f"{target.name} ({exc})")
    if missing:
        logger.warning(
            "wspool: the SGLang integration patched nothing, SGLang's own workspaces stay in use; it does not "
            "know this SGLang: %s",
            "; ".join(missing),
        )
        return
    context = importlib.import_module("sglang.srt.runtime_context")
    with _lock:
        if _patches:
            return
        try:
            for target, owner, attr, original in located:
                replacement = target.make(original)
                setattr(owner, attr, replacement)
                _patches[target.name] = (owner, attr, original, replacement)
        except BaseException:
            _restore()
            raise
        configure(
            device=device,
            deterministic=_read_deterministic(context.get_exec),
            parallel=context.get_parallel,
            spec=context.get_spec,
            schedule=context.get_schedule,
            prefill_buffer_tokens=context.max_prefill_buffer_tokens,
        )
    done = "; ".join(f"{t.path} -> {t.what}" for t, *_ in located)
    logger.info("wspool: SGLang integration loaded; patched %s", done)


def _restore() -> list[str]:
    """Put SGLang's originals back (lock held); an attribute replaced since by someone else stays."""
    restored = []
    for name, (owner, attr, original, replacement) in reversed(list(_patches.items())):
        if owner.__dict__.get(attr) is replacement:
            setattr(owner, attr, original)
            restored.append(name)
        del _patches[name]
    for module, attr, buffer in _globals_set:
        if getattr(module, attr, None) is buffer:
            setattr(module, attr, None)
    _globals_set.clear()
    _warned.clear()
    configure()
    return restored


def unregister() -> list[str]:
    """Put SGLang's originals back (for tests); return the names restored.

    An attribute that something else replaced after wspool is left alone; a
    module global wspool set is reset to ``None`` (SGLang's value before its
    first backend), and the backends built meanwhile keep the buffers they hold.
    """
    with _lock:
        return _restore()


def patched() -> list[str]:
    """Return the names of the SGLang attributes wspool replaced in this process."""
    with _lock:
        return list(_patches)
