"""The vLLM plugin: vLLM's FlashInfer workspaces drawn from wspool's pools (vLLM 0.33 and 0.34).

vLLM calls :func:`register` in every process it starts (engine core, workers)
through the ``vllm.general_plugins`` entry point ``wspool`` that wspool's
package declares; ``VLLM_PLUGINS`` (a comma-separated allowlist) must name
``wspool`` when it is set. :func:`register` replaces attributes where vLLM's
callers look them up at call time, in groups (:data:`GROUPS`):

- the MLA decode workspace: ``flashinfer_mla._get_workspace_buffer`` (a module
  global ``forward_mqa`` reads at each call), ``FlashInferMLAImpl.forward_mqa``
  (wrapped so the rules see the shape of the query the kernel gets) and, in
  vLLM 0.34, Kimi K3's ``drafter.attention.folded_decode`` (wrapped likewise);
- trtllm-gen's MLA counters, ``flashinfer_mla._get_multi_ctas_kv_counter_buffer``;
- the sparse MLA workspace, ``flashinfer_mla_sparse._get_workspace_buffer`` and
  its copy imported by name into ``flashinfer_mla_sparse_sm120``;
- the FlashInfer attention builder's ``_get_workspace_buffer`` (a method) and
  trtllm-gen's paged-attention counters;
- the builder's ``_get_decode_wrapper`` and ``_get_prefill_wrapper`` (methods,
  one group each), wrapped so each FlashInfer paged wrapper they make gets a
  right-sized int workspace from pool ``flashinfer_int`` before its first plan
  (:mod:`wspool.integrations.vllm_wrappers`);
- DeepSeek V4's sparse MLA workspace: vLLM 0.34's ``get_flashinfer_dsv4_workspace``
  and its two copies imported by name, vLLM 0.33's ``_get_flashinfer_dsv4_workspace``;
- DASH attention's FlashInfer workspace (vLLM 0.34), ``dash_attention._workspace``;
- ``WorkspaceManager.lock`` / ``.unlock`` (which ``lock_workspace()`` /
  ``unlock_workspace()`` call): vLLM's lock also freezes wspool's registry,
  its unlock unfreezes it.

A group is patched whole or not at all: its targets only work together (the
MLA workspace's rules need the wrapped call sites' facts; a lock that freezes
needs the unlock that unfreezes). A target marked optional may be absent (it
exists only in some vLLM versions): where its module or attribute is absent it
is skipped and the rest of its group is patched; where it is present with other parameters, its
group is not patched. A group that is not patched keeps vLLM's own behaviour,
named in one warning. Registration is all or nothing: an exception while
patching undoes every patch made, and the log says so. Loading never raises;
loading twice patches once. ``WSPOOL_VLLM=0`` leaves vLLM untouched.

See :mod:`wspool.integrations.vllm_workspaces` for the pools and semantics.

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
from wspool.integrations import vllm_wrappers
from wspool.registry import get_registry

__all__ = ["ENABLE_ENV_VAR", "GROUPS", "TARGETS", "Target", "TargetGroup", "patched", "register", "unregister"]

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
_DRAFTER = "vllm.models.kimi_k3.nvidia.specialized_decode.drafter.attention"
_DSV4 = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse"
_DSV41 = "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"
_DSV41_SPARSE = "vllm.models.deepseek_v41.nvidia.specialized_decode.attention.sparse_mla"
_DASH = "vllm.v1.attention.ops.dash_attention"


@dataclass(frozen=True)
class Target:
    """One vLLM attribute the plugin replaces.

    Attributes:
        module: The module that holds it.
        path: The attribute in that module, ``"f"`` or ``"Class.method"``.
        parameters: vLLM's parameter names; another signature is not patched.
        make: Builds the replacement from vLLM's original.
        what: What it becomes, for the log line.
        optional: It may be absent from the vLLM in use (a function of one version, or a
            by-name copy in a module some builds lack): absent, it is skipped.
    """

    module: str
    path: str
    parameters: tuple[str, ...]
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    what: str
    optional: bool = False

    @property
    def name(self) -> str:
        """The dotted name: the module, then the path in it."""
        return f"{self.module}.{self.path}"


@dataclass(frozen=True)
class TargetGroup:
    """Targets patched all or none: each needs the others to be safe.

    Attributes:
        name: What the group serves, for the log lines.
        targets: Its targets, in the order they are patched.
    """

    name: str
    targets: tuple[Target, ...]


class _Absent(LookupError):
    """The target's module or attribute is not in this vLLM."""


