"""The registry: pool name + device + lane -> one shared workspace pool.

Pools of one name, device and lane (or sharing a buffer, ``shared_with``) are
the same memory; each device's pools follow its profile (docs/profiles.md).
Thread-safe. ``"cuda"`` and ``None`` resolve to the current device on every
call. Reserve and warm up before capture; :meth:`PoolRegistry.freeze` refuses
all growth (README's CUDA-graph rules).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from wspool.bounds import Reservation, apply_reservation, plan_reservation
from wspool.devices import (
    DEFAULT_LANE,
    LANES_ENTERED,
    DeviceDescription,
    DeviceLike,
    current_lane,
    is_dynamic,
    resolve_device,
)
from wspool.devices import describe_device as describe_any_device
from wspool.errors import ConfigError, RuleError, describe_setting, unknown_rule
from wspool.freeze import FreezeState
from wspool.pool import (
    Allocator,
    PoolSource,
    PoolSpec,
    PoolStats,
    RegionsView,
    WorkspaceHandle,
    WorkspacePool,
    bump_epoch,
)
from wspool.profile_views import ProfileView, check_rule_facts
from wspool.settings.profiles import PROFILE_NAMES, ProfileChoice, choose_profile
from wspool.settings.schema import DEVICE_FACTS, SHAPE_FACTS, WspoolSettings, load_settings, profile_settings

__all__ = [
    "PoolRegistry",
    "check_given_facts",
    "get_registry",
    "registry_in_force",
    "reset_registry",
    "set_registry",
    "unknown_facts_text",
]


_PoolKey = tuple[str, torch.device, str]


class _Served:
    """What serves one rule on the per-call path: the pool instance, a handle, and the handle's steady call."""

    __slots__ = ("handle", "held", "pool")

    def __init__(self, pool: WorkspacePool, handle: WorkspaceHandle) -> None:
        self.pool = pool
        self.handle = handle
        self.held = handle.held


def _refuse_negative_facts(pool: str, facts: Mapping[str, object]) -> None:
    """Refuse a negative fact given to :meth:`PoolRegistry.resolve`, as a default fact in YAML or ``WSPOOL_*`` is."""
    for name, value in facts.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise RuleError(
                f"fact {name!r} = {value} is negative: a fact is a non-negative integer (as "
                f"{describe_setting(('pools', pool, 'facts', name))} is)",
                path=("pools", pool, "facts", name),
            )


def check_given_facts(spec: PoolSpec, rule: str, facts: Mapping[str, object]) -> None:
    """Refuse a fact given to :meth:`PoolRegistry.resolve` or ``wspool resolve`` that nothing would read.

    Known names: those any rule of the pool reads, its default facts, the facts wspool's ops
    pass (:data:`SHAPE_FACTS`) and the device's (:data:`DEVICE_FACTS`).

    Raises:
        RuleError: Naming the unknown facts, those ``rule`` reads and the close spellings.
    """
    known = {*SHAPE_FACTS, *DEVICE_FACTS, *spec.facts}
    for other in spec.rules.values():
        known.update(other.names)
    for defaults in spec.rule_facts.values():
        known.update(defaults)
    unknown = sorted(name for name in facts if name not in known)
    if unknown:
        raise RuleError(
            unknown_facts_text(unknown, spec.name, rule, sorted(spec.rules[rule].names), known),
            path=("pools", spec.name, "rules", rule),
        )


