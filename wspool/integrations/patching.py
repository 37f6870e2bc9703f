"""The one seam where an engine embeds wspool: declared engines, their switch, and load/unload.

An integration is its engine's spec (:class:`~wspool.settings.profiles.EngineSpec`,
data in its package's ``engine.yaml``) and an :class:`Integration` subclass
declaring its target groups as data (:mod:`wspool.targets`).
:meth:`Integration.load`, the plugin entry point, never raises: it runs
:meth:`Integration.preflight` (the switch, the engine's plugin selection, its
version, wspool's configuration and the engine's own checks), then locates
every target and patches groups all or nothing; whatever stops it leaves the
engine untouched and says why in one line. ``wspool doctor`` gives the same
preflight's verdict, so the two cannot disagree. Load and unload take the
patch set's lock for the attribute writes only; call them at start-up, before
serving. Nothing here imports torch or an engine at import.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from wspool.errors import ConfigError, RuleError, missing_facts, quote
from wspool.settings.profiles import EngineSpec
from wspool.targets import PartialUndoError, PatchPlan, PatchSet, TargetGroup

if TYPE_CHECKING:
    import torch

    from wspool.pool import WorkspaceHandle
    from wspool.registry import PoolRegistry

__all__ = [
    "Handles",
    "Integration",
    "Preflight",
    "Refusal",
    "Reporter",
    "SaidOnce",
    "Workspace",
    "declared_rules",
    "describe_config",
    "device_variable",
    "entry_points",
    "marked",
    "missing_workspace_facts",
    "parse_switch",
    "replacing",
    "require_own_buffers",
]

_Wrapper = TypeVar("_Wrapper", bound=Callable[..., Any])

_ON = ("", "1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def parse_switch(var: str, environ: Mapping[str, str] | None = None) -> bool:
    """Return whether the switch variable ``var`` (1/true/on/yes, 0/false/off/no; unset: on) leaves wspool on."""
    raw = (os.environ if environ is None else environ).get(var, "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ConfigError(
        f"invalid environment variable {var} = {raw[:80]!r}: expected 1 or 0 (true/false, on/off, yes/no); "
        f"unset it to keep wspool on"
    )


def device_variable(var: str, environ: Mapping[str, str] | None = None) -> torch.device | None:
    """Return the device the variable ``var`` names (``cpu``, ``cuda:1``), or ``None`` where it is unset.

    Parses only: no CUDA context is made.

    Raises:
        ConfigError: It names no device.
    """
    raw = (os.environ if environ is None else environ).get(var, "").strip()
    if not raw:
        return None
    import torch

    try:
        return torch.device(raw)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"invalid environment variable {var} = {raw[:80]!r}: not a device (cpu, cuda, cuda:1...); "
            f"set a device or unset it"
        ) from None


def describe_config(environ: Mapping[str, str] | None = None) -> str:
    """Return how the active configuration was named, for one log line: a file, a shipped name, or defaults."""
    from wspool.settings.profiles import shipped_config_names

    named = (os.environ if environ is None else environ).get("WSPOOL_CONFIG", "")
    if not named:
        return "config: built-in defaults"
    if not os.path.isfile(named) and named in shipped_config_names():
        return f"config {named} (shipped)"
    return f"config {named}"


@dataclass(frozen=True)
class Workspace:
    """One of an engine's workspaces and the pool rule that serves it: what an integration declares.

    Attributes:
        name: The engine's name for it (``get_buffer``'s, a module global's...), for log lines.
        pool: The wspool pool.
        rule: The pool's rule that sizes it.
        own_buffer: The engine zeroes it because a kernel keeps semaphores, counters or
            state in it between launches, so its pool never shares a buffer (:func:`require_own_buffers`).
        variable: The engine's variable that sizes it, if any.
        deterministic_rule: The rule used instead while the engine's deterministic
            inference is on (the engine then overwrites its size), if any.
    """

    name: str
    pool: str
    rule: str
    own_buffer: bool = False
    variable: str | None = None
    deterministic_rule: str | None = None

    @property
    def setting(self) -> str:
        """The rule's YAML key."""
        return f"pools.{self.pool}.rules.{self.rule}"