class _Changed(LookupError):
    """The target is in this vLLM but not as the plugin knows it (or its module fails to import)."""


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


def _replace_with(replacement: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(_original: Callable[..., Any]) -> Callable[..., Any]:
        return replacement

    return make


_FOLDED_DECODE_PARAMETERS = (
    "q",
    "kv_cache",
    "block_table",
    "seq_lens",
    "max_seq_len",
    "tokens_per_request",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "bmm1_scale",
    "bmm2_scale",
    "workspace",
    "return_lse",
    "dcp_world_size",
    "dcp_rank",
    "dcp_tot_seq_lens",
    "max_reqs",
    "backend",
    "table_cache",
)

_MLA_POOL = "pool flashinfer_mla (int8)"
_SPARSE_POOL = "pool flashinfer_mla_sparse (int8)"
_DSV4_POOL = "pool flashinfer_dsv4"
_INT_POOL = "its wrappers' int workspaces from pool flashinfer_int"

#: What :func:`register` patches: groups in order, each all or none.
GROUPS: tuple[TargetGroup, ...] = (
    TargetGroup(
        "the MLA decode workspace",
        (
            Target(
                _MLA, "_get_workspace_buffer", ("return_lse",), _replace_with(ws.get_mla_workspace_buffer), _MLA_POOL
            ),
            Target(
                _MLA,
                "FlashInferMLAImpl.forward_mqa",
                ("self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"),
                ws.wrap_forward_mqa,
                "the kernel's facts (rows, q_len, heads, cp_world)",
            ),
            Target(
                _DRAFTER,
                "folded_decode",
                _FOLDED_DECODE_PARAMETERS,
                ws.wrap_folded_decode,
                "the folded kernel's facts",
                optional=True,
            ),
        ),
    ),
    TargetGroup(
        "trtllm-gen's MLA counters",
        (
            Target(
                _MLA,
                "_get_multi_ctas_kv_counter_buffer",
                ("min_bytes", "device"),
                _replace_with(ws.get_multi_ctas_kv_counter_buffer),
                "pool flashinfer_mla_counters",
            ),
        ),
    ),
    TargetGroup(
        "the sparse MLA workspace",
        (
            Target(
                _SPARSE,
                "_get_workspace_buffer",
                ("device", "min_bytes"),
                _replace_with(ws.get_sparse_workspace_buffer),
                _SPARSE_POOL,
            ),
            Target(
                _SPARSE_SM120,
                "_get_workspace_buffer",
                ("device", "min_bytes"),
                _replace_with(ws.get_sparse_workspace_buffer),
                _SPARSE_POOL,
                optional=True,
            ),
        ),
    ),
    TargetGroup(
        "the FlashInfer attention workspace",
        (
            Target(
                _PAGED, "FlashInferMetadataBuilder._get_workspace_buffer", ("self",), _paged_method, "pool flashinfer"
            ),
        ),
    ),
    TargetGroup(
        "trtllm-gen's paged-attention counters",
        (
            Target(
                _PAGED,
                "_get_multi_ctas_kv_counter_buffer",
                ("min_bytes", "device"),
                _replace_with(ws.get_paged_multi_ctas_kv_counter_buffer),
                "pool flashinfer_counters",
            ),
        ),
    ),
    # Two groups: the decode wrappers' regions need nothing of the prefill wrapper's, nor it of theirs.
    TargetGroup(
        "the FlashInfer decode wrappers' int workspaces",
        (
            Target(
                _PAGED,
                "FlashInferMetadataBuilder._get_decode_wrapper",
                ("self", "batch_size", "use_cudagraph", "q_len_per_req"),
                vllm_wrappers.wrap_get_decode_wrapper,
                _INT_POOL,
            ),
        ),
    ),
    TargetGroup(
        "the FlashInfer prefill wrappers' int workspaces",
        (
            Target(
                _PAGED,
                "FlashInferMetadataBuilder._get_prefill_wrapper",
                ("self", "causal"),
                vllm_wrappers.wrap_get_prefill_wrapper,
                _INT_POOL,
            ),
        ),
    ),
    TargetGroup(
        "DeepSeek V4's sparse MLA workspace",
        (
            # vLLM 0.34: one function, two copies imported by name.
            *(
                Target(
                    module,
                    "get_flashinfer_dsv4_workspace",
                    ("device",),
                    _replace_with(ws.get_dsv4_workspace),
                    _DSV4_POOL,
                    optional=True,
                )
                for module in (_DSV4, _DSV41, _DSV41_SPARSE)
            ),
            # vLLM 0.33: a function in each model's module, the second imported by name.
            *(
                Target(
                    module,
                    "_get_flashinfer_dsv4_workspace",
                    ("device",),
                    _replace_with(ws.get_dsv4_workspace),
                    _DSV4_POOL,
                    optional=True,
                )
                for module in (_DSV4, _DSV41, _DSV41_SPARSE)
            ),
        ),
    ),
    TargetGroup(
        "DASH attention's FlashInfer workspace",
        (
            Target(
                _DASH,
                "_workspace",
                ("device",),
                _replace_with(ws.get_dash_workspace),
                "pool flashinfer_dash",
                optional=True,
            ),
        ),
    ),
    TargetGroup(
        "vLLM's workspace lock",
        (
            Target(_WORKSPACE, "WorkspaceManager.lock", ("self",), lambda f: _locking(f, True), "also freezes wspool"),
            Target(
                _WORKSPACE, "WorkspaceManager.unlock", ("self",), lambda f: _locking(f, False), "also unfreezes wspool"
            ),
        ),
    ),
)

#: Every target of :data:`GROUPS`, in order.
TARGETS: tuple[Target, ...] = tuple(target for group in GROUPS for target in group.targets)

_lock = threading.Lock()
# Target name -> (the object patched, the attribute, vLLM's original, the replacement).
_patches: dict[str, tuple[Any, str, Any, Any]] = {}


def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _import(module: str) -> Any:
    """Import a target's module; raise _Absent where it (or a package above it) does not exist."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            raise _Absent(f"module {module} is not in this vLLM") from None
        raise _Changed(f"module {module} does not import ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # vLLM's own import error (e.g. a missing dependency)
        raise _Changed(f"module {module} does not import ({type(exc).__name__}: {exc})") from None


def _locate(target: Target) -> tuple[Any, str, Any]:
    """Return (owner, attribute, current value) of a target.

    Raises:
        _Absent: Its module or attribute is not in this vLLM.
        _Changed: It is there, but with other parameters or without a signature, or its module fails to import.
    """
    owner: Any = _import(target.module)
    *classes, attr = target.path.split(".")
    for part in classes:
        owner = getattr(owner, part, None)
        if owner is None:
            raise _Absent(f"{target.module} has no {part}")
    # A class attribute as stored (not bound), so a wrapper sees the plain function.
    current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if current is None:
        raise _Absent(f"{target.name} is missing")
    try:
        parameters = tuple(inspect.signature(current).parameters)
    except (TypeError, ValueError):
        raise _Changed(f"{target.name} has no signature to check") from None
    if parameters != target.parameters:
        raise _Changed(
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


def _short(module: str) -> str:
    """A module's name for the log line: a model's path under ``vllm.models``, else its last part."""
    models = "vllm.models."
    return module[len(models) :] if module.startswith(models) else module.rsplit(".", 1)[-1]


class _PartialUndo(RuntimeError):
    """Registration failed and some of its patches could not be undone."""


def register() -> None:
    """Install wspool's workspaces into vLLM (the ``vllm.general_plugins`` entry point); never raises.

    Idempotent: what is already patched stays as it is. With ``WSPOOL_VLLM=0``
    nothing is patched. Logs one line naming what was patched, one naming the
    optional targets this vLLM lacks, and one warning naming the groups not
    patched (vLLM's own behaviour stays for those). An exception while patching
    undoes every patch this call made, and the error says so.
    """
    if not _enabled():
        logger.info("wspool: %s=0: vLLM's FlashInfer workspaces are left as they are", ENABLE_ENV_VAR)
        return
    try:
        _register()
    except _PartialUndo as exc:
        logger.error("wspool: the vLLM plugin failed to load: %s", exc, exc_info=exc.__cause__)
    except Exception:  # never break vLLM's start-up: _register undid what it patched
        logger.exception(
            "wspool: the vLLM plugin failed to load and patched nothing; vLLM's own workspaces stay in use"
        )


def _plan() -> tuple[list[tuple[Target, Any, str, Any]], list[str], list[str]]:
    """Locate every group's targets; return (what to patch, groups not patched and why, optional targets absent)."""
    plan: list[tuple[Target, Any, str, Any]] = []
    not_patched: list[str] = []
    absent: list[str] = []
    for group in GROUPS:
        located: list[tuple[Target, Any, str, Any]] = []
        skipped: list[str] = []
        failure = None
        for target in group.targets:
            try:
                located.append((target, *_locate(target)))
            except _Absent as exc:
                if not target.optional:
                    failure = str(exc)
                    break
                skipped.append(target.name)
            except _Changed as exc:
                failure = str(exc)
                break
        if failure is not None:
            not_patched.append(f"{group.name} ({failure})")
        else:
            plan.extend(located)
            absent.extend(skipped)
    return plan, not_patched, absent


def _undo(applied: list[tuple[str, Any, str, Any, Any]]) -> list[str]:
    """Put vLLM's originals back, newest first; return 'name (why)' for each that could not be."""
    stuck = []
    for name, owner, attr, original, replacement in reversed(applied):
        try:
            setattr(owner, attr, original)
        except Exception as exc:
            stuck.append(f"{name} ({type(exc).__name__}: {exc})")
            _patches[name] = (owner, attr, original, replacement)
    return stuck


def _register() -> None:
    if patched():
        logger.debug("wspool: the vLLM plugin is already loaded")
        return
    # vLLM's modules import (running their code) before the lock is taken; inside it they are cached.
    for module in dict.fromkeys(target.module for target in TARGETS):
        with contextlib.suppress(Exception):  # _locate reports it
            importlib.import_module(module)
    with _lock:
        if _patches:
            return
        applied: list[tuple[str, Any, str, Any, Any]] = []
        try:
            plan, not_patched, absent = _plan()
            # The log line is built first: once everything is patched, nothing here can fail.
            done = [f"{_short(target.module)}.{target.path} -> {target.what}" for target, *_ in plan]
            missing_hooks = _hooks_from_vllm() if plan else []
            for target, owner, attr, original in plan:
                replacement = target.make(original)
                setattr(owner, attr, replacement)
                applied.append((target.name, owner, attr, original, replacement))
        except Exception as exc:
            stuck = _undo(applied)
            if not stuck:
                ws.configure()
                raise
            raise _PartialUndo(
                f"{type(exc).__name__}: {exc}; undoing its patches failed for {'; '.join(stuck)}, which stay "
                "wspool's (wspool.integrations.vllm.patched() lists them); every other patch was undone"
            ) from exc
        for name, owner, attr, original, replacement in applied:
            _patches[name] = (owner, attr, original, replacement)
    if done:
        logger.info("wspool: vLLM plugin loaded; patched %s", "; ".join(done))
    if absent:
        logger.info("wspool: not in this vLLM, so not patched: %s", "; ".join(absent))
    if not_patched or missing_hooks:
        logger.warning(
            "wspool: vLLM plugin did not patch: %s",
            "; ".join([*(f"{what}; vLLM's own behaviour stays" for what in not_patched), *missing_hooks]),
        )


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
