"""What wspool ships as data: device profiles, configuration files, and the engines' specs.

A profile is a named set of pool settings for a kind of device, layered just
above the built-in defaults; ``profile: auto`` picks one per device. Shipped
configurations are package data, so a name works wherever a file does
(``--config hopper``). Each engine package under ``wspool.integrations`` holds
its spec as data (:class:`EngineSpec`, read from its ``engine.yaml`` without
importing it): the settings read the engines' own workspace variables
(:func:`engine_knob_layers`) and their switches from the specs, so an engine is
added by its own package alone. Pure functions; thread-safe. Tables: docs/profiles.md.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import logging
import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wspool.errors import ConfigError, quote, setting_names
from wspool.settings.sources import CONFIG_ENV_VAR, Source, config_file_from, parse_yaml, read_yaml_file
from wspool.units import parse_size

if TYPE_CHECKING:  # wspool.devices imports torch; the settings load without it
    from wspool.devices import DeviceDescription

__all__ = [
    "AUTO",
    "ENGINE_PACKAGES_FOLDER",
    "ENGINE_SPEC_FILE",
    "FALLBACK_PROFILE",
    "PROFILE_NAMES",
    "EngineSpec",
    "EngineVariable",
    "Profile",
    "ProfileChoice",
    "choose_profile",
    "engine_knob_layers",
    "engine_knob_settings",
    "engine_knobs",
    "engine_spec",
    "engine_spec_files",
    "engine_specs",
    "find_config_file",
    "load_profile",
    "shadowed_shipped_name",
    "shipped_config",
    "shipped_config_names",
    "shipped_configs_defining",
    "shipped_name_of",
    "shipped_text",
]


_log = logging.getLogger(__name__)
_PACKAGE = "wspool"
_files = ExitStack()
atexit.register(_files.close)
_paths: dict[str, Path] = {}


def shipped_text(kind: str, name: str) -> str:
    """Return the text of ``data/<kind>/<name>.yaml`` (``kind``: ``"configs"`` or ``"profiles"``)."""
    return resources.files(_PACKAGE).joinpath("data", kind, f"{name}.yaml").read_text(encoding="utf-8")


def shipped_config_names() -> list[str]:
    """Return the names of the shipped configuration files, sorted (``["blackwell", "default", ...]``)."""
    folder = resources.files(_PACKAGE).joinpath("data", "configs")
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def shipped_config(name: str) -> Path:
    """Return a file-system path to the shipped configuration ``name`` (e.g. ``"hopper"``)."""
    found = _paths.get(name)
    if found is None:
        known = shipped_config_names()
        if name not in known:
            raise ConfigError(f"no shipped configuration {name!r} (shipped: {', '.join(known)})")
        entry = resources.files(_PACKAGE).joinpath("data", "configs", f"{name}.yaml")
        found = _paths[name] = Path(_files.enter_context(resources.as_file(entry)))
    return found


def shipped_name_of(path: Path) -> str | None:
    """Return the name of the shipped configuration ``path`` is (its package data file, not a copy), else ``None``."""
    name = path.name.removesuffix(".yaml")
    if not path.name.endswith(".yaml") or name not in shipped_config_names():
        return None
    try:
        return name if path.resolve() == shipped_config(name).resolve() else None
    except (OSError, ValueError, RuntimeError):  # a path that cannot be resolved is no shipped file
        return None


def shipped_configs_defining(pool: str, rule: str | None = None) -> list[str]:
    """Return the shipped configurations that define pool ``pool`` (and its rule ``rule``, if given), sorted.

    So an error about a pool or rule that exists only in an engine's configuration can
    name the fix (``--config vllm``).
    """
    found = []
    for name in shipped_config_names():
        pools = parse_yaml(shipped_text("configs", name), f"shipped configuration {name}").get("pools") or {}
        entry = pools.get(pool)
        if isinstance(entry, Mapping) and (rule is None or rule in (entry.get("rules") or {})):
            found.append(name)
    return found


def shadowed_shipped_name(config_file: str | os.PathLike[str] | None) -> str | None:
    """Return the shipped configuration's name ``config_file`` also is, where a file of that name is read instead.

    ``--config hopper`` in a directory holding a file ``hopper`` reads that file, not the
    shipped configuration: the caller says so in one line.
    """
    raw = os.fspath(config_file) if config_file is not None else os.environ.get(CONFIG_ENV_VAR, "")
    if raw not in shipped_config_names():  # "./hopper" names the file on purpose
        return None
    try:
        return raw if Path(raw).is_file() else None
    except (OSError, ValueError):
        return None


def find_config_file(config_file: str | os.PathLike[str] | None) -> tuple[Path | None, str]:
    """Return the YAML file to read and how it was named: given in code, else by ``WSPOOL_CONFIG``.

    A path that exists is that file, else a shipped configuration's name names its file.
    """
    path, how = config_file_from(config_file)
    if path is None:
        return None, ""
    try:
        exists = path.is_file()
    except (OSError, ValueError):  # a name too long, a NUL: read_yaml names the problem
        return path, how
    if exists:
        shadowed = shadowed_shipped_name(config_file)
        if shadowed is not None:
            _log.warning(
                "configuration %r is the file %s in the working directory, not the shipped configuration %s",
                shadowed,
                path.resolve(),
                shadowed,
            )
        return path, how
    known = shipped_config_names()
    name = os.fspath(config_file) if config_file is not None else str(path)
    if name in known:
        return shipped_config(name), f"{how}: the shipped configuration {name}"
    raise ConfigError(
        f"config file {path} ({how}) does not exist or is not a file, and no shipped configuration has "
        f"that name (shipped: {', '.join(known)})"
    )


#: The profile setting that picks per device.
AUTO = "auto"
#: The shipped profiles.
PROFILE_NAMES = ("blackwell", "fixed", "hopper")
#: What auto picks for a device no profile names: vLLM's fixed sizes.
FALLBACK_PROFILE = "fixed"


@dataclass(frozen=True)
class Profile:
    """One shipped profile; ``auto`` picks it for its ``compute_capabilities``."""

    name: str
    description: str
    measured: bool
    compute_capabilities: tuple[tuple[int, int], ...]
    settings: Mapping[str, Any]


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a device got, and why."""

    profile: str
    reason: str


