"""The vLLM plugin: vLLM 0.33's FlashInfer workspaces drawn from wspool's pools.

vLLM calls :func:`register` in every process it starts (engine core, workers)
through the ``vllm.general_plugins`` entry point ``wspool`` that wspool's
package declares; ``VLLM_PLUGINS`` (a comma-separated allowlist) must name
``wspool`` when it is set. :func:`register` replaces, where vLLM's callers look
them up at call time:

- ``vllm.v1.attention.backends.mla.flashinfer_mla._get_workspace_buffer`` and
  ``._get_multi_ctas_kv_counter_buffer`` (module globals that ``forward_mqa``
  reads at each call), and wraps ``FlashInferMLAImpl.forward_mqa`` so the rules
  see the call's heads and DCP size;
- ``vllm.v1.attention.backends.mla.flashinfer_mla_sparse._get_workspace_buffer``, and
  the copy ``flashinfer_mla_sparse_sm120`` imported by name;
- ``vllm.v1.attention.backends.flashinfer.FlashInferMetadataBuilder._get_workspace_buffer``
  (a method: its callers look it up on the builder) and that module's
  ``_get_multi_ctas_kv_counter_buffer`` (trtllm-gen's paged-attention counters);
- ``vllm.v1.worker.workspace.WorkspaceManager.lock`` / ``.unlock`` (which
  ``lock_workspace()`` / ``unlock_workspace()`` call): vLLM's lock also freezes
  wspool's registry, its unlock unfreezes it.

See :mod:`wspool.integrations.vllm_workspaces` for the pools and semantics.
``WSPOOL_VLLM=0`` leaves vLLM untouched. A vLLM whose functions differ from
what this module knows (missing, other parameters) keeps its own behaviour for
them, with one warning naming each; loading never raises. Loading twice
patches once. One log line says what was patched.

Thread semantics: call :func:`register` and :func:`unregister` before serving
(vLLM does, at start-up); they are not meant to race with the calls they patch.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wspool.integrations import vllm_workspaces as ws
from wspool.registry import get_registry

__all__ = ["ENABLE_ENV_VAR", "TARGETS", "Target", "patched", "register", "unregister"]

#: ``0`` (or ``false``, ``off``, ``no``) leaves vLLM untouched although the plugin loads.
ENABLE_ENV_VAR = "WSPOOL_VLLM"

# A child of vLLM's logger, so the load line appears with vLLM's own (vLLM configures "vllm").
logger = logging.getLogger("vllm.wspool")

_MLA = "vllm.v1.attention.backends.mla.flashinfer_mla"
_SPARSE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"
# Imports the sparse function by name: a copy bound at its import, patched on its own.
_SPARSE_SM120 = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120"
_PAGED = "vllm.v1.attention.backends.flashinfer"
_WORKSPACE = "vllm.v1.worker.workspace"


@dataclass(frozen=True)
class Target:
    """One vLLM attribute the plugin replaces.

    Attributes:
        module: The module that holds it.
        path: The attribute in that module, ``"f"`` or ``"Class.method"``.
        parameters: vLLM's parameter names; another signature is not patched.
        make: Builds the replacement from vLLM's original.
        what: What it becomes, for the log line.
    """

    module: str
    path: str
    parameters: tuple[str, ...]
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    what: str

    @property
    def name(self) -> str:
        """The dotted name: the module, then the path in it."""
        return f"{self.module}.{self.path}"


def _paged_method(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's constant for its prefill floor, read from the module that defines the original.
    per_elem = getattr(original, "__globals__", {}).get("FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM")
    per_elem = per_elem if isinstance(per_elem, int) else None

    def _get_workspace_buffer(self: Any) -> Any:
        return ws.get_paged_workspace_buffer(self, per_elem)

    _get_workspace_buffer.__doc__ = ws.get_paged_workspace_buffer.__doc__
    return _get_workspace_buffer


def _locking(original: Callable[..., Any], frozen: bool) -> Callable[..., Any]:
    def wrapper(self: Any) -> None:
        original(self)
        registry = get_registry()
        if frozen:
            registry.freeze()
        else:
            registry.unfreeze()

    wrapper.__name__ = original.__name__
    wrapper.__qualname__ = getattr(original, "__qualname__", original.__name__)
    wrapper.__doc__ = original.__doc__
    return wrapper


#: What :func:`register` patches, in order.
TARGETS: tuple[Target, ...] = (
    Target(
        _MLA,
        "_get_workspace_buffer",
        ("return_lse",),
        lambda _: ws.get_mla_workspace_buffer,
        "pool flashinfer_mla (int8)",
    ),
    Target(
        _MLA,
        "_get_multi_ctas_kv_counter_buffer",
        ("min_bytes", "device"),
        lambda _: ws.get_multi_ctas_kv_counter_buffer,
        "pool flashinfer_mla_counters",
    ),
    Target(
        _MLA,
        "FlashInferMLAImpl.forward_mqa",
        ("self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"),
        ws.wrap_forward_mqa,
        "call-time facts num_heads, cp_world",
    ),
    Target(
        _SPARSE,
        "_get_workspace_buffer",
        ("device", "min_bytes"),
        lambda _: ws.get_sparse_workspace_buffer,
        "pool flashinfer_mla_sparse (int8)",
    ),
    Target(
        _SPARSE_SM120,
        "_get_workspace_buffer",
        ("device", "min_bytes"),
        lambda _: ws.get_sparse_workspace_buffer,
        "pool flashinfer_mla_sparse (int8)",
    ),
    Target(_PAGED, "FlashInferMetadataBuilder._get_workspace_buffer", ("self",), _paged_method, "pool flashinfer"),
    Target(
        _PAGED,
        "_get_multi_ctas_kv_counter_buffer",
        ("min_bytes", "device"),
        lambda _: ws.get_paged_multi_ctas_kv_counter_buffer,
        "pool flashinfer_counters",
    ),
    Target(_WORKSPACE, "WorkspaceManager.lock", ("self",), lambda f: _locking(f, True), "also freezes wspool"),
    Target(_WORKSPACE, "WorkspaceManager.unlock", ("self",), lambda f: _locking(f, False), "also unfreezes wspool"),
)

_lock = threading.Lock()
# Target name -> (the object patched, the attribute, vLLM's original, the replacement).
_patches: dict[str, tuple[Any, str, Any, Any]] = {}


def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _locate(target: Target) -> tuple[Any, str, Any]:
    """Return (owner, attribute, current value) of a target, or raise LookupError saying what is missing."""
    try:
        owner: Any = importlib.import_module(target.module)
    except Exception as exc:  # vLLM's own import error (e.g. a missing dependency): keep its behaviour
        raise LookupError(f"module {target.module} does not import ({type(exc).__name__}: {exc})") from None
    *classes, attr = target.path.split(".")
    for part in classes:
        owner = getattr(owner, part, None)
        if owner is None:
            raise LookupError(f"{target.module} has no {part}")
    # A class attribute as stored (not bound), so a wrapper sees the plain function.
    current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if current is None:
        raise LookupError(f"{target.name} is missing")
    try:
        parameters = tuple(inspect.signature(current).parameters)
    except (TypeError, ValueError):
        raise LookupError(f"{target.name} has no signature to check") from None
    if parameters != target.parameters:
        raise LookupError(
            f"{target.name} takes ({', '.join(parameters)}), not ({', '.join(target.parameters)}) as the plugin knows"
        )
    return owner, attr, current


def _hooks_from_vllm() -> list[str]:
    """Point the replacements at vLLM's configuration, lanes and batch-invariant flag; return what is missing."""
    missing = []
    get_config = None
    try:
        from vllm.config import get_current_vllm_config_or_none

        get_config = get_current_vllm_config_or_none
    except ImportError:
        missing.append("vllm.config.get_current_vllm_config_or_none (rules see call-time facts only)")
    vllm_lane = None
    try:
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id
        from vllm.v1.worker.workspace import _workspace_lane

        def vllm_lane() -> tuple[int, int]:
            return dbo_current_ubatch_id(), _workspace_lane.get()

    except ImportError:
        missing.append("vLLM's workspace lanes (every micro-batch uses lane main)")
    batch_invariant = None
    try:
        import vllm.envs as envs

        if hasattr(envs, "VLLM_BATCH_INVARIANT"):

            def batch_invariant() -> bool:
                return bool(envs.VLLM_BATCH_INVARIANT)

    except ImportError:
        pass
    ws.configure(get_config=get_config, vllm_lane=vllm_lane, batch_invariant=batch_invariant)
    return missing


