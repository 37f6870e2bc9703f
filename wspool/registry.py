"""The registry: pool name + device + lane -> one shared workspace pool.

Pools of one name on one device and lane are the same memory, as are pools
configured to share a buffer (``shared_with``). Each device's pools follow the
profile the ``profile`` setting gives that device; a rule reads a fact its
call lacks from the pool's default facts, then from the device's.

Thread semantics: every method is thread-safe. Device semantics: ``"cuda"`` and
``None`` are resolved to the current device on every call, never cached.
Capture semantics: reserve and warm up before capture; :meth:`PoolRegistry.freeze`
refuses all growth (docs/profiles.md, README's CUDA-graph rules).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from wspool.devices import DeviceDescription, DeviceLike, is_dynamic, resolve_device
from wspool.devices import describe_device as describe_any_device
from wspool.errors import ConfigError, describe_setting, unknown_pool, unknown_rule
from wspool.pool import Allocator, FreezeState, PoolSource, PoolSpec, PoolStats, WorkspacePool
from wspool.rules import LiteralRule
from wspool.settings.profiles import PROFILE_NAMES, ProfileChoice, choose_profile
from wspool.settings.schema import WspoolSettings, check_shared_pools, load_settings, profile_settings, validate_pool
from wspool.streams import current_lane

__all__ = ["PoolRegistry", "get_registry", "reset_registry", "set_registry"]


def _check_rule_facts(
    pool: str, spec: PoolSpec, rules: Iterable[str] | None, *, available: set[str], profile: str
) -> None:
    """Check that ``rules`` of ``pool`` (``None``: all) read only ``available`` facts.

    Raises:
        ConfigError: A rule is unknown, or reads a fact that is not available; the
            message names ``pools.<pool>.facts.<name>`` / ``WSPOOL_POOLS__<POOL>__FACTS__<NAME>``.
    """
    for rule in sorted(spec.rules) if rules is None else rules:
        compiled = spec.rules.get(rule)
        if compiled is None:
            raise unknown_rule(pool, rule, spec.rules)
        missing = [name for name in compiled.names if name not in available]
        if missing:
            keys = ", ".join(describe_setting(("pools", pool, "facts", name)) for name in missing)
            raise ConfigError(
                f"rule {describe_setting(('pools', pool, 'rules', rule))} = {compiled.source!r} (profile "
                f"{profile}) needs fact(s) {', '.join(missing)}, which this call site does not pass "
                f"and no default supplies; set {keys}",
                path=("pools", pool, "facts", missing[0]),
            )


class _Declaration(NamedTuple):
    """A pool declaration staged for one profile view: applied only once every view validated it."""

    spec: PoolSpec  # what declare_pool returns
    specs: dict[str, PoolSpec] | None  # the view's new specs; None: nothing changes
    host: str  # the pool whose buffer it draws from
    linked: PoolSpec | None  # the host buffer's new spec, when it is shared


def _build_declaration(
    name: str,
    declared: Mapping[str, Any],
    *,
    settings: WspoolSettings,
    specs: Mapping[str, PoolSpec],
    hosts: Mapping[str, str],
    shared_hosts: Mapping[str, PoolSpec],
    host_in_use: Callable[[str], bool],
    spec_of: Callable[[str], PoolSpec],
    replay: bool = False,
) -> _Declaration:
    """Build one profile view's spec for a declaration, validated as YAML is; change nothing.

    ``settings`` are the view's (configured values override declared ones rule by rule);
    ``replay`` replays an earlier declaration on a new view (in-use pools are no obstacle).

    Raises:
        ConfigError: A declared rule is invalid, or the pool is in use with other rules.
    """
    values: dict[str, Any] = {**declared, "rules": dict(declared["rules"])}
    configured = settings.pools.get(name)
    if configured is not None:
        values["rules"].update(configured.rules)
        for key in ("growth", "max_bytes"):
            if key in configured.model_fields_set:
                values[key] = getattr(configured, key)
    # Validated as YAML is (max_bytes 0, a fixed rule above max_bytes, growth's case).
    validated = validate_pool(name, values)
    spec = PoolSpec(
        name, validated.rules, validated.growth, validated.max_bytes, facts=configured.facts if configured else None
    )
    host = hosts.get(name, name)
    current = specs.get(name)
    if not replay and current is not None and host_in_use(host):
        if {k: r.source for k, r in current.rules.items()} != {k: r.source for k, r in spec.rules.items()}:
            raise ConfigError(f"pool {name!r} is in use; declare it before its first request")
        return _Declaration(current, None, host, None)
    new_specs = {**specs, name: spec}
    # May raise: nothing is set yet.
    linked = _linked_spec(host, new_specs, hosts, spec_of) if host in shared_hosts else None
    return _Declaration(spec, new_specs, host, linked)


def _linked_spec(
    host: str, specs: Mapping[str, PoolSpec], hosts: Mapping[str, str], spec_of: Callable[[str], PoolSpec]
) -> PoolSpec:
    """Return the spec of ``host``'s buffer: its own rules and those of the pools that share it.

    Raises:
        ConfigError: Two pools sharing the buffer have a rule of the same name.
    """
    own = specs[host] if host in specs else spec_of(host)
    rules: dict[str, str | int] = {rule: compiled.source for rule, compiled in own.rules.items()}
    owners: dict[str, str] = {}
    facts: dict[str, Mapping[str, int]] = {}
    for guest in sorted(g for g, h in hosts.items() if h == host):
        facts.update(dict.fromkeys(specs[guest].rules, specs[guest].facts))
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
    return PoolSpec(host, rules, own.growth, own.max_bytes, rule_pools=owners, facts=own.facts, rule_facts=facts)


def _check_guest_literals(buffer: PoolSpec) -> None:
    """Raise a ConfigError naming both keys for a fixed rule a guest brings to ``buffer`` above its ``max_bytes``."""
    for rule, compiled in buffer.rules.items():
        owner = buffer.rule_pools.get(rule, buffer.name)
        if owner == buffer.name or buffer.max_bytes is None or not isinstance(compiled, LiteralRule):
            continue
        if compiled.nbytes > buffer.max_bytes:
            raise ConfigError(
                f"{describe_setting(('pools', owner, 'rules', rule))} = {compiled.source!r} is above "
                f"{describe_setting(('pools', buffer.name, 'max_bytes'))} = {buffer.max_bytes}, the cap of the buffer "
                f"it shares (pools.{owner}.shared_with = {buffer.name}), so it could never be served; lower the rule "
                f"or raise the cap",
                path=("pools", owner, "rules", rule),
            )


class _ProfileView:
    """One profile's configuration of a registry's pools: its settings, specs and shared buffers.

    A registry holds one per profile in use; they share nothing mutable but
    what the registry passes in. Thread semantics: the registry changes a view
    under its lock and swaps whole dicts, so lock-free readers stay consistent.
    """

    def __init__(self, settings: WspoolSettings) -> None:
        self.settings = settings
        self.specs: dict[str, PoolSpec] = {
            name: PoolSpec(name, pool.rules, pool.growth, pool.max_bytes, facts=pool.facts)
            for name, pool in settings.pools.items()
        }
        check_shared_pools(settings)
        # A pool configured with shared_with draws from its host's buffer, whose spec
        # carries the rules of both (self.specs keeps each pool's own).
        self.hosts = {name: p.shared_with for name, p in settings.pools.items() if p.shared_with}
        self.buffer_specs: dict[str, PoolSpec] = {}
        for host in sorted(set(self.hosts.values())):
            self.buffer_specs[host] = _linked_spec(host, self.specs, self.hosts, self.spec)
            _check_guest_literals(self.buffer_specs[host])

    def spec(self, pool: str) -> PoolSpec:
        """Return ``pool``'s own configuration under this profile.

        Raises:
            ConfigError: No pool of that name is configured or declared.
        """
        spec = self.specs.get(pool)
        if spec is None:
            raise unknown_pool(pool, self.specs)
        return spec

    def buffer_spec(self, host: str) -> PoolSpec:
        """Return the spec of ``host``'s buffer: its own, or with the rules of the pools that share it."""
        return self.buffer_specs.get(host) or self.spec(host)

    def stage(
        self, name: str, declared: Mapping[str, Any], host_in_use: Callable[[str], bool], replay: bool = False
    ) -> _Declaration:
        """Build this view's spec for a declaration, validated as YAML is; change nothing."""
        return _build_declaration(
            name, declared, settings=self.settings, specs=self.specs, hosts=self.hosts,
            shared_hosts=self.buffer_specs, host_in_use=host_in_use, spec_of=self.spec, replay=replay,
        )  # fmt: skip

    def apply(self, change: _Declaration) -> None:
        """Install a staged declaration; swapping whole dicts keeps lock-free readers consistent."""
        if change.specs is None:
            return
        self.specs = change.specs
        if change.linked is not None:
            self.buffer_specs = {**self.buffer_specs, change.host: change.linked}


