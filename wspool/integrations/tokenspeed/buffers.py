"""TokenSpeed's attention workspaces served from wspool's pools: its shared block, and the buffers it keeps apart.

- :class:`ServedWorkspacePool` replaces TokenSpeed's ``WorkspacePool`` class:
  the per-device shared scratch block that trtllm MHA and cute-dsl MLA draw
  from becomes pool ``tokenspeed_scratch``, allocated on the first request
  (never in the constructor), with TokenSpeed's 256-byte carve and its freeze
  mapped onto wspool's.
- trtllm-gen MLA's and DSA's zeroed workspaces (:func:`trtllm_mla_workspace`,
  :func:`dsa_workspace`) and FlashMLA's FlashInfer prefill workspace
  (:func:`wrap_flashmla_constructor`) come from pools of their own, per
  device, which never share bytes with the scratch block.
- :func:`wrap_mha_constructor` sizes trtllm MHA's draw from the block by rule
  ``tokenspeed_scratch.trtllm_mha``.

Every rule may read ``tokenspeed_bytes``, what TokenSpeed's own code would
allocate there (its variables honoured); docs/tokenspeed.md lists the rules.
Device semantics: the device TokenSpeed names. Lanes: the calling context's.
Capture: TokenSpeed freezes before capture, and a frozen registry refuses
growth with :class:`~wspool.WorkspaceFrozenError`. TokenSpeed's private names
are read through one accessor each (:data:`ACCESSORS`, read from
:data:`READ_FROM`), which imports TokenSpeed's module only when called.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

import wspool
from wspool.errors import ConfigError, RuleError
from wspool.integrations.patching import (
    Handles,
    SaidOnce,
    Workspace,
    declared_rules,
    missing_workspace_facts,
    require_own_buffers,
)
from wspool.units import MiB, ceil_div, format_size, round_up

__all__ = [
    "ACCESSORS",
    "BLOCK",
    "DSA",
    "FACT_NAMES",
    "FLASHMLA",
    "READ_FROM",
    "TOKENSPEED_POOLS",
    "TRTLLM_MHA",
    "TRTLLM_MLA",
    "WORKSPACES",
    "ServedWorkspacePool",
    "TokenspeedPools",
    "dsa_workspace",
    "dsa_workspace_bytes",
    "flashmla_module",
    "flashmla_workspace",
    "set_flashmla_workspace",
    "trtllm_mla_workspace",
    "wrap_flashmla_constructor",
    "wrap_mha_constructor",
]

logger = logging.getLogger("wspool.integrations.tokenspeed")

#: TokenSpeed's carve: every view of one ``allocate`` starts on a 256-byte boundary of the block.
ALIGN_BYTES = 256


#: The shared block (``WorkspacePool.allocate``): each request's total, as TokenSpeed carves it.
BLOCK = Workspace("WorkspacePool block", "tokenspeed_scratch", "block")
#: trtllm MHA's draw from the block, per backend.
TRTLLM_MHA = Workspace(
    "trtllm MHA scratch", "tokenspeed_scratch", "trtllm_mha", variable="TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB"
)
#: trtllm-gen MLA's zeroed workspace (``get_trtllm_workspace_buffer``).
TRTLLM_MLA = Workspace(
    "trtllm-gen MLA workspace",
    "tokenspeed_trtllm_mla",
    "default",
    own_buffer=True,
    variable="TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB",
)
#: FlashMLA's FlashInfer prefill workspace (``FlashMLABackend``'s ``_global_workspace_buffer``).
FLASHMLA = Workspace(
    "FlashMLA's FlashInfer prefill workspace", "flashinfer", "tokenspeed_flashmla", variable="FLASHINFER_WORKSPACE_SIZE"
)
#: DSA sparse MLA's zeroed workspace (``_get_dsa_sparse_workspace``).
DSA = Workspace("DSA sparse MLA workspace", "tokenspeed_dsa", "default", own_buffer=True)

#: Every workspace the integration serves.
WORKSPACES: tuple[Workspace, ...] = (BLOCK, TRTLLM_MHA, TRTLLM_MLA, FLASHMLA, DSA)

#: The facts the integration passes to the rules (beside the device's ``sm_count``).
FACT_NAMES = ("tokenspeed_bytes", "num_qo_heads", "num_kv_heads", "head_dim", "kv_lora_rank", "batch_size")


#: The rules the integration declares, each sized by what TokenSpeed's own code allocates there, below
#: the configuration (YAML, ``WSPOOL_*`` and TokenSpeed's variables override each);
#: ``configs/tokenspeed.yaml`` right-sizes them.
TOKENSPEED_POOLS = declared_rules(((w.pool, w.rule) for w in WORKSPACES), "tokenspeed_bytes")

_SCRATCH = BLOCK.pool
_CALL_FACTS = frozenset(FACT_NAMES)
_DOCS = "see docs/tokenspeed.md"


class TokenspeedPools:
    """Per registry: the integration's pools declared and checked, and its handles.

    Raises:
        ConfigError: A declared rule is invalid, a zeroed workspace's pool shares
            a buffer, or FlashMLA's pool shares the scratch block's buffer.
    """

    def __init__(self, registry: wspool.PoolRegistry) -> None:
        for pool, rules in TOKENSPEED_POOLS.items():
            registry.declare_pool(pool, rules)
        zeroed = {
            w.pool: f"TokenSpeed zeroes its {w.name}: the kernel keeps state in it between launches"
            for w in WORKSPACES
            if w.own_buffer
        }
        require_own_buffers(registry, zeroed, nor_hosts=True)
        if registry.buffer_pool(FLASHMLA.pool) == registry.buffer_pool(_SCRATCH):
            raise ConfigError(
                f"pool {FLASHMLA.pool!r} shares pool {_SCRATCH!r}'s buffer: FlashMLA's prefill wrappers keep their "
                f"plans' partial results there between calls, which the scratch block's users overwrite; set "
                f"pools.{FLASHMLA.pool}.shared_with / WSPOOL_POOLS__{FLASHMLA.pool.upper()}__SHARED_WITH to another "
                "pool",
                path=("pools", FLASHMLA.pool, "shared_with"),
            )
        self.registry = registry

    @classmethod
    def of(cls, registry: wspool.PoolRegistry) -> TokenspeedPools:
        """Return ``registry``'s, declaring the pools on first use."""
        return registry.state(cls, lambda: cls(registry))

    def resolve(self, w: Workspace, device: Any, facts: Mapping[str, int]) -> int:
        """Return the bytes ``w``'s rule gives for ``facts`` on ``device``; allocates nothing.

        Raises:
            RuleError: The rule reads a fact the integration does not pass (named in the message).
        """
        try:
            return self.registry.resolve(w.pool, w.rule, device=device, **facts)
        except RuleError as exc:
            raise missing_workspace_facts(exc, "TokenSpeed", w, facts, FACT_NAMES, _DOCS) from exc