def unknown_facts_text(unknown: Iterable[str], pool: str, rule: str, read: Iterable[str], known: Iterable[str]) -> str:
    """Say which given facts pool ``pool`` does not read, what rule ``rule`` reads, and the close spellings.

    ``"fact 'batchsize' is read by no rule of pool 'flashinfer_mla', so it would be ignored
    (rule lse reads batch_size, num_heads, q_len); did you mean 'batch_size'?"``
    """
    names = list(unknown)
    candidates = sorted({*read, *known})
    matches = {name: difflib.get_close_matches(name, candidates, n=1, cutoff=0.75) for name in names}
    shown = ", ".join(repr(name) for name in names)
    verb, noun = ("is", "it") if len(names) == 1 else ("are", "they")
    text = (
        f"fact{'s' * (len(names) > 1)} {shown} {verb} read by no rule of pool {pool!r}, so {noun} would be "
        f"ignored (rule {rule} reads {', '.join(read) or 'no fact'})"
    )
    guesses = [f"{found[0]!r}" for found in matches.values() if found]
    if guesses:
        text += f"; did you mean {' and '.join(guesses)}?"
    return text


_State = TypeVar("_State")
#: Describes a device for its facts and profile; ``None`` for a device that is not a GPU.
DeviceDescriber = Callable[[torch.device], DeviceDescription | None]