_PoolKey = tuple[str, torch.device, str]
#: Describes a device for its facts and profile; ``None`` for a device that is not a GPU.
DeviceDescriber = Callable[[torch.device], DeviceDescription | None]


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
        describe_device: Describes a device for its facts and profile; default
            :func:`wspool.devices.describe_device` (read once per device).
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
        if mem_pool is not None:
            from wspool.memory import mem_pool_allocator

            allocator = mem_pool_allocator(mem_pool, allocator)
        self._allocator = allocator
        self._describe: DeviceDescriber = describe_device or describe_any_device
        self._lock = threading.RLock()
        self.freeze_state = FreezeState()
        self._declared: dict[str, dict[str, Any]] = {}
        self._pools: dict[_PoolKey, WorkspacePool] = {}
        # (pool, device as given, lane, rule) -> the pool instance that serves it: filled on a
        # call's first miss, once the rule is known to be the named pool's own.
        self._fast: dict[tuple[str, DeviceLike, str, str], WorkspacePool] = {}
        self._views: dict[str, _ProfileView] = {}
        self._devices: dict[torch.device, tuple[_ProfileView, ProfileChoice, Mapping[str, int]]] = {}
        #: Per-registry state of the ops built on it (e.g. the plans ``mla_decode`` reuses),
        #: keyed by the op; it lives and dies with the registry and :meth:`reset` clears it.
        self.op_state: dict[str, Any] = {}
        # Every profile is layered now over the sources read for ``given``, so the registry holds
        # to the configuration it was built with whatever the file or the environment says
        # later; a profile that does not validate fails when a device first uses it.
        self._profile_setting = given.profile
        self._profile_settings: dict[str, WspoolSettings | ConfigError] = {}
        self._profile_source = "default"
        for profile in PROFILE_NAMES:
            try:
                self._profile_settings[profile], provenance = profile_settings(given, profile)
            except ConfigError as exc:
                self._profile_settings[profile] = exc
            else:
                self._profile_source = provenance.source_of(("profile",))
        self._base = self._view(choose_profile(given.profile, None).profile)
        self.settings = self._base.settings

    def _view(self, profile: str) -> _ProfileView:
        """Return the view of ``profile`` (made on first use, with every earlier declaration replayed).

        Raises:
            ConfigError: The profile's settings do not validate with the configuration's.
        """
        found = self._views.get(profile)
        if found is not None:
            return found
        settings = self._profile_settings[profile]
        if isinstance(settings, ConfigError):
            raise settings
        view = _ProfileView(settings)
        with self._lock:
            for name, declared in self._declared.items():
                view.apply(view.stage(name, declared, self._host_in_use, replay=True))
            return self._views.setdefault(profile, view)

    def _host_in_use(self, host: str) -> bool:
        return any(key[0] == host for key in self._pools)

    def _device_entry(self, device: torch.device) -> tuple[_ProfileView, ProfileChoice, Mapping[str, int]]:
        entry = self._devices.get(device)
        if entry is None:
            description = self._describe(device)
            choice = choose_profile(self._profile_setting, description, source=self._profile_source)
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
        _check_rule_facts(pool, spec, rules, available=available, profile=choice.profile)

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
        found = self._fast.get((pool, device, lane, rule))
        if found is None:
            if is_dynamic(device):  # torch.device("cuda"): look up by the current index instead
                device = resolve_device(device)
                found = self._fast.get((pool, device, lane, rule))
            if found is None:
                found = self._serving(pool, device, lane, rule)
        return found.workspace(rule, facts)

    def _serving(self, pool: str, device: DeviceLike, lane: str, rule: str) -> WorkspacePool:
        """Return the pool instance that serves ``pool``'s ``rule`` (a call's first miss), remembering it.

        A pool serves the rules it has: for pools that share one buffer, the host's
        instance serves each pool's own rules only, as :meth:`resolve` says.
        """
        found = self.pool(pool, device, lane=lane)
        self._own_rule(pool, rule, device)
        if not is_dynamic(device):
            self._fast[(pool, device, lane, rule)] = found
        return found

    def _own_rule(self, pool: str, rule: str, device: DeviceLike) -> None:
        """Raise the error naming the setting unless ``rule`` is ``pool``'s own under ``device``'s profile."""
        spec = self.spec(pool, resolve_device(device))
        if rule not in spec.rules:
            raise unknown_rule(pool, rule, spec.rules)

    def resolve(self, pool: str, rule: str = "default", *, device: DeviceLike = None, **facts: object) -> int:
        """Return the bytes a call on ``device`` would get from ``rule``; allocates nothing.

        ``device`` (``None``: the current device) picks the profile and the
        device facts; facts the call lacks come from the pool's default facts.
        """
        view, _, device_facts = self._device_entry(resolve_device(device))
        spec = view.spec(pool)
        compiled = spec.rules.get(rule)
        if compiled is None:
            raise unknown_rule(pool, rule, spec.rules)
        return compiled.resolve(facts, {**device_facts, **spec.facts})

    # -- pools -------------------------------------------------------------

    def spec(self, pool: str, device: DeviceLike = None) -> PoolSpec:
        """Return a pool's configuration, under ``device``'s profile (``None``: that of :attr:`settings`).

        Raises:
            ConfigError: No pool of that name is configured or declared.
        """
        if device is not None:
            return self._device_entry(resolve_device(device))[0].spec(pool)
        return self._base.spec(pool)

    def pool(self, name: str, device: DeviceLike = None, *, lane: str | None = None) -> WorkspacePool:
        """Return (creating, without allocating) the pool for ``name`` on ``device`` and ``lane``.

        For a pool configured with ``shared_with``, this is its host's pool: the
        one buffer that serves the rules of both.
        """
        if lane is None:
            lane = current_lane()
        resolved = resolve_device(device)
        view, _, facts = self._device_entry(resolved)
        host = view.hosts.get(name, name)
        key = (host, resolved, lane)
        found = self._pools.get(key)
        if found is None:
            with self._lock:
                found = self._pools.get(key)
                if found is None:
                    found = WorkspacePool(
                        view.buffer_spec(host),
                        resolved,
                        lane,
                        freeze=self.freeze_state,
                        allocator=self._allocator,
                        debug_streams=view.settings.debug_streams,
                        device_facts=facts,
                    )
                    self._pools[key] = found
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
        if not isinstance(rules, Mapping) or not rules:
            raise ConfigError(
                f"declare_pool({name!r}, rules): rules must be a non-empty mapping of rule name to a size or an "
                f"expression, e.g. {{'default': '64MiB'}}; got {rules!r:.80}",
                path=("pools", name, "rules"),
            )
        declared: dict[str, Any] = {"rules": dict(rules), "growth": growth, "max_bytes": max_bytes}
        with self._lock:
            views = [self._base, *(v for v in self._views.values() if v is not self._base)]
            # Every profile view's change is built and validated before any is applied:
            # a declaration that fails anywhere changes nothing.
            staged = [view.stage(name, declared, self._host_in_use) for view in views]
            for view, change in zip(views, staged, strict=True):
                view.apply(change)
            self._declared[name] = declared
            return staged[0].spec

    def pool_names(self) -> list[str]:
        """Return the names of every configured or declared pool, sorted."""
        return sorted(self._base.specs)

    def buffer_pool(self, name: str) -> str:
        """Return the pool whose buffer ``name`` draws from: its ``shared_with`` host, else itself."""
        return self._base.hosts.get(name, name)

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

    # -- reserve, warm up, freeze, release, report --------------------------------

    def stats(self, pool: str, device: DeviceLike = None, *, lane: str | None = None) -> PoolStats:
        """Return the statistics of one pool on one device and lane (zeros if never used)."""
        return self.pool(pool, device, lane=lane).stats()

    def all_stats(self) -> list[PoolStats]:
        """Return the statistics of every pool instance, sorted by pool, device and lane."""
        return sorted((p.stats() for p in self.pools()), key=lambda s: (s.pool, s.device, s.lane))

    def memory_stats(self) -> dict[str, Any]:
        """Return what every buffer holds, per backend, with PyTorch's figures on CUDA (JSON-able).

        See :func:`wspool.memory.memory_stats`; reading it has no side effects.
        """
        from wspool.memory import memory_stats

        return memory_stats(self._source())

    def memory_summary(self) -> str:
        """Return a table: pool, device, lane, capacity, peak request, grows, backends; then totals per device."""
        from wspool.memory import memory_summary

        return memory_summary(self._source())

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
            self._own_rule(pool, rule, device)
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
        self._own_rule(pool, rule, device)
        largest = max((target.resolve(rule, facts) for facts in facts_list), default=0)
        if agree_group is not None:
            from wspool.distributed import agree

            # Agreement is per buffer: a shared_with pool's buffer is its host's.
            buffer = (target.spec.name, target.lane)
            agree(self._source(), agree_group, device=target.device, reserve={buffer: largest})
        if largest:
            target.request(largest, f"warmup of rule {rule}")
        return target.capacity_bytes

    def freeze(self) -> None:
        """Refuse all growth from now on (requests that fit are still served)."""
        self.freeze_state.frozen = True

    def unfreeze(self) -> None:
        """Undo :meth:`freeze`; growth stays refused while a :meth:`frozen` block is open."""
        self.freeze_state.frozen = False

    @property
    def is_frozen(self) -> bool:
        """Whether growth is refused."""
        return self.freeze_state.frozen

    @contextmanager
    def frozen(self) -> Iterator[PoolRegistry]:
        """Refuse growth inside the block.

        Blocks are counted: with blocks open in several threads at once, the
        registry stays frozen until the last one closes, and then is frozen
        exactly when :meth:`freeze` was called without :meth:`unfreeze`.
        """
        token = self.freeze_state.enter()
        try:
            yield self
        finally:
            self.freeze_state.leave(token)

    def release_retired(self) -> int:
        """Free buffers kept for captured graphs; call once those graphs are gone.

        Returns:
            Bytes released across all pools.
        """
        return sum(p.release_retired() for p in self.pools())

    def _source(self) -> PoolSource:
        """This registry, as the modules below it read one."""
        source: PoolSource = self
        return source


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