@cache
def load_profile(name: str) -> Profile:
    """Return the shipped profile ``name`` (one of :data:`PROFILE_NAMES`), parsed once."""
    if name not in PROFILE_NAMES:
        raise KeyError(f"no profile {name!r} (profiles: {', '.join(PROFILE_NAMES)})")
    data = parse_yaml(shipped_text("profiles", name), f"profile {name}")
    capabilities = tuple(
        (int(major), int(minor)) for major, minor in (str(cc).split(".") for cc in data["compute_capabilities"])
    )
    return Profile(
        name=name,
        description=" ".join(str(data["description"]).split()),
        measured=bool(data["measured"]),
        compute_capabilities=capabilities,
        settings=data["settings"],
    )


def choose_profile(setting: str, description: DeviceDescription | None, *, source: str = "default") -> ProfileChoice:
    """Return the profile for a device (``None``: the CPU) under the ``profile`` setting from ``source``."""
    if setting != AUTO:
        return ProfileChoice(setting, f"profile = {setting} (from {source})")
    if description is None:
        return ProfileChoice(FALLBACK_PROFILE, "auto: no GPU description (not a CUDA device); vLLM's fixed sizes")
    cc = description.compute_capability
    shown = f"compute capability {cc[0]}.{cc[1]} ({description.name})"
    for name in PROFILE_NAMES:
        if cc in load_profile(name).compute_capabilities:
            return ProfileChoice(name, f"auto: {shown} is {name}'s")
    return ProfileChoice(FALLBACK_PROFILE, f"auto: no profile was measured for {shown}; vLLM's fixed sizes")


#: The file in each engine's package that holds the engine's spec.
ENGINE_SPEC_FILE = "engine.yaml"
#: The folder of wspool's package data whose subfolders are the engine packages.
ENGINE_PACKAGES_FOLDER = "integrations"


@dataclass(frozen=True)
class EngineVariable:
    """One of an engine's own workspace variables, and the rules of wspool's that it sets.

    Attributes:
        name: The variable (``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``).
        engine: The engine that reads it (``"vLLM"``).
        keys: The ``(pool, rule)`` keys it sets: each rule sizes a buffer the engine sizes with it
            (none: the integration honours it in its own way, and the settings do not read it).
        unit_bytes: The bytes of one unit of its value (1: it counts bytes).
        unit_name: The unit's name, for errors (``"bytes"``, ``"MiB"``).
    """

    name: str
    engine: str
    keys: tuple[tuple[str, str], ...]
    unit_bytes: int = 1
    unit_name: str = "bytes"