def missing_workspace_facts(
    exc: RuleError, engine: str, w: Workspace, known: Mapping[str, int], fact_names: Sequence[str], docs: str
) -> RuleError:
    """The error for ``w``'s rule reading a fact the ``engine`` integration does not pass (it passes ``fact_names``)."""
    return missing_facts(exc, f"for {engine}'s {w.name} the integration", known, fact_names, docs)


def declared_rules(rules: Iterable[tuple[str, str]], size: str) -> Mapping[str, Mapping[str, str]]:
    """Return the rules an engine declares: each ``(pool, rule)`` sized by ``size``, what the engine allocates."""
    pools: dict[str, dict[str, str]] = {}
    for pool, rule in rules:
        pools.setdefault(pool, {})[rule] = size
    return MappingProxyType(pools)


def replacing(replacement: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A target's ``make`` that puts ``replacement`` in the original's place."""

    def make(_original: Callable[..., Any]) -> Callable[..., Any]:
        return replacement

    return make


def marked(wrapper: _Wrapper, original: Callable[..., Any]) -> _Wrapper:
    """Return ``wrapper`` marked as wspool's (``__wspool__``) around ``original`` (``__wrapped__``, its docstring)."""
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__doc__ = original.__doc__
    wrapper.__wspool__ = True  # type: ignore[attr-defined]
    return wrapper


def require_own_buffers(registry: PoolRegistry, why: Mapping[str, str], *, nor_hosts: bool = False) -> None:
    """Refuse a configuration in which a pool of ``why`` draws from another pool's buffer.

    Args:
        registry: The registry whose configuration is checked.
        why: Each pool that needs a buffer of its own, and why (what the engine's kernels keep there).
        nor_hosts: Also refuse another pool drawing from one of these pools' buffers.

    Raises:
        ConfigError: Naming the pool, the pool that would overwrite it and the ``shared_with`` key to empty.
    """
    for pool, reason in why.items():
        host = registry.buffer_pool(pool)
        fix = pool
        if host == pool and nor_hosts:
            fix = min(
                (p for p in registry.settings.pools if p != pool and registry.buffer_pool(p) == pool), default=pool
            )
            host = fix
        if host != pool:
            raise ConfigError(
                f"pool {pool!r} must have its own buffer: {reason}, which pool {host!r} would overwrite; set "
                f"pools.{fix}.shared_with / WSPOOL_POOLS__{fix.upper()}__SHARED_WITH empty",
                path=("pools", fix, "shared_with"),
            )


class Handles:
    """Per registry (:meth:`~wspool.PoolRegistry.state`): the engines' bound handles, one per pool, rule, device,
    lane and dtype, made by :meth:`~wspool.PoolRegistry.handle` on first use.

    Thread semantics: two threads asking at once may both make a handle; both get the one kept.
    """

    def __init__(self, registry: PoolRegistry) -> None:
        self.registry = registry
        self._handles: dict[tuple[Any, ...], WorkspaceHandle] = {}

    @classmethod
    def of(cls, registry: PoolRegistry) -> Handles:
        """Return ``registry``'s."""
        return registry.state(cls, lambda: cls(registry))

    def get(
        self, pool: str, rule: str, device: Any, lane: str, dtype: torch.dtype | None = None, *, call_facts: Any = ()
    ) -> WorkspaceHandle:
        """Return the handle of ``pool``'s ``rule`` on ``device`` and ``lane``, as ``dtype``, reading ``call_facts``."""
        key = (pool, rule, device, lane, dtype)
        found = self._handles.get(key)
        if found is None:
            made = self.registry.handle(pool, rule, device=device, lane=lane, call_facts=call_facts, dtype=dtype)
            found = self._handles.setdefault(key, made)
        return found

    def serve(
        self,
        w: Workspace,
        rule: str,
        device: Any,
        lane: str,
        facts: Mapping[str, int],
        *,
        engine: str,
        fact_names: Sequence[str],
        docs: str,
        dtype: torch.dtype | None = None,
        call_facts: Any = (),
    ) -> tuple[WorkspaceHandle, torch.Tensor, torch.Tensor | None]:
        """Serve ``w`` sized by ``rule`` for ``facts``: return its handle, the view, and the pool's buffer before.

        The buffer before is what the caller compares to say once what it serves
        where the pool made or grew its buffer. On ``device`` and ``lane``, as ``dtype``.

        Raises:
            RuleError: The rule reads a fact ``facts`` lacks, naming ``engine``'s integration as what
                passes ``fact_names`` and pointing to ``docs``.
        """
        handle = self.get(w.pool, rule, device, lane, dtype, call_facts=call_facts)
        held = handle.pool.buffer
        try:
            view = handle.sized(facts)
        except RuleError as exc:
            raise missing_workspace_facts(exc, engine, w, facts, fact_names, docs) from exc
        return handle, view, held


class SaidOnce:
    """What the integrations said once in one registry (:meth:`~wspool.PoolRegistry.state` keeps it).

    Keys start with the engine's name, so an engine that unloads forgets its own
    (:meth:`forget`) and a new load says them again. Thread semantics: two threads
    may both say a key at the same instant (no lock: logging never runs under one).
    """

    def __init__(self) -> None:
        self._said: set[tuple[Any, ...]] = set()

    @classmethod
    def of(cls, registry: PoolRegistry | None = None) -> SaidOnce:
        """Return ``registry``'s (default: the registry in force)."""
        if registry is None:
            from wspool.registry import get_registry

            registry = get_registry()
        return registry.state(cls)

    def first(self, *key: Any) -> bool:
        """Return whether ``key`` is new here, remembering it."""
        if key in self._said:
            return False
        self._said.add(key)
        return True

    def say(self, logger: logging.Logger, key: tuple[Any, ...], level: int, message: str, *args: object) -> None:
        """Log ``message % args`` at ``level`` the first time ``key`` is said here."""
        if self.first(*key):
            logger.log(level, message, *args)

    @classmethod
    def forget(cls, engine: str) -> None:
        """Forget what ``engine`` said in the registry in force (keys starting with its name); builds no registry."""
        from wspool.registry import registry_in_force

        registry = registry_in_force()
        said = None if registry is None else registry.peek_state(cls)
        if said is not None:
            said._said = {key for key in said._said if key[:1] != (engine,)}


#: An engine's undo registry: ``report(kind, name, undo)`` for each change wspool makes.
Reporter = Callable[[str, str, Callable[[], None]], None]


@dataclass(frozen=True)
class Refusal:
    """One reason :meth:`Integration.load` patches nothing, as :meth:`Integration.preflight` found it.

    ``kind`` is ``"switch"``, ``"selection"`` (the engine's allowlist or denylist),
    ``"version"`` or ``"config"`` (wspool's configuration or the engine's own checks).
    ``reason`` says it in a few words; ``problem`` is the mistake with its fix
    (``None`` where the refusal is the user's own choice, a switch at 0 or a
    denylist naming wspool, or the engine is not installed); ``cause`` is the
    error a ``"switch"`` or ``"config"`` refusal comes from.
    """

    kind: str
    reason: str
    problem: str | None = None
    cause: str = ""


@dataclass(frozen=True)
class Preflight:
    """What :meth:`Integration.preflight` found: the installed version and every refusal (none: load patches)."""

    version: str | None
    refusals: tuple[Refusal, ...]
    #: How the configuration read, for the load line (empty where it was not read).
    described: str = ""

    @property
    def cleared(self) -> bool:
        """Whether nothing refuses: :meth:`Integration.load` goes on to locate and patch the targets."""
        return not self.refusals


class Integration:
    """One engine's integration: its targets as data over one patch set; load, unload, report.

    Subclasses set :attr:`info` (their engine's spec) and :attr:`all_or_nothing`, implement
    :meth:`groups`, and override :meth:`check`, :meth:`activate` and :meth:`deactivate` as needed.
    """

    info: EngineSpec
    #: A group that cannot be patched leaves the whole engine untouched.
    all_or_nothing = False
    #: The engine's pools for one registry: ``pools.of(registry)`` declares and checks them (``None``: none).
    pools: Any = None

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.patches = PatchSet(all_or_nothing=self.all_or_nothing)

    # -- what a subclass declares -----------------------------------------------

    def groups(self) -> tuple[TargetGroup, ...]:
        """Return the target groups, in the order they are patched."""
        raise NotImplementedError

    def check(self, registry: PoolRegistry, environ: Mapping[str, str]) -> str:
        """Check the configuration for this engine in ``registry`` (declaring its pools there) and its own variables.

        Part of :meth:`preflight`; changes nothing of the engine. Return how the
        configuration read, for the load line.

        Raises:
            ConfigError: What keeps the integration from serving the engine, naming the setting to change.
        """
        if self.info.device_var is not None:  # names the device every buffer is served on (tests: cpu)
            device_variable(self.info.device_var, environ)
        if self.pools is None:
            return describe_config(environ)
        self.pools.of(registry)
        return f"{describe_config(environ)}; profile {registry.settings.profile}"

    def activate(self) -> list[str]:
        """Point the replacements at the engine's runtime (called before patching); return what is missing."""
        return []

    def deactivate(self) -> None:
        """Forget what :meth:`activate` learned (after an undo)."""

    def reporter(self) -> Reporter | None:
        """Return the engine's undo registry :meth:`load` reports each change to, if it has one."""
        return None

    # -- the lifecycle ----------------------------------------------------------

    def preflight(
        self, environ: Mapping[str, str] | None = None, registry: Callable[[], PoolRegistry] | None = None
    ) -> Preflight:
        """Decide whether :meth:`load` patches, changing nothing of the engine (``wspool doctor`` shows this verdict).

        Reads the switch and the engine's plugin selection, then (unless the
        switch is off) the configuration and the engine's own checks
        (:meth:`check`), then the installed engine's version. Every refusal is
        listed, in that order. Imports no engine; a command or start-up step,
        not thread-safe.

        Args:
            environ: The environment (default ``os.environ``).
            registry: Returns the registry the configuration is checked in (default
                :func:`~wspool.get_registry`); may raise :class:`ConfigError`.
        """
        env = os.environ if environ is None else environ
        info, name = self.info, self.info.name
        refusals: list[Refusal] = []
        on = False
        try:
            on = parse_switch(info.switch_var, env)
        except ConfigError as exc:
            reason = f"{info.switch_var} = {quote(env.get(info.switch_var))} is not understood"
            refusals.append(Refusal("switch", reason, str(exc), str(exc)))
        else:
            if not on:
                refusals.append(Refusal("switch", f"{info.switch_var}={env.get(info.switch_var)} turns it off"))
        excluded = info.selection(env)
        if excluded:
            allowlist = info.allowlist_var is not None and info.allowlist_var in excluded
            fix = f"{excluded}: {name} will not load wspool's plugin; add wspool to {info.allowlist_var} or unset it"
            refusals.append(Refusal("selection", excluded, fix if allowlist else None))
        version = info.installed_version()
        described = ""
        if on:
            try:
                if registry is None:
                    from wspool.registry import get_registry

                    registry = get_registry
                described = self.check(registry(), env)
            except ConfigError as exc:
                stays = f"{name}: its plugin patches nothing, {name}'s own workspaces stay in use"
                refusals.append(Refusal("config", "wspool's configuration is refused", f"{stays}: {exc}", str(exc)))
        if version is None:
            refusals.append(Refusal("version", f"{name} is not installed"))
        elif not info.supports(version):
            refusals.append(
                Refusal(
                    "version",
                    f"{name} {version} is not a version wspool supports ({info.supported})",
                    f"{name} {version} is installed, but wspool supports {info.supported}: its plugin patches "
                    f"nothing; install a supported {name}, or set {info.switch_var}=0",
                )
            )
        return Preflight(version, tuple(refusals), described)

    def load(self, reporter: Reporter | None = None) -> bool:
        """Apply wspool to the engine (its plugin entry point), idempotently; never raises. Return whether active.

        Patches nothing where :meth:`preflight` refuses, saying its first refusal in one line.
        """
        name = self.info.name
        if self.patches:
            self.logger.debug("wspool: the %s integration is already loaded", name)
            return True
        try:
            verdict = self.preflight()
            if not verdict.cleared:
                self._say_refused(verdict)
                return False
            plan = self.patches.plan(self.groups())
            return self._apply(plan, f"{name} {verdict.version}", verdict.described, reporter)
        except PartialUndoError as exc:
            self.logger.error("wspool: the %s integration failed to load: %s", name, exc, exc_info=exc.__cause__)
        except Exception:  # never break the engine's start-up: nothing stays patched
            self.logger.exception(
                "wspool: the %s integration failed to load and patched nothing; %s's own workspaces stay in use",
                name, name,
            )  # fmt: skip
        return False

    def _say_refused(self, verdict: Preflight) -> None:
        """Log the first refusal in one line: at info for the user's own choice, else at warning or error."""
        info, first = self.info, verdict.refusals[0]
        stays = f"{info.name}'s own workspaces stay in use"
        if first.cause:
            self.logger.error("wspool: %s: nothing patched, %s: %s", info.name, stays, first.cause)
        elif first.kind == "version":
            found = "is not installed" if verdict.version is None else f"{verdict.version} is not supported"
            self.logger.warning(
                "wspool: %s %s (wspool supports %s); nothing patched, %s", info.name, found, info.supported, stays
            )
        elif first.kind == "switch":
            self.logger.info("wspool: %s=%s: %s", info.switch_var, os.environ.get(info.switch_var), stays)
        elif first.problem is None:  # the engine's denylist names wspool: the user's choice
            self.logger.info("wspool: %s: %s", first.reason, stays)
        else:
            self.logger.warning("wspool: %s: nothing patched, %s", first.reason, stays)

    def _apply(self, plan: PatchPlan, engine: str, described: str, reporter: Reporter | None) -> bool:
        if not plan.located:
            self.logger.warning(
                "wspool: %s: nothing patched, its own workspaces stay in use; wspool does not know this version: %s",
                engine, "; ".join(plan.not_patched),
            )  # fmt: skip
            return False
        missing = self.activate()
        try:
            applied = self.patches.apply(plan)
        except BaseException:
            if not self.patches:
                self.deactivate()
            raise
        if reporter is not None:
            for patch in applied:
                reporter("wspool", patch.name, self._undo_one(patch.name))
        self.logger.info("wspool: %s: %d targets patched; %s", engine, len(applied), described)
        for target, _ in plan.located:
            self.logger.debug("wspool: %s: %s -> %s", engine, target.name, target.what)
        if plan.absent:
            self.logger.debug("wspool: %s: not in this version, so not patched: %s", engine, "; ".join(plan.absent))
        if plan.not_patched or missing:
            self.logger.warning(
                "wspool: %s: not patched: %s",
                engine, "; ".join([*(f"{what}; {self.info.name}'s own behaviour stays" for what in plan.not_patched),
                                   *missing]),
            )  # fmt: skip
        return True

    def _undo_one(self, _name: str) -> Callable[[], None]:
        def undo() -> None:
            # The engine undoes plugins whole: the first report's undo takes every patch back.
            if self.patches:
                self.unload()

        return undo

    def unload(self) -> list[str]:
        """Put the engine's originals back (for tests and the engine's undo); return the names restored.

        Also forgets what the engine said once (:class:`SaidOnce`), so a new load says it again.
        """
        restored = self.patches.undo()
        self.deactivate()
        SaidOnce.forget(self.info.name)
        return restored

    def patched(self) -> list[str]:
        """Return the dotted names of the engine attributes wspool replaced in this process."""
        return self.patches.names()

    def state(self) -> dict[str, Any]:
        """Return what ``wspool doctor`` shows of this integration in this process (JSON-able)."""
        return {"engine": self.info.key, "patched": self.patched()}


def entry_points(
    integration: Integration,
) -> tuple[Callable[[], None], Callable[[], list[str]], Callable[[], list[str]]]:
    """Return an engine package's ``register`` (its plugin entry point), ``unregister`` and ``patched``."""
    name = integration.info.name

    def register() -> None:
        integration.load(integration.reporter())

    def unregister() -> list[str]:
        return integration.unload()

    def patched() -> list[str]:
        return integration.patched()

    register.__doc__ = (
        f"Install wspool's workspaces into {name} (the {integration.info.entry_point_group} entry point); never "
        f"raises.\n\nIdempotent. Reads the switch, wspool's configuration and {name}'s version, then patches "
        "(:meth:`Integration.load`); logs one line."
    )
    unregister.__doc__ = f"Put {name}'s originals back (for tests); return the names restored."
    patched.__doc__ = f"Return the names of the {name} attributes wspool replaced in this process."
    return register, unregister, patched
