"""The one seam where an engine embeds wspool: declared engines, their switch, and load/unload.

An integration is an :class:`EngineInfo` and an :class:`Integration` subclass
declaring its target groups as data (:mod:`wspool.targets`).
:meth:`Integration.load`, the plugin entry point, never raises: it reads the
switch, validates the configuration and the engine version, locates every
target and patches groups all or nothing; whatever stops it leaves the engine
untouched and says why in one line. Load and unload take the patch set's lock
for the attribute writes only; call them at start-up, before serving. Nothing
here imports torch or an engine at import.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from wspool.errors import ConfigError
from wspool.targets import PartialUndoError, PatchPlan, PatchSet, TargetGroup

__all__ = ["EngineInfo", "Integration", "Reporter", "describe_config", "parse_switch"]

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


def _names(raw: str) -> list[str]:
    return [name.strip() for name in raw.split(",") if name.strip()]


@dataclass(frozen=True)
class EngineInfo:
    """What wspool knows of one engine, readable without importing it.

    ``key`` is the package under ``wspool.integrations``; ``supported`` a PEP 440
    specifier set; ``allowlist_var``, when set, must name ``wspool``.
    """

    key: str
    name: str
    distribution: str
    supported: str
    entry_point_group: str
    entry_point: str
    switch_var: str
    allowlist_var: str | None = None
    denylist_var: str | None = None
    engine_variables: tuple[str, ...] = ()

    def installed_version(self) -> str | None:
        """Return the installed engine's version from its metadata (never imports it), or ``None``."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def supports(self, version: str) -> bool:
        """Whether wspool supports ``version`` of the engine (pre-releases of a supported version count).

        A pre-release or development release (``0.5.23rc0``, ``0.34.0.dev3``) is
        judged by the release it precedes, which a lower bound such as ``>=0.5.23``
        admits; a local label (``+cu130``) is ignored.
        """
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            parsed = Version(version)
        except InvalidVersion:
            return False
        release = Version(parsed.base_version) if parsed.is_prerelease else parsed
        return release in SpecifierSet(self.supported, prereleases=True)

    def selection(self, environ: Mapping[str, str] | None = None) -> str | None:
        """Return why the engine's own plugin variables keep wspool from loading, or ``None``."""
        env = os.environ if environ is None else environ
        if self.allowlist_var and env.get(self.allowlist_var) is not None:
            allowed = _names(env[self.allowlist_var])
            if "wspool" not in allowed:
                return f"{self.allowlist_var}={env[self.allowlist_var]!r} does not name wspool"
        if self.denylist_var and "wspool" in _names(env.get(self.denylist_var, "")):
            return f"{self.denylist_var}={env[self.denylist_var]!r} names wspool"
        return None


def describe_config(environ: Mapping[str, str] | None = None) -> str:
    """Return how the active configuration was named, for one log line: a file, a shipped name, or defaults."""
    from wspool.settings.profiles import shipped_config_names

    named = (os.environ if environ is None else environ).get("WSPOOL_CONFIG", "")
    if not named:
        return "config: built-in defaults"
    if not os.path.isfile(named) and named in shipped_config_names():
        return f"config {named} (shipped)"
    return f"config {named}"


#: An engine's undo registry: ``report(kind, name, undo)`` for each change wspool makes.
Reporter = Callable[[str, str, Callable[[], None]], None]


class Integration:
    """One engine's integration: its targets as data over one patch set; load, unload, report.

    Subclasses set :attr:`info` and :attr:`all_or_nothing`, implement :meth:`groups`,
    and override :meth:`prepare`, :meth:`activate` and :meth:`deactivate` as needed.
    """

    info: EngineInfo
    #: A group that cannot be patched leaves the whole engine untouched.
    all_or_nothing = False

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.patches = PatchSet(all_or_nothing=self.all_or_nothing)

    # -- what a subclass declares -----------------------------------------------

    def groups(self) -> tuple[TargetGroup, ...]:
        """Return the target groups, in the order they are patched."""
        raise NotImplementedError

    def prepare(self) -> str:
        """Load and check wspool's configuration for this engine; return how it read, for the load line."""
        return describe_config()

    def activate(self) -> list[str]:
        """Point the replacements at the engine's runtime (called before patching); return what is missing."""
        return []

    def deactivate(self) -> None:
        """Forget what :meth:`activate` learned (after an undo)."""

    # -- the lifecycle ----------------------------------------------------------

    def load(self, reporter: Reporter | None = None) -> bool:
        """Apply wspool to the engine (its plugin entry point), idempotently; never raises. Return whether active."""
        name = self.info.name
        if self.patches:
            self.logger.debug("wspool: the %s integration is already loaded", name)
            return True
        try:
            if not parse_switch(self.info.switch_var):
                self.logger.info("wspool: %s=0: %s's own workspaces stay in use", self.info.switch_var, name)
                return False
            described = self.prepare()
            version = self.info.installed_version()
            if version is None or not self.info.supports(version):
                found = "is not installed" if version is None else f"{version} is not supported"
                self.logger.warning(
                    "wspool: %s %s (wspool supports %s); nothing patched, %s's own workspaces stay in use",
                    name, found, self.info.supported, name,
                )  # fmt: skip
                return False
            plan = self.patches.plan(self.groups())
            return self._apply(plan, f"{name} {version}", described, reporter)
        except ConfigError as exc:
            self.logger.error("wspool: %s: nothing patched, %s's own workspaces stay in use: %s", name, name, exc)
        except PartialUndoError as exc:
            self.logger.error("wspool: the %s integration failed to load: %s", name, exc, exc_info=exc.__cause__)
        except Exception:  # never break the engine's start-up: nothing stays patched
            self.logger.exception(
                "wspool: the %s integration failed to load and patched nothing; %s's own workspaces stay in use",
                name, name,
            )  # fmt: skip
        return False

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
        """Put the engine's originals back (for tests and the engine's undo); return the names restored."""
        restored = self.patches.undo()
        self.deactivate()
        return restored

    def patched(self) -> list[str]:
        """Return the dotted names of the engine attributes wspool replaced in this process."""
        return self.patches.names()

    def state(self) -> dict[str, Any]:
        """Return what ``wspool doctor`` shows of this integration in this process (JSON-able)."""
        return {"engine": self.info.key, "patched": self.patched()}