def register() -> None:
    """Install wspool's workspaces into vLLM (the ``vllm.general_plugins`` entry point); never raises.

    Idempotent: what is already patched stays as it is. With ``WSPOOL_VLLM=0``
    nothing is patched. Logs one line naming what was patched and one
    warning naming what was not (vLLM's own behaviour stays for those).
    """
    if not _enabled():
        logger.info("wspool: %s=0: vLLM's FlashInfer workspaces are left as they are", ENABLE_ENV_VAR)
        return
    try:
        _register()
    except Exception:  # never break vLLM's start-up: its own behaviour stays
        logger.exception("wspool: the vLLM plugin failed to load; vLLM's own workspaces stay in use")


def _register() -> None:
    if patched():
        logger.debug("wspool: the vLLM plugin is already loaded")
        return
    # vLLM's modules import (running their code) before the lock is taken; inside it they are cached.
    for module in dict.fromkeys(target.module for target in TARGETS):
        with contextlib.suppress(Exception):  # _locate reports it
            importlib.import_module(module)
    not_patched = _hooks_from_vllm()
    done = []
    with _lock:
        if _patches:
            return
        for target in TARGETS:
            try:
                owner, attr, original = _locate(target)
            except LookupError as exc:
                not_patched.append(f"{target.name} ({exc}; vLLM's own behaviour stays)")
                continue
            replacement = target.make(original)
            setattr(owner, attr, replacement)
            _patches[target.name] = (owner, attr, original, replacement)
            done.append(f"{target.module.rsplit('.', 1)[-1]}.{target.path} -> {target.what}")
    if done:
        logger.info("wspool: vLLM plugin loaded; patched %s", "; ".join(done))
    if not_patched:
        logger.warning("wspool: vLLM plugin did not patch: %s", "; ".join(not_patched))


def unregister() -> list[str]:
    """Put vLLM's originals back (for tests); return the names restored.

    An attribute that something else replaced after wspool is left alone.
    """
    restored = []
    with _lock:
        for name, (owner, attr, original, replacement) in list(_patches.items()):
            current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
            if current is replacement:
                setattr(owner, attr, original)
                restored.append(name)
            del _patches[name]
        ws.configure()
    return restored


def patched() -> list[str]:
    """Return the names of the vLLM attributes wspool replaced in this process."""
    with _lock:
        return list(_patches)
