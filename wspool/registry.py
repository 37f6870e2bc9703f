"""The registry: pool name + device + lane -> one shared workspace pool.

Several backends embed one registry: each names the pool it draws from, and
pools with the same name on the same device and lane are the same memory, as
are pools configured to share a buffer (``pools.<pool>.shared_with``): their
rules are served by one buffer, which grows to the largest. That is safe for
sequential use on one stream; concurrent streams need separate pools or lanes
(see :mod:`wspool.lanes`). :meth:`PoolRegistry.memory_summary` shows what each
buffer holds and which backends drew from it.

Profiles: each device's pools are configured by the profile the ``profile``
setting gives that device (:mod:`wspool.settings.profiles`; ``auto`` picks per compute
capability), layered just above the built-in defaults; :meth:`PoolRegistry.profile_of`
says which and why. Facts: a rule reads a fact its call lacks from the pool's
default facts (``pools.<pool>.facts``), then from the device's
(:mod:`wspool.device_facts`), merged once per pool and device.

Thread semantics: all methods are thread-safe. Device semantics: see
:func:`wspool.devices.resolve_device`; ``"cuda"`` and ``None`` are resolved
to the current device on every call, never cached. Capture semantics: see
:mod:`wspool.pool`; :meth:`PoolRegistry.freeze` refuses all growth.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from wspool.declarations import Declaration, linked_spec, stage_declaration
from wspool.device_facts import DeviceDescription
from wspool.device_facts import describe_device as describe_any_device
from wspool.devices import DeviceLike, is_dynamic, resolve_device
from wspool.freeze import FreezeState
from wspool.lanes import current_lane
from wspool.lifecycle import RegistryLifecycle
from wspool.pool import Allocator, PoolSpec, WorkspacePool
from wspool.pool_checks import check_rule_facts, unknown_pool, unknown_rule
from wspool.settings.config import WspoolSettings, check_shared_pools, load_settings, profile_settings
from wspool.settings.profiles import ProfileChoice, choose_profile

__all__ = ["PoolRegistry", "get_registry", "reset_registry", "set_registry"]

_PoolKey = tuple[str, torch.device, str]
#: Describes a device for its facts and profile; ``None`` for a device that is not a GPU.
DeviceDescriber = Callable[[torch.device], DeviceDescription | None]


class PoolRegistry(RegistryLifecycle):
    """Named, per-device workspace pools sized by configured rules.

    Args:
        settings: Validated settings; ``None`` loads them from ``WSPOOL_CONFIG``,
            the environment and the built-in defaults.
        allocator: Makes zero-filled ``uint8`` buffers (for tests and custom
            memory pools); default ``torch.zeros``.
        mem_pool: A :class:`torch.cuda.MemPool` that CUDA buffers are allocated
            in (under :func:`torch.cuda.use_mem_pool`), for engines that manage
            a pool's memory as a whole (sleep and offload modes).
        describe_device: Describes a device for its facts and profile; default
            :func:`wspool.device_facts.describe_device` (read once per device).
            Tests pass their own to stand a CPU in for an SM90 or SM100 GPU.

    Attributes:
        settings: The settings with the profile of devices without a description
            (the CPU) layered in; each GPU's pools use its own profile's.
        freeze_state: Whether growth is refused, shared by every pool of the registry.
    """

    def __init__(
        self,
        settings: WspoolSettings | None = None,
        *,
        allocator: Allocator | None = None,
        mem_pool: Any = None,
        describe_device: DeviceDescriber | None = None,
    ) -> None:
        given = settings if settings is not None else load_settings()
        base = choose_profile(given.profile, None)
        self.settings, provenance = profile_settings(given, base.profile)
        self._given = given
        self._describe: DeviceDescriber = describe_device or describe_any_device
        self._profile_source = provenance.source_of(("profile",))
        self._views: dict[str, PoolRegistry] = {base.profile: self}
        self._devices: dict[torch.device, tuple[PoolRegistry, ProfileChoice, Mapping[str, int]]] = {}
        if mem_pool is not None:
            from wspool.accounting import mem_pool_allocator

            allocator = mem_pool_allocator(mem_pool, allocator)
        self._allocator = allocator
        self._lock = threading.RLock()
        self.freeze_state = FreezeState()
        self._specs: dict[str, PoolSpec] = {}
        self._declared: dict[str, dict[str, Any]] = {}
        self._pools: dict[_PoolKey, WorkspacePool] = {}
        self._fast: dict[tuple[str, DeviceLike, str], WorkspacePool] = {}
        #: Per-registry state of the ops built on it (e.g. the plans ``mla_decode`` reuses),
        #: keyed by the op; it lives and dies with the registry and :meth:`reset` clears it.
        self.op_state: dict[str, Any] = {}
        self._build_specs()

    def _build_specs(self) -> None:
        for name, pool in self.settings.pools.items():
            self._specs[name] = PoolSpec(name, pool.rules, pool.growth, pool.max_bytes, facts=pool.facts)
        check_shared_pools(self.settings)
        # A pool configured with shared_with draws from its host's buffer, whose spec
        # carries the rules of both (self._specs keeps each pool's own).
        self._hosts = {name: p.shared_with for name, p in self.settings.pools.items() if p.shared_with}
        self._buffer_specs: dict[str, PoolSpec] = {}
        for host in sorted(set(self._hosts.values())):
            self._link(host)

    def _view(self, profile: str) -> PoolRegistry:
        """The registry's view for one profile: its own specs, this registry's pools, lock and freeze."""
        found = self._views.get(profile)
        if found is not None:
            return found
        settings, _ = profile_settings(self._given, profile)  # outside the lock: it reads files and the environment
        view = PoolRegistry.__new__(PoolRegistry)
        view.__dict__.update(self.__dict__)  # share pools, caches, lock, freeze state and op state
        view.settings, view._specs = settings, {}
        view._build_specs()
        with self._lock:
            for name, declared in self._declared.items():
                view._apply_declaration(view._stage_declaration(name, declared, replay=True))
            return self._views.setdefault(profile, view)

    def _device_entry(self, device: torch.device) -> tuple[PoolRegistry, ProfileChoice, Mapping[str, int]]:
        entry = self._devices.get(device)
        if entry is None:
            description = self._describe(device)
            choice = choose_profile(self._given.profile, description, source=self._profile_source)
            facts = {} if description is None else dict(description.facts())
            entry = self._devices.setdefault(device, (self._view(choice.profile), choice, facts))
        return entry

    def profile_of(self, device: DeviceLike = None) -> ProfileChoice:
        """Return the profile ``device``'s pools are configured by, and why (``None``: the current device)."""
        return self._device_entry(resolve_device(device))[1]

    def device_facts(self, device: DeviceLike = None) -> Mapping[str, int]:
        """Return the facts ``device`` supplies to every rule (empty off the GPU; ``None``: the current device)."""
        return self._device_entry(resolve_device(device))[2]

    def default_facts(self, pool: str, device: DeviceLike = None) -> dict[str, int]:
        """Return the facts a call to ``pool`` on ``device`` gets where it gives none: configured over device facts.

        Raises:
            ConfigError: No pool of that name is configured or declared.
        """
        view, _, facts = self._device_entry(resolve_device(device))
        return {**facts, **view.spec(pool).facts}

    def check_facts(
        self, pool: str, rules: Iterable[str] | None = None, *, device: DeviceLike = None, supplied: Iterable[str] = ()
    ) -> None:
        """Check, before any call, that ``rules`` of ``pool`` can be resolved on ``device`` from ``supplied`` facts.

        A call site that passes fixed facts (an engine's drop-in function passes
        none) calls this once at load time, so a missing default fact fails
        there, naming its key, instead of at the first decode step.

        Args:
            pool: The pool.
            rules: Its rules to check; ``None``: all of them.
            device: The device whose profile and facts apply; ``None``: the current device.
            supplied: The facts the call site passes itself.

        Raises:
            ConfigError: A rule reads a fact that neither the call, the pool's
                default facts nor the device supply; the message names
                ``pools.<pool>.facts.<name>`` / ``WSPOOL_POOLS__<POOL>__FACTS__<NAME>``.
        """
        view, choice, _ = self._device_entry(resolve_device(device))
        spec = view.spec(pool)
        available = set(supplied) | set(self.default_facts(pool, device))
        check_rule_facts(pool, spec, rules, available=available, profile=choice.profile)

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

    def resolve(self, pool: str, rule: str = "default", *, device: DeviceLike = None, **facts: object) -> int:
        """Return the bytes a call on ``device`` would get from ``rule``; allocates nothing.

        ``device`` (``None``: the current device) picks the profile and the
        device facts; facts the call lacks come from the pool's default facts.
        """
        view, _, device_facts = self._device_entry(resolve_device(device))
        spec = view.spec(pool)
        compiled = spec.rules.get(rule)
        if compiled is None:
            raise unknown_rule(pool, rule, spec)
        return compiled.resolve(facts, {**device_facts, **spec.facts})

    # -- pools -------------------------------------------------------------

    def spec(self, pool: str, device: DeviceLike = None) -> PoolSpec:
        """Return a pool's configuration, under ``device``'s profile (``None``: that of :attr:`settings`).

        Raises:
            ConfigError: No pool of that name is configured or declared.
        """
        if device is not None:
            return self._device_entry(resolve_device(device))[0].spec(pool)
        spec = self._specs.get(pool)
        if spec is None:
            raise unknown_pool(pool, self._specs)
        return spec

    def pool(self, name: str, device: DeviceLike = None, *, lane: str | None = None) -> WorkspacePool:
        """Return (creating, without allocating) the pool for ``name`` on ``device`` and ``lane``.

        For a pool configured with ``shared_with``, this is its host's pool: the
        one buffer that serves the rules of both.
        """
        if lane is None:
            lane = current_lane()
        resolved = resolve_device(device)
        view, _, facts = self._device_entry(resolved)
        host = view._hosts.get(name, name)
        key = (host, resolved, lane)
        found = self._pools.get(key)
        if found is None:
            with self._lock:
                found = self._pools.get(key)
                if found is None:
                    found = WorkspacePool(
                        view._buffer_specs.get(host) or view.spec(host),
                        resolved,
                        lane,
                        freeze=self.freeze_state,
                        allocator=self._allocator,
                        debug_streams=view.settings.debug_streams,
                        device_facts=facts,
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

        The declaration applies under every device's profile.

        Raises:
            ConfigError: A declared rule is invalid.
        """
        declared: dict[str, Any] = {"rules": dict(rules), "growth": growth, "max_bytes": max_bytes}
        with self._lock:
            views = [self, *(v for v in {id(v): v for v in self._views.values()}.values() if v is not self)]
            # Every profile view's change is built and validated before any is applied:
            # a declaration that fails anywhere changes nothing.
            staged = [view._stage_declaration(name, declared) for view in views]
            for view, change in zip(views, staged, strict=True):
                view._apply_declaration(change)
            self._declared[name] = declared
            return staged[0].spec

    def _stage_declaration(self, name: str, declared: Mapping[str, Any], replay: bool = False) -> Declaration:
        """Build this view's spec for a declaration, validated as YAML is; change nothing (lock held)."""
        return stage_declaration(
            name, declared, settings=self.settings, specs=self._specs, hosts=self._hosts,
            shared_hosts=self._buffer_specs, host_in_use=lambda host: any(key[0] == host for key in self._pools),
            spec_of=self.spec, replay=replay,
        )  # fmt: skip

    def _apply_declaration(self, change: Declaration) -> None:
        """Install a staged declaration (lock held); swapping whole dicts keeps lock-free readers consistent."""
        if change.specs is None:
            return
        self._specs = change.specs
        if change.linked is not None:
            self._buffer_specs[change.host] = change.linked

    def _link(self, host: str) -> None:
        """Build the spec of ``host``'s buffer from the current specs."""
        self._buffer_specs[host] = linked_spec(host, self._specs, self._hosts, self.spec)

    def buffer_pool(self, name: str) -> str:
        """Return the pool whose buffer ``name`` draws from: its ``shared_with`` host, else itself."""
        return self._hosts.get(name, name)

    def pools(self) -> Iterator[WorkspacePool]:
        """Iterate over every pool instance created so far."""
        with self._lock:
            found = list(self._pools.values())
        yield from found

    def reset(self) -> None:
        """Drop every pool instance and its buffers and statistics; unfreeze (for tests)."""
        with self._lock:
            self._pools.clear()
            self._fast.clear()
            self.op_state.clear()
            self.freeze_state.clear()


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