@dataclass(frozen=True)
class EngineSpec:
    """What wspool knows of one engine, as data: its package's :data:`ENGINE_SPEC_FILE`.

    Read without importing the engine or wspool's package for it, so the settings,
    ``wspool doctor`` and the integration itself read one description.

    Attributes:
        key: The engine's package under ``wspool.integrations`` (``"vllm"``).
        name: The engine's name in messages (``"vLLM"``).
        distribution: Its distribution, whose installed version is read from metadata.
        supported: The versions wspool supports, a PEP 440 specifier set.
        order: Where ``wspool doctor`` lists it, lowest first.
        entry_point_group: The engine's plugin entry-point group.
        entry_point: wspool's entry point in that group (``module:function``).
        switch_var: wspool's variable that turns the integration off.
        device_var: wspool's variable naming the device every buffer is served on, if any.
        allowlist_var: The engine's plugin list that, when set, must name ``wspool``.
        denylist_var: The engine's plugin list that skips ``wspool`` where it names it.
        variables: The engine's own workspace variables.
        pools: The pools the integration serves (the facts it passes are all their rules may read).
        facts: The facts its extractors pass to rules beside wspool's own.
    """

    key: str
    name: str
    distribution: str
    supported: str
    order: int
    entry_point_group: str
    entry_point: str
    switch_var: str
    device_var: str | None = None
    allowlist_var: str | None = None
    denylist_var: str | None = None
    variables: tuple[EngineVariable, ...] = ()
    pools: frozenset[str] = frozenset()
    facts: frozenset[str] = frozenset()

    @property
    def engine_variables(self) -> tuple[str, ...]:
        """The names of :attr:`variables`, in the spec's order."""
        return tuple(variable.name for variable in self.variables)

    @property
    def wspool_variables(self) -> tuple[str, ...]:
        """The ``WSPOOL_*`` variables the integration reads: its switch, and its device variable if any."""
        return (self.switch_var, *((self.device_var,) if self.device_var else ()))

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


def _names(raw: str) -> list[str]:
    return [name.strip() for name in raw.split(",") if name.strip()]


@cache
def engine_specs() -> tuple[EngineSpec, ...]:
    """Return every engine's spec, in ``wspool doctor``'s order: each package's :data:`ENGINE_SPEC_FILE`.

    Read from :func:`engine_spec_files`: an engine is added by its own package alone.
    Read once per process; ``engine_specs.cache_clear()`` reads them again.

    Raises:
        ConfigError: A spec file is malformed, naming the file and the key.
    """
    found_specs: dict[str, EngineSpec] = {}
    for path in engine_spec_files():
        if path.parent.name not in found_specs:
            found_specs[path.parent.name] = _read_spec(path)
    specs = sorted(found_specs.values(), key=lambda spec: (spec.order, spec.key))
    return tuple(specs)


def engine_spec_files() -> list[Path]:
    """Return each engine package's :data:`ENGINE_SPEC_FILE`, by package name.

    The specs are package data (``<engine>/engine.yaml`` in wspool's ``integrations`` folder,
    shipped as the configuration files are) and are read as files: no engine package, nor the
    package that holds them, is imported, so the settings depend on no layer above them.
    """
    folder = resources.files(_PACKAGE).joinpath(ENGINE_PACKAGES_FOLDER)
    if not folder.is_dir():
        return []
    found = []
    for package in sorted(folder.iterdir(), key=lambda entry: entry.name):
        entry = package.joinpath(ENGINE_SPEC_FILE)
        if package.is_dir() and entry.is_file():
            found.append(Path(_files.enter_context(resources.as_file(entry))))
    return found


def engine_spec(key: str) -> EngineSpec:
    """Return the spec of engine ``key`` (its package's name).

    Raises:
        KeyError: No engine package of that name has a spec.
    """
    for spec in engine_specs():
        if spec.key == key:
            return spec
    raise KeyError(f"no wspool integration for {key!r} (known: {', '.join(s.key for s in engine_specs())})")


def engine_knobs() -> tuple[EngineVariable, ...]:
    """Return the engines' own workspace variables that set rules of wspool's, in :func:`engine_specs`' order."""
    return tuple(variable for spec in engine_specs() for variable in spec.variables if variable.keys)


_SPEC_TEXT = ("name", "distribution", "supported", "switch")
_SPEC_OPTIONAL = ("device", "allowlist", "denylist")
_SPEC_KEYS = frozenset((*_SPEC_TEXT, *_SPEC_OPTIONAL, "order", "entry_point", "variables", "pools", "facts"))


