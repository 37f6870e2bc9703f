"""The files wspool ships as package data: configuration examples and profiles.

They live in the package (``wspool/data/configs/*.yaml``, ``wspool/data/profiles/*.yaml``)
and are read with :mod:`importlib.resources`, so they are found the same way from a
source checkout, an editable install and a regular ``pip install``. The top-level
``configs/`` of the source tree holds the same files for users to read and copy; a
test keeps the two identical.
"""

from __future__ import annotations

import atexit
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

from wspool.errors import ConfigError

__all__ = ["shipped_config", "shipped_config_names", "shipped_text"]

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
    """Return a file-system path to the shipped configuration ``name`` (e.g. ``"hopper"``).

    Raises:
        ConfigError: There is no such shipped file.
    """
    found = _paths.get(name)
    if found is None:
        known = shipped_config_names()
        if name not in known:
            raise ConfigError(f"no shipped configuration {name!r} (shipped: {', '.join(known)})")
        entry = resources.files(_PACKAGE).joinpath("data", "configs", f"{name}.yaml")
        found = _paths[name] = Path(_files.enter_context(resources.as_file(entry)))
    return found
