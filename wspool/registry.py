"""The registry: pool name + device + lane -> one shared workspace pool.

Several backends embed one registry: each names the pool it draws from, and
pools with the same name on the same device and lane are the same memory, as
are pools configured to share a buffer (``pools.<pool>.shared_with``): their
rules are served by one buffer, which grows to the largest. That is safe for
sequential use on one stream; concurrent streams need separate pools or lanes
(see :mod:`wspool.lanes`). :meth:`PoolRegistry.memory_summary` shows what each
buffer holds and which backends drew from it.

Thread semantics: all methods are thread-safe. Device semantics: see
:func:`wspool.devices.resolve_device`; ``"cuda"`` and ``None`` are resolved
to the current device on every call, never cached. Capture semantics: see
:mod:`wspool.pool`; :meth:`PoolRegistry.freeze` refuses all growth.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from wspool.config import WspoolSettings, _check_shared_pools, load_settings, validate_pool
from wspool.devices import DeviceLike, is_dynamic, resolve_device
from wspool.errors import ConfigError, describe_setting
from wspool.lanes import current_lane
from wspool.pool import Allocator, PoolSpec, PoolStats, WorkspacePool, _FreezeState

__all__ = ["PoolRegistry", "get_registry", "reset_registry", "set_registry"]

_PoolKey = tuple[str, torch.device, str]


class PoolRegistry:
    """Named, per-device workspace pools sized by configured rules.

    Args:
        settings: Validated settings; ``None`` loads them from ``WSPOOL_CONFIG``,
            the environment and the built-in defaults.
        allocator: Makes zero-filled ``uint8`` buffers (for tests and custom
            memory pools); default ``torch.zeros``.
        mem_pool: A :class:`torch.cuda.MemPool` that CUDA buffers are allocated
            in (under :func:`torch.cuda.use_mem_pool`), for engines that manage
            a pool's memory as a whole (sleep and offload modes).
    """

    def __init__(
        self,
        settings: WspoolSettings | None = None,
        *,
        allocator: Allocator | None = None,
        mem_pool: Any = None,
    ) -> None:
        self.settings = settings if settings is not None else load_settings()
        if mem_pool is not None:
            from wspool.accounting import mem_pool_allocator

            allocator = mem_pool_allocator(mem_pool, allocator)
        self._allocator = allocator
        self._lock = threading.RLock()
        self._freeze = _FreezeState()
        self._specs: dict[str, PoolSpec] = {}
        self._declared: dict[str, dict[str, Any]] = {}
        self._pools: dict[_PoolKey, WorkspacePool] = {}
        self._fast: dict[tuple[str, DeviceLike, str], WorkspacePool] = {}
        #: Per-registry state of the ops built on it (e.g. the plans ``mla_decode`` reuses),
        #: keyed by the op; it lives and dies with the registry and :meth:`reset` clears it.
        self.op_state: dict[str, Any] = {}
        for name, pool in self.settings.pools.items():
            self._specs[name] = PoolSpec(name, pool.rules, pool.growth, pool.max_bytes)
        _check_shared_pools(self.settings)
        # A pool configured with shared_with draws from its host's buffer, whose spec
        # carries the rules of both (self._specs keeps each pool's own).
        self._hosts = {name: p.shared_with for name, p in self.settings.pools.items() if p.shared_with}
        self._buffer_specs: dict[str, PoolSpec] = {}
        for host in sorted(set(self._hosts.values())):
            self._link(host)

    @classmethod
    def from_config(cls, config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> PoolRegistry:
        """Build a registry from a YAML file (a missing file is an error), the environment and code overrides.

        Args:
            config_file: The YAML file; ``None`` uses ``WSPOOL_CONFIG`` if set.
            **overrides: Settings given in code (highest precedence).

        Raises:
            ConfigError: The configuration is invalid; nothing is allocated.
        """
        return cls(load_settings(config_file, **overrides))

    # -- the per-call path -------------------------------------------------

    def workspace(
        self,
        pool: str,
        device: DeviceLike = None,
        *,
        rule: str = "default",
        lane: str | None = None,
        **facts: object,
    ) -> torch.Tensor:
        """Return the pool's ``uint8`` buffer on ``device``, large enough for ``rule``.

        Args:
            pool: The pool's name, e.g. ``"flashinfer_mla"``.
            device: Where the buffer is needed; ``None`` is the current device
                (CUDA when available, else CPU), ``"cuda"`` the current CUDA device.
            rule: The pool's rule that sizes this call.
            lane: The lane; ``None`` uses :func:`wspool.lane`'s current one.
            **facts: The call's shape (``batch_size=...``) for expression rules.

        Returns:
            The whole buffer (``numel() >= `` the resolved size). It stays valid
            until the pool grows; do not keep it across calls that may grow it.

        Raises:
            ConfigError: Unknown pool or rule, or the rule cannot be resolved.
            WorkspaceFrozenError: Growth needed while frozen or capturing.
            WorkspaceLimitError: Growth needed beyond ``max_bytes`` or memory.
        """
        if lane is None:
            lane = current_lane()
        if device is None or device == "cuda":
            device = resolve_device(device)
        found = self._fast.get((pool, device, lane))
        if found is None:
            if is_dynamic(device):  # torch.device("cuda"): look up by the current index instead
                device = resolve_device(device)
                found = self._fast.get((pool, device, lane))
            if found is None:
                found = self.pool(pool, device, lane=lane)
        return found.workspace(rule, facts)

    def resolve(self, pool: str, rule: str = "default", **facts: object) -> int:
        """Return the bytes a call would get from ``rule``; allocates nothing."""
        spec = self.spec(pool)
        compiled = spec.rules.get(rule)
        if compiled is None:
            known = ", ".join(sorted(spec.rules)) or "none"
            raise ConfigError(
                f"pool {pool!r} has no rule {rule!r} (rules: {known}); set {spec.setting('rules', rule)}",
                path=("pools", pool, "rules", rule),
            )
        return compiled.resolve(facts)

    # -- pools -------------------------------------------------------------

    def spec(self, pool: str) -> PoolSpec:
        """Return a pool's configuration.

        Raises:
            ConfigError: No pool of that name is configured or declared.
        """
        spec = self._specs.get(pool)
        if spec is None:
            known = ", ".join(sorted(self._specs)) or "none"
            raise ConfigError(
                f"unknown pool {pool!r} (configured: {known}); define pools.{pool}.rules in the YAML "
                f"file or WSPOOL_POOLS__{pool.upper()}__RULES__DEFAULT",
                path=("pools", pool),
            )
        return spec

    def pool(self, name: str, device: DeviceLike = None, *, lane: str | None = None) -> WorkspacePool:
        """Return (creating, without allocating) the pool for ``name`` on ``device`` and ``lane``.

        For a pool configured with ``shared_with``, this is its host's pool: the
        one buffer that serves the rules of both.
        """
        if lane is None:
            lane = current_lane()
        resolved = resolve_device(device)
        host = self._hosts.get(name, name)
        key = (host, resolved, lane)
        found = self._pools.get(key)
        if found is None:
            with self._lock:
                found = self._pools.get(key)
                if found is None:
                    found = WorkspacePool(
                        self._buffer_specs.get(host) or self.spec(host),
                        resolved,
                        lane,
                        freeze=self._freeze,
                        allocator=self._allocator,
                        debug_streams=self.settings.debug_streams,
                    )
                    self._pools[key] = found
        if not is_dynamic(device):
            self._fast[(name, device, lane)] = found
        return found

    def declare_pool(
        self,
        name: str,
        rules: Mapping[str, str | int],
        *,
        growth: str = "exact",
        max_bytes: int | str | None = None,
    ) -> PoolSpec:
        """Declare a backend's pool with its default rules, below the configuration.

        Configured values (YAML, environment, code) override the declared ones
        rule by rule, so a backend ships sensible sizes and users can still
        change each of them.

        Raises:
            ConfigError: A declared rule is invalid.
        """
        values: dict[str, Any] = {"rules": dict(rules), "growth": growth, "max_bytes": max_bytes}
        with self._lock:
            configured = self.settings.pools.get(name)
            if configured is not None:
                values["rules"].update(configured.rules)
                for key in ("growth", "max_bytes"):
                    if key in configured.model_fields_set:
                        values[key] = getattr(configured, key)
        # Validated as YAML is (max_bytes 0, a fixed rule above max_bytes, growth's case), before anything changes.
        validated = validate_pool(name, values)
        spec = PoolSpec(name, validated.rules, validated.growth, validated.max_bytes)
        with self._lock:
            host = self._hosts.get(name, name)
            if any(key[0] == host for key in self._pools):
                current = self._specs[name]
                if {k: r.source for k, r in current.rules.items()} != {k: r.source for k, r in spec.rules.items()}:
                    raise ConfigError(f"pool {name!r} is in use; declare it before its first request")
                return current
            specs = {**self._specs, name: spec}
            linked = self._linked(host, specs) if host in self._buffer_specs else None  # may raise: nothing set yet
            self._specs = specs
            if linked is not None:
                self._buffer_specs[host] = linked
            return spec

    def _link(self, host: str) -> None:
        """Build the spec of ``host``'s buffer from the current specs."""
        self._buffer_specs[host] = self._linked(host, self._specs)

    def _linked(self, host: str, specs: Mapping[str, PoolSpec]) -> PoolSpec:
        """Return the spec of ``host``'s buffer: its own rules and those of the pools that share it."""
        own = specs[host] if host in specs else self.spec(host)
        rules: dict[str, str | int] = {rule: compiled.source for rule, compiled in own.rules.items()}
        owners: dict[str, str] = {}
        for guest in sorted(g for g, h in self._hosts.items() if h == host):
            for rule, compiled in specs[guest].rules.items():
                if rule in rules:
                    raise ConfigError(
                        f"pools {guest!r} and {host!r} share one buffer (pools.{guest}.shared_with) and both "
                        f"have a rule {rule!r}; rename one, or set {describe_setting(('pools', guest, 'shared_with'))} "
                        f"empty to give {guest!r} its own buffer",
                        path=("pools", guest, "rules", rule),
                    )
                rules[rule] = compiled.source
                owners[rule] = guest
        return PoolSpec(host, rules, own.growth, own.max_bytes, rule_pools=owners)

    def buffer_pool(self, name: str) -> str:
        """Return the pool whose buffer ``name`` draws from: its ``shared_with`` host, else itself."""
        return self._hosts.get(name, name)

    def pools(self) -> Iterator[WorkspacePool]:
        """Iterate over every pool instance created so far."""
        with self._lock:
            found = list(self._pools.values())
        yield from found

    def stats(self, pool: str, device: DeviceLike = None, *, lane: str | None = None) -> PoolStats:
        """Return the statistics of one pool on one device and lane (zeros if never used)."""
        return self.pool(pool, device, lane=lane).stats()

    def all_stats(self) -> list[PoolStats]:
        """Return the statistics of every pool instance, sorted by pool, device and lane."""
        return sorted((p.stats() for p in self.pools()), key=lambda s: (s.pool, s.device, s.lane))

    def memory_stats(self) -> dict[str, Any]:
        """Return what every buffer holds, per backend, with PyTorch's figures on CUDA (JSON-able).

        See :func:`wspool.accounting.memory_stats`; reading it has no side effects.
        """
        from wspool.accounting import memory_stats

        return memory_stats(self)

    def memory_summary(self) -> str:
        """Return a table: pool, device, lane, capacity, peak request, grows, backends; then totals per device."""
        from wspool.accounting import memory_summary

        return memory_summary(self)

    # -- reserve, warm up, freeze --------------------------------------------

    def reserve(
        self,
        pool: str,
        device: DeviceLike = None,
        *,
        nbytes: int | str | None = None,
        rule: str | None = None,
        lane: str | None = None,
        **facts: object,
    ) -> torch.Tensor:
        """Grow a pool ahead of time to ``nbytes`` or to what ``rule`` resolves to.

        Raises:
            ValueError: Neither or both of ``nbytes`` and ``rule`` are given.
        """
        if (nbytes is None) == (rule is None):
            raise ValueError("reserve() takes exactly one of nbytes= or rule=")
        target = self.pool(pool, device, lane=lane)
        if rule is not None:
            return target.workspace(rule, facts)
        from wspool.units import parse_size

        return target.request(parse_size(nbytes), "reserve")

    def warmup(
        self,
        pool: str,
        facts_list: Iterable[Mapping[str, object]],
        device: DeviceLike = None,
        *,
        rule: str = "default",
        lane: str | None = None,
        agree_group: Any = None,
    ) -> int:
        """Resolve ``rule`` over every shape an engine will capture; grow once, to the largest.

        Args:
            agree_group: A ``torch.distributed`` process group, e.g.
                ``torch.distributed.group.WORLD``. Given, the largest size is
                agreed with :func:`wspool.distributed.agree` (a collective: every
                rank of the group calls ``warmup`` for the same pools in the same
                order), so every rank grows once, to the maximum over the ranks,
                and a rank that cannot grow raises on every rank. ``None``: local only.

        Returns:
            The pool's capacity afterwards, in bytes.
        """
        target = self.pool(pool, device, lane=lane)
        largest = max((self.resolve(pool, rule, **facts) for facts in facts_list), default=0)
        if agree_group is not None:
            from wspool.distributed import agree

            agree(self, agree_group, device=target.device, reserve={(pool, target.lane): largest})
        if largest:
            target.request(largest, f"warmup of rule {rule}")
        return target.capacity_bytes

    def freeze(self) -> None:
        """Refuse all growth from now on (requests that fit are still served)."""
        self._freeze.frozen = True

    def unfreeze(self) -> None:
        """Undo :meth:`freeze`; growth stays refused while a :meth:`frozen` block is open."""
        self._freeze.frozen = False

    @property
    def is_frozen(self) -> bool:
        """Whether growth is refused."""
        return self._freeze.frozen

    @contextmanager
    def frozen(self) -> Iterator[PoolRegistry]:
        """Refuse growth inside the block.

        Blocks are counted: with blocks open in several threads at once, the
        registry stays frozen until the last one closes, and then is frozen
        exactly when :meth:`freeze` was called without :meth:`unfreeze`.
        """
        token = self._freeze.enter()
        try:
            yield self
        finally:
            self._freeze.leave(token)

    def release_retired(self) -> int:
        """Free buffers kept for captured graphs; call once those graphs are gone.

        Returns:
            Bytes released across all pools.
        """
        return sum(p.release_retired() for p in self.pools())

    def reset(self) -> None:
        """Drop every pool instance and its buffers and statistics; unfreeze (for tests)."""
        with self._lock:
            self._pools.clear()
            self._fast.clear()
            self.op_state.clear()
            self._freeze.clear()


_default: PoolRegistry | None = None
_default_lock = threading.Lock()


def get_registry() -> PoolRegistry:
    """Return the process-wide registry, built on first use from ``WSPOOL_CONFIG``, the environment and defaults."""
    global _default
    found = _default
    if found is None:
        with _default_lock:
            if _default is None:
                _default = PoolRegistry()
            found = _default
    return found


def set_registry(registry: PoolRegistry | None) -> None:
    """Replace the process-wide registry (``None``: rebuild on next use)."""
    global _default
    with _default_lock:
        _default = registry


def reset_registry() -> None:
    """Forget the process-wide registry; the next :func:`get_registry` reloads the configuration."""
    set_registry(None)