class PoolRegistry:
    """Named, per-device workspace pools sized by configured rules.

    Args:
        settings: ``None`` loads ``WSPOOL_CONFIG``, the environment and the defaults.
        allocator: Makes zero-filled ``uint8`` buffers; default ``torch.zeros``.
        mem_pool: A :class:`torch.cuda.MemPool` for CUDA buffers (engine sleep and offload modes).
        describe_device: Describes a device for its facts and profile, once per device.

    ``settings`` holds the profile of devices without a description (the CPU);
    each GPU's pools use their own profile's.
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
        # lane -> pool -> device as given -> rule -> the pool instance that serves it and a handle
        # of that rule: filled on a call's first miss, once the rule is known to be the pool's own.
        self._fast: dict[str, dict[str, dict[DeviceLike, dict[str, _Served]]]] = {}
        self._views: dict[str, ProfileView] = {}
        self._devices: dict[torch.device, tuple[ProfileView, ProfileChoice, Mapping[str, int]]] = {}
        # The state objects of what is built on this registry (plan caches, an engine's views),
        # one per type: see state(). They live and die with the registry; reset() drops them.
        self._states: dict[type, object] = {}
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

    def _view(self, profile: str) -> ProfileView:
        """Return the view of ``profile``, made on first use with every earlier declaration replayed."""
        found = self._views.get(profile)
        if found is not None:
            return found
        settings = self._profile_settings[profile]
        if isinstance(settings, ConfigError):
            raise settings
        view = ProfileView(settings)
        with self._lock:
            for name, declared in self._declared.items():
                view.apply(view.stage(name, declared, self._host_in_use, replay=True))
            return self._views.setdefault(profile, view)

    def _host_in_use(self, host: str) -> bool:
        return any(key[0] == host for key in self._pools)

    def _device_entry(self, device: torch.device) -> tuple[ProfileView, ProfileChoice, Mapping[str, int]]:
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
        """Return the facts a call to ``pool`` on ``device`` gets where it gives none: configured over device facts."""
        view, _, facts = self._device_entry(resolve_device(device))
        return {**facts, **view.spec(pool).facts}

    def check_facts(
        self, pool: str, rules: Iterable[str] | None = None, *, device: DeviceLike = None, supplied: Iterable[str] = ()
    ) -> None:
        """Check at load time that ``rules`` of ``pool`` (``None``: all) resolve on ``device`` from ``supplied`` facts.

        Raises:
            ConfigError: A rule reads a fact that neither the call, the pool's
                default facts nor the device supply; the message names the setting.
        """
        view, choice, _ = self._device_entry(resolve_device(device))
        spec = view.spec(pool)
        available = set(supplied) | set(self.default_facts(pool, device))
        check_rule_facts(pool, spec, rules, available=available, profile=choice.profile)

    @classmethod
    def from_config(cls, config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> PoolRegistry:
        """Build a registry from a YAML file (``None``: ``WSPOOL_CONFIG``), the environment and ``overrides``.

        A missing file or invalid configuration raises :class:`ConfigError`; nothing is allocated.
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
        """Return the pool's whole ``uint8`` buffer on ``device`` and ``lane``, large enough for ``rule`` at ``facts``.

        ``None`` is the current device (CUDA when available), ``"cuda"`` the
        current CUDA device. The buffer stays valid until the pool grows.

        Raises:
            ConfigError: Unknown pool or rule, or the rule cannot be resolved.
            WorkspaceFrozenError: Growth needed while frozen or capturing.
            WorkspaceLimitError: Growth needed beyond ``max_bytes`` or memory.
        """
        if lane is None:
            lane = current_lane() if LANES_ENTERED[0] else DEFAULT_LANE
        if device is None:
            device = resolve_device(None)
        try:
            # Nested lookups hash only strings and devices, whose hashes are cheap; a tuple key
            # would be built and hashed on every call.
            found = self._fast[lane][pool][device][rule]
        except (KeyError, TypeError):
            found = self._serving(pool, device, lane, rule)
        if facts:
            return found.pool.workspace(rule, facts)
        buffer = found.held()  # the handle's steady state
        if buffer is not None:
            return buffer
        return found.handle.get()

    def _serving(self, pool: str, device: DeviceLike, lane: str, rule: str) -> _Served:
        """Return the pool instance that serves ``pool``'s own ``rule`` and its handle (a call's first miss).

        A device that names "the current device" is resolved on every call and its entry kept
        under the concrete device, so that a change of current device finds the right pool.
        """
        if is_dynamic(device):
            device = resolve_device(device)
            with contextlib.suppress(KeyError):
                return self._fast[lane][pool][device][rule]
        found = self.pool(pool, device, lane=lane)
        self._own_rule(pool, rule, device)
        served = _Served(found, WorkspaceHandle(lambda: self.serving_pool(pool, rule, device, lane), rule))
        self._fast.setdefault(lane, {}).setdefault(pool, {}).setdefault(device, {})[rule] = served
        return served

    def serving_pool(self, pool: str, rule: str, device: DeviceLike = None, lane: str | None = None) -> WorkspacePool:
        """Return the pool instance that serves ``pool``'s own ``rule`` on ``device`` and ``lane`` (handles bind it)."""
        found = self.pool(pool, device, lane=lane)
        self._own_rule(pool, rule, device)
        return found

    def handle(
        self,
        pool: str,
        rule: str = "default",
        *,
        device: DeviceLike = None,
        lane: str | None = None,
        call_facts: Iterable[str] = (),
        dtype: torch.dtype | None = None,
    ) -> WorkspaceHandle:
        """Bind ``pool``'s ``rule`` on one device and lane (both resolved now), for a call site that asks many times.

        The handle skips the lookup while nothing changed and binds again through
        :meth:`workspace`'s checks after growth, :meth:`reset`, a declaration or
        :func:`set_registry` (:class:`~wspool.pool.WorkspaceHandle`). A rule that reads none of
        ``call_facts`` is resolved once per binding. A handle made from the
        process-wide registry (:func:`get_registry`) serves the process-wide registry
        in force at each binding, so :func:`set_registry` moves it, freeze included;
        one made from any other registry serves that registry.
        """
        resolved = resolve_device(device)
        bound_lane = current_lane() if lane is None else lane
        self.pool(pool, resolved, lane=bound_lane)
        self._own_rule(pool, rule, resolved)
        if self is _default:

            def bind() -> WorkspacePool:
                return get_registry().serving_pool(pool, rule, resolved, bound_lane)

        else:

            def bind() -> WorkspacePool:
                return self.serving_pool(pool, rule, resolved, bound_lane)

        return WorkspaceHandle(bind, rule, call_facts=call_facts, dtype=dtype)

    def _own_rule(self, pool: str, rule: str, device: DeviceLike) -> None:
        """Raise the error naming the setting unless ``rule`` is ``pool``'s own under ``device``'s profile."""
        spec = self.spec(pool, resolve_device(device))
        if rule not in spec.rules:
            raise unknown_rule(pool, rule, spec.rules)

    def resolve(self, pool: str, rule: str = "default", *, device: DeviceLike = None, **facts: object) -> int:
        """Return the bytes a call on ``device`` would get from ``rule``, default facts filled in; allocates nothing.

        Unlike the per-call :meth:`workspace`, it checks the facts it is given once the rule
        resolved: a negative value, or a name that no rule of the pool reads and that neither
        wspool's ops, the device nor the default facts supply (a typo such as ``batchsize``),
        is refused, as the configuration's default facts are.

        Raises:
            ConfigError: Unknown pool; :class:`RuleError` for an unknown rule, such a fact, or
                a rule that cannot be resolved for these facts.
        """
        view, _, device_facts = self._device_entry(resolve_device(device))
        spec = view.spec(pool)
        compiled = spec.rules.get(rule)
        if compiled is None:
            raise unknown_rule(pool, rule, spec.rules)
        nbytes = compiled.resolve(facts, {**device_facts, **spec.facts})
        if facts:  # after the rule's own errors (a missing fact, a size out of range), which say more
            _refuse_negative_facts(spec.name, facts)
            check_given_facts(spec, rule, facts)
        return nbytes

    # -- pools -------------------------------------------------------------

    def spec(self, pool: str, device: DeviceLike = None) -> PoolSpec:
        """Return a pool's configuration under ``device``'s profile (``None``: that of :attr:`settings`)."""
        if device is not None:
            return self._device_entry(resolve_device(device))[0].spec(pool)
        return self._base.spec(pool)

    def pool(self, name: str, device: DeviceLike = None, *, lane: str | None = None) -> WorkspacePool:
        """Return (creating, without allocating) the pool for ``name`` on ``device``, ``lane``; its host's if shared."""
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
        """Declare a backend's pool with default rules, under every profile; configured values override it rule by rule.

        Declaring again is harmless while nothing changes. Once the pool (or the buffer it
        shares) is in use, its buffers keep the rules, ``max_bytes`` and ``growth`` in force:
        a declaration that would change any of them raises (declare before the first
        request, or :meth:`reset` first), so a cap is never dropped. A fixed rule that can
        never fit the cap of its buffer (its own, or the ``shared_with`` host's, however
        configured) raises, as it would in YAML. An invalid declaration raises
        :class:`ConfigError` naming the setting and changes no profile.
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
        bump_epoch()
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
        """Drop every pool instance and its buffers, statistics and state objects; unfreeze (for tests)."""
        with self._lock:
            dropped = list(self._pools.values())
            self._pools.clear()
            self._fast.clear()
            self._states.clear()
            self.freeze_state.clear()
        bump_epoch()
        for pool in dropped:
            pool.drop_handles()

    def state(self, kind: type[_State], make: Callable[[], _State] | None = None) -> _State:
        """Return this registry's one object of type ``kind`` (a plan cache, an engine's views), made on first use.

        :meth:`reset` drops it. ``make`` (default ``kind()``) runs without the lock;
        concurrent first calls keep one object.
        """
        found = self._states.get(kind)
        if found is None:
            made = make() if make is not None else kind()
            with self._lock:
                found = self._states.setdefault(kind, made)
        return found  # type: ignore[return-value]

    def peek_state(self, kind: type[_State]) -> _State | None:
        """Return this registry's object of type ``kind`` if one was made, without making it."""
        return self._states.get(kind)  # type: ignore[return-value]

    def existing_wrapper_regions(self) -> RegionsView | None:
        """Return this registry's regions for kernel wrappers' own buffers if any were made (makes none)."""
        return self.peek_state(RegionsView)  # type: ignore[type-abstract]  # the key FlashInfer's regions use

    # -- reserve, warm up, freeze, release, report --------------------------------

    def stats(self, pool: str, device: DeviceLike = None, *, lane: str | None = None) -> PoolStats:
        """Return the statistics of one pool on one device and lane (zeros if never used)."""
        return self.pool(pool, device, lane=lane).stats()

    def all_stats(self) -> list[PoolStats]:
        """Return the statistics of every pool instance, sorted by pool, device and lane."""
        return sorted((p.stats() for p in self.pools()), key=lambda s: (s.pool, s.device, s.lane))

    def memory_stats(self) -> dict[str, Any]:
        """Return what every buffer holds, per backend (:func:`wspool.memory.memory_stats`)."""
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
        """Grow a pool ahead of time to ``nbytes`` or to what ``rule`` resolves to (exactly one of them)."""
        if (nbytes is None) == (rule is None):
            raise ValueError("reserve() takes exactly one of nbytes= or rule=")
        target = self.pool(pool, device, lane=lane)
        if rule is not None:
            self._own_rule(pool, rule, device)
            return target.workspace(rule, facts)
        from wspool.units import parse_size

        return target.request(parse_size(nbytes), "reserve")

    def reserve_for(
        self,
        limits: Mapping[str, object],
        *,
        pools: Iterable[str] | None = None,
        devices: Iterable[DeviceLike] = (None,),
        lanes: Iterable[str] | None = None,
        rules: Mapping[str, Iterable[str]] | None = None,
        strict: bool = True,
    ) -> Reservation:
        """Grow each buffer of ``pools`` (``None``: every pool) to its rules' bound over ``limits``; return the plan.

        ``limits`` maps a fact to its largest value, a ``range`` or a set of values
        (:mod:`wspool.bounds`); other facts are fixed at their defaults. Each rule is
        bounded on each of ``devices`` and ``lanes`` (default: the current lane); a
        shared buffer is reserved at the largest of its rules. ``rules`` limits a
        pool to the rules named there (those the engine's calls use). :meth:`freeze` after
        it: no call within the limits grows, and a call beyond them is refused
        with the error naming the fact, its limit and where to raise it.

        Raises:
            RuleError: With ``strict``, a rule cannot be bounded (named); nothing is allocated.
            WorkspaceLimitError: A buffer cannot be allocated.
        """
        plan = plan_reservation(
            self, limits, pools=pools, devices=devices, lanes=lanes or (current_lane(),), rules=rules
        )
        if strict and plan.refusals:
            raise RuleError(str(plan.refusals[0].refusal), path=("pools", plan.refusals[0].pool))
        apply_reservation(self, plan)
        return plan

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
        """Resolve ``rule`` over every shape an engine will capture, grow once to the largest; return the capacity.

        With ``agree_group`` (a ``torch.distributed`` group) the size is agreed by
        :func:`wspool.distributed.agree`, a collective: every rank calls ``warmup``
        for the same pools in the same order and grows to the maximum.
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

    def allowing_growth(self) -> contextlib.AbstractContextManager[None]:
        """Let the calling thread or task grow this registry's pools inside the block, even while frozen.

        Captured graphs keep their buffers (a replaced one is retired); growth
        while the current stream captures is still refused.
        """
        return self.freeze_state.allowing_growth()

    @property
    def is_frozen(self) -> bool:
        """Whether growth is refused."""
        return self.freeze_state.frozen

    @contextmanager
    def frozen(self) -> Iterator[PoolRegistry]:
        """Refuse growth inside the block; blocks are counted across threads (frozen until the last one closes)."""
        token = self.freeze_state.enter()
        try:
            yield self
        finally:
            self.freeze_state.leave(token)

    def release_retired(self) -> int:
        """Free buffers kept for captured graphs, once those graphs are gone; return the bytes released."""
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


def registry_in_force() -> PoolRegistry | None:
    """Return the process-wide registry if one is built, else ``None`` (builds none)."""
    return _default


def set_registry(registry: PoolRegistry | None) -> None:
    """Replace the process-wide registry (``None``: rebuild on next use); handles bind again."""
    global _default
    with _default_lock:
        _default = registry
    bump_epoch()


def reset_registry() -> None:
    """Forget the process-wide registry; the next :func:`get_registry` reloads the configuration."""
    set_registry(None)