def _pools() -> TokenspeedPools:
    return TokenspeedPools.of(wspool.get_registry())


def _serve(w: Workspace, device: Any, facts: Mapping[str, int]) -> torch.Tensor:
    """Return ``w``'s pool buffer on ``device`` for ``facts`` (the same mapping each call keeps the fast path)."""
    lane = wspool.current_lane()
    pools = _pools()
    _, buffer, held = Handles.of(pools.registry).serve(
        w, w.rule, device, lane, facts, engine="TokenSpeed", fact_names=FACT_NAMES, docs=_DOCS, call_facts=_CALL_FACTS
    )
    if buffer is not held and SaidOnce.of(pools.registry).first("TokenSpeed", w.setting, device, lane):
        own = facts.get("tokenspeed_bytes", 0)
        logger.info(
            "wspool: TokenSpeed's %s is %s of pool %s (%s on %s, lane %s; TokenSpeed's own: %s)",
            w.name,
            format_size(buffer.numel()),
            w.pool,
            w.setting,
            device,
            lane,
            format_size(own),
        )
    return buffer


# -- the shared block -------------------------------------------------------------------------


class ServedWorkspacePool:
    """TokenSpeed's ``WorkspacePool``, served from pool ``tokenspeed_scratch`` (it replaces the class).

    TokenSpeed's contract is kept: views from one :meth:`allocate` never
    overlap and start on 256-byte boundaries; views from separate calls share
    the same bytes; the block grows to the largest single request and its
    address is stable while frozen. Unlike TokenSpeed's, the constructor
    allocates nothing: the block is made on the first request. An explicit
    ``initial_nbytes``, or ``TOKENSPEED_WORKSPACE_INITIAL_MB`` when the user set
    it, is the least the first request makes.

    Device: the one given. Lane: the calling context's, per call. Thread
    semantics: TokenSpeed's (main stream only; see its ``workspace.py``).
    """

    def __init__(self, device: torch.device | str, initial_nbytes: int | None = None) -> None:
        self.device = torch.device(device)
        if initial_nbytes is None:
            initial_nbytes = _initial_from_variable()
        self.initial_nbytes = initial_nbytes or 0
        self._facts: dict[int, Mapping[str, int]] = {}

    def allocate(self, *specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        """Return one view per ``(shape, dtype)``, none overlapping the others (valid until the next call).

        Raises:
            WorkspaceFrozenError: The block would have to grow while frozen or capturing.
            WorkspaceLimitError: Beyond ``pools.tokenspeed_scratch.max_bytes`` or the device's memory.
        """
        if not specs:
            return []
        sizes = [round_up(math.prod(shape) * dtype.itemsize, ALIGN_BYTES) for shape, dtype in specs]
        total = sum(sizes)
        facts = self._facts.get(total)
        if facts is None:  # one mapping per total, so a repeated request takes the handle's fast path
            facts = self._facts.setdefault(
                total, MappingProxyType({"tokenspeed_bytes": max(total, self.initial_nbytes)})
            )
        block = _serve(BLOCK, self.device, facts)
        views = []
        offset = 0
        for (shape, dtype), size in zip(specs, sizes, strict=True):
            end = offset + math.prod(shape) * dtype.itemsize
            views.append(block[offset:end].view(dtype).view(shape))
            offset += size
        return views

    def freeze(self) -> None:
        """Freeze wspool's registry (every pool, TokenSpeed calls it before capture); growth now raises."""
        wspool.get_registry().freeze()
        logger.info("wspool: TokenSpeed froze the workspace on %s: wspool's pools are frozen", self.device)

    def unfreeze(self) -> None:
        """Unfreeze wspool's registry (TokenSpeed calls it when it releases its graphs)."""
        wspool.get_registry().unfreeze()

    @property
    def frozen(self) -> bool:
        """Whether wspool's registry refuses growth (frozen by TokenSpeed or by wspool)."""
        return wspool.get_registry().is_frozen


def _initial_from_variable() -> int:
    """``TOKENSPEED_WORKSPACE_INITIAL_MB`` in bytes when the user set it, else 0 (TokenSpeed's public ``envs``)."""
    variable = _envs().TOKENSPEED_WORKSPACE_INITIAL_MB
    return int(variable.get()) * MiB if variable.is_set() else 0


def _envs() -> Any:
    import importlib

    return importlib.import_module("tokenspeed.runtime.utils.env").envs


# -- the constructors -------------------------------------------------------------------------


def _heads(spec: Any) -> int:
    return max(int(spec.num_attention_heads) // int(spec.attn_tp_size), 1)


def wrap_mha_constructor(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``TRTLLMMHAAttnBackend.__init__``: its draw from the block is rule ``tokenspeed_scratch.trtllm_mha``.

    TokenSpeed sizes the draw from ``TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB``, read
    in the constructor; where the rule resolves to another size, the
    constructor runs under TokenSpeed's own ``envs.<variable>.override`` with
    the rule's size in whole MiB (rounded up). Construction runs at start-up,
    in one thread: the override is process-wide while the constructor runs.
    """

    @functools.wraps(original)
    def __init__(self: Any, config: Any, spec: Any, *, kernel_page_size: int) -> None:
        variable = _envs().TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB
        own = int(variable.get()) * MiB
        facts = {
            "tokenspeed_bytes": own,
            "num_qo_heads": _heads(spec),
            "num_kv_heads": max(int(spec.num_kv_heads) // int(spec.attn_tp_size), 1),
            "head_dim": int(spec.head_dim),
            "batch_size": int(config.max_bs),
        }
        mib = ceil_div(_pools().resolve(TRTLLM_MHA, torch.device(config.device), facts), MiB)
        sized = variable.override(mib) if mib * MiB != own else contextlib.nullcontext()
        with sized:
            original(self, config, spec, kernel_page_size=kernel_page_size)

    return __init__


@contextlib.contextmanager
def _flashmla_buffer(buffer: torch.Tensor) -> Iterator[None]:
    """Put ``buffer`` where FlashMLA's constructor takes its workspace, and what was there back after."""
    module = flashmla_module()
    previous = flashmla_workspace(module)
    set_flashmla_workspace(module, buffer)
    try:
        yield
    finally:
        set_flashmla_workspace(module, previous)


def wrap_flashmla_constructor(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``FlashMLABackend.__init__``: its FlashInfer prefill workspace from rule ``flashinfer.tokenspeed_flashmla``.

    TokenSpeed keeps one module global that the first backend allocates and
    every later one takes, whatever its device; here each construction takes
    the pool's buffer for its own device, and the global is left as it was.
    """
    size_of = flashmla_module().get_flashinfer_workspace_size

    @functools.wraps(original)
    def __init__(self: Any, config: Any, spec: Any, *, kernel_page_size: int) -> None:
        facts = {
            "tokenspeed_bytes": int(size_of()),
            "num_qo_heads": _heads(spec),
            "head_dim": int(spec.v_head_dim),
            "kv_lora_rank": int(spec.kv_lora_rank),
            "batch_size": int(config.max_bs),
        }
        with _flashmla_buffer(_serve(FLASHMLA, torch.device(config.device), facts)):
            original(self, config, spec, kernel_page_size=kernel_page_size)

    return __init__


# -- the zeroed getters -----------------------------------------------------------------------


def trtllm_mla_workspace(device: torch.device | str) -> torch.Tensor:
    """``get_trtllm_workspace_buffer``: trtllm-gen MLA's zeroed workspace for ``device``, from its own pool.

    TokenSpeed's keeps one buffer, made on the first call's device, for every
    device; this one is per device (and lane).
    """
    own = int(_envs().TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB.get()) * MiB
    return _serve(TRTLLM_MLA, torch.device(device), {"tokenspeed_bytes": own})


@functools.cache
def _dsa_facts() -> Mapping[str, int]:
    return MappingProxyType({"tokenspeed_bytes": dsa_workspace_bytes()})


def dsa_workspace(device: torch.device | str) -> torch.Tensor:
    """``_get_dsa_sparse_workspace``: DSA sparse MLA's zeroed workspace for ``device``, from its own pool.

    Called per decode launch: in the steady state it is a bound handle's fast path.
    """
    return _serve(DSA, torch.device(device), _dsa_facts())


# -- TokenSpeed's private names ---------------------------------------------------------------
# TokenSpeed offers no public way to reach these; ``tests/integrations/test_tokenspeed.py`` fails
# with the accessor's name when TokenSpeed lacks one.

#: The TokenSpeed release every name below was read from.
READ_FROM = "TokenSpeed 0.1.1 (tokenspeed-kernel 0.1.4)"

_FLASHMLA_MODULE = "tokenspeed.runtime.layers.attention.backends.paged.flashmla"
_DSA_MODULE = "tokenspeed_kernel.ops.attention.dsa.flashinfer"
_FLASHMLA_GLOBAL = "_global_workspace_buffer"
_DSA_BYTES = "_DSA_SPARSE_WORKSPACE_BYTES"


def flashmla_module() -> Any:
    """Return TokenSpeed's FlashMLA backend module (imports it)."""
    return importlib.import_module(_FLASHMLA_MODULE)


def flashmla_workspace(module: Any) -> Any:
    """Return ``flashmla._global_workspace_buffer``, the buffer a FlashMLA backend takes when built (TokenSpeed 0.1.1).

    ``None`` until a backend allocated it: ``FlashMLABackend.__init__`` allocates
    ``get_flashinfer_workspace_size()`` bytes there when it finds ``None``.
    """
    return getattr(module, _FLASHMLA_GLOBAL, None)


def set_flashmla_workspace(module: Any, buffer: Any) -> None:
    """Set ``flashmla._global_workspace_buffer``, which ``FlashMLABackend.__init__`` reads (TokenSpeed 0.1.1)."""
    setattr(module, _FLASHMLA_GLOBAL, buffer)


def dsa_workspace_bytes() -> int:
    """Return ``_DSA_SPARSE_WORKSPACE_BYTES``, DSA sparse MLA's fixed size (tokenspeed-kernel 0.1.4: 384 MiB)."""
    return int(getattr(importlib.import_module(_DSA_MODULE), _DSA_BYTES))


#: Every accessor with the module and name it reads (for the test that they still exist).
ACCESSORS: dict[str, tuple[str, str]] = {
    "flashmla_workspace": (_FLASHMLA_MODULE, _FLASHMLA_GLOBAL),
    "dsa_workspace_bytes": (_DSA_MODULE, _DSA_BYTES),
}
