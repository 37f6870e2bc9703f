"""Device profiles and the shipped configuration files.

A profile is a named set of pool settings for a kind of device, layered just
above the built-in defaults; ``profile: auto`` picks one per device. Shipped
configurations are package data, so a name works wherever a file does
(``--config hopper``). Pure functions; thread-safe. Tables: docs/profiles.md.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wspool.errors import ConfigError
from wspool.settings.sources import CONFIG_ENV_VAR, config_file_from, parse_yaml

if TYPE_CHECKING:  # wspool.devices imports torch; the settings load without it
    from wspool.devices import DeviceDescription

__all__ = [
    "AUTO",
    "FALLBACK_PROFILE",
    "PROFILE_NAMES",
    "Profile",
    "ProfileChoice",
    "choose_profile",
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