def _read_spec(path: Path) -> EngineSpec:
    """Read one engine spec file; the engine's key is its package's name."""
    data = read_yaml_file(path, what="engine spec")

    def bad(key: str, expected: str) -> ConfigError:
        return ConfigError(f"engine spec {path}: {key} must be {expected}")

    def text(node: Any, key: str) -> str:
        if not isinstance(node, str) or not node.strip():
            raise bad(key, "a non-empty string")
        return node.strip()

    def names(key: str) -> frozenset[str]:
        found = data.get(key, [])
        if not isinstance(found, list):
            raise bad(key, "a list of names")
        return frozenset(text(name, key) for name in found)

    if not isinstance(data, dict):
        raise ConfigError(f"engine spec {path} must hold a mapping")
    unknown = sorted(str(key) for key in data if key not in _SPEC_KEYS)
    if unknown:
        keys = ", ".join(sorted(_SPEC_KEYS))
        raise ConfigError(f"engine spec {path}: unknown key {unknown[0]!r} (the keys are {keys})")
    given = {key: text(data.get(key), key) for key in _SPEC_TEXT}
    optional = {key: text(data[key], key) if data.get(key) is not None else None for key in _SPEC_OPTIONAL}
    entry = data.get("entry_point")
    if not isinstance(entry, dict) or set(entry) != {"group", "object"}:
        raise bad("entry_point", "a mapping of group and object")
    order = data.get("order")
    if isinstance(order, bool) or not isinstance(order, int):
        raise bad("order", "a whole number")
    variables = data.get("variables") or {}
    if not isinstance(variables, dict):
        raise bad("variables", "a mapping of each variable to its unit and the rules it sizes")
    spec = EngineSpec(
        key=path.parent.name,
        name=given["name"],
        distribution=given["distribution"],
        supported=given["supported"],
        order=order,
        entry_point_group=text(entry["group"], "entry_point.group"),
        entry_point=text(entry["object"], "entry_point.object"),
        switch_var=given["switch"],
        device_var=optional["device"],
        allowlist_var=optional["allowlist"],
        denylist_var=optional["denylist"],
        variables=tuple(_read_variable(path, given["name"], text(n, "variables"), v) for n, v in variables.items()),
        pools=names("pools"),
        facts=names("facts"),
    )
    for variable in spec.variables:
        for pool, rule in variable.keys:
            if pool not in spec.pools:
                raise ConfigError(
                    f"engine spec {path}: variables.{variable.name}.sizes names {pool}.{rule}, but {pool!r} is not "
                    f"one of the pools it serves (pools: {', '.join(sorted(spec.pools))})"
                )
    return spec


def _read_variable(path: Path, engine: str, name: str, node: Any) -> EngineVariable:
    where = f"engine spec {path}: variables.{name}"
    if not isinstance(node, dict) or set(node) != {"unit", "sizes"} or not isinstance(node["sizes"], list):
        raise ConfigError(f"{where} must be a mapping of unit (bytes, MiB...) and sizes (a list of pool.rule)")
    unit = str(node["unit"])
    try:
        unit_bytes = 1 if unit == "bytes" else parse_size(f"1{unit}")
    except ValueError:
        raise ConfigError(f"{where}.unit = {quote(unit)} is not bytes or a size unit (KiB, MiB...)") from None
    keys = [str(key).split(".") for key in node["sizes"]]
    if any(len(key) != 2 or not all(key) for key in keys):
        raise ConfigError(f"{where}.sizes must list the keys it sets, each pool.rule (empty: it sets none)")
    return EngineVariable(name, engine, tuple((pool, rule) for pool, rule in keys), unit_bytes, unit)


def engine_knob_layers(environ: Mapping[str, str] | None = None) -> list[Source]:
    """Return a :class:`Source` of kind ``engine`` for each engine variable that is set.

    Args:
        environ: The environment to read; default ``os.environ``.

    Raises:
        ConfigError: A variable is set to something other than a positive whole number of bytes.
    """
    environ = os.environ if environ is None else environ
    layers = []
    for knob in engine_knobs():
        raw = environ.get(knob.name, "").strip()
        if not raw:
            continue
        try:
            nbytes = int(raw, 10) * knob.unit_bytes
        except ValueError:
            nbytes = 0
        if nbytes <= 0:
            names = ", ".join(setting_names(("pools", pool, "rules", rule))[0] for pool, rule in knob.keys)
            raise ConfigError(
                f"invalid environment variable {knob.name} = {raw[:80]!r}: {knob.engine} reads it as a positive "
                f"whole number of {knob.unit_name}, and wspool sizes {names} with it; fix or unset it (a rule for "
                f"those keys in your YAML file or a WSPOOL_* variable takes precedence over it)"
            )
        data: dict[str, Any] = {"pools": {}}
        for pool, rule in knob.keys:
            data["pools"].setdefault(pool, {"rules": {}})["rules"][rule] = nbytes
        layers.append(Source("engine", data, name=knob.name, engine=knob.engine))
    return layers


def engine_knob_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the settings of every engine variable that is set, merged (they set no key in common)."""
    merged: dict[str, Any] = {"pools": {}}
    for layer in engine_knob_layers(environ):
        for pool, config in layer.data["pools"].items():
            merged["pools"].setdefault(pool, {"rules": {}})["rules"].update(config["rules"])
    return merged if merged["pools"] else {}
