"""Reading the YAML file, hardened: the safe loader, bounds on size, values and depth, no duplicate keys.

Whatever the file holds, reading it raises nothing but
:class:`~wspool.errors.ConfigError`, naming the file, line and column.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from wspool.errors import ConfigError
from wspool.settings.forensics import quote
from wspool.units import format_size

__all__ = [
    "CONFIG_ENV_VAR",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_FILE_BYTES",
    "MAX_CONFIG_VALUES",
    "config_file_from",
    "read_yaml",
]

#: The variable that names the YAML file.
CONFIG_ENV_VAR = "WSPOOL_CONFIG"
#: The largest YAML file read; a real configuration is a few hundred bytes. The bound keeps
#: parsing with pure-Python PyYAML well under a second.
MAX_CONFIG_FILE_BYTES = 64 << 10
#: The most values (mappings, lists and scalars) a file may hold once its aliases are expanded.
MAX_CONFIG_VALUES = 10_000
#: The deepest nesting a file may have; the schema itself is four levels deep.
MAX_CONFIG_DEPTH = 32


def config_file_from(config_file: str | os.PathLike[str] | None) -> tuple[Path | None, str]:
    """Return the YAML file to read (given, else named by ``WSPOOL_CONFIG``) and how it was named."""
    if config_file is not None:
        return Path(config_file), "given explicitly"
    named = os.environ.get(CONFIG_ENV_VAR)
    if named:
        return Path(named), f"named by {CONFIG_ENV_VAR}"
    return None, ""


def read_yaml(path: Path, how: str, keys: Iterable[str]) -> dict[str, Any]:
    """Read ``path`` with the strict safe loader and check its bounds.

    ``keys`` are the top-level settings, named in the error for a key that is not a string.

    Raises:
        ConfigError: The file is missing, unreadable, malformed or over a bound.
    """
    try:
        is_file = path.is_file()
    except (OSError, ValueError) as exc:  # a name too long, a directory that cannot be searched, a NUL
        why = getattr(exc, "strerror", None) or type(exc).__name__  # not str(exc): it repeats the whole path
        raise ConfigError(f"cannot read config file {quote(str(path))} ({how}): {why}") from None
    if not is_file:
        raise ConfigError(f"config file {path} ({how}) does not exist or is not a file")
    try:
        with path.open(encoding="utf-8") as handle:
            text = handle.read(MAX_CONFIG_FILE_BYTES + 1)
        if len(text) > MAX_CONFIG_FILE_BYTES:
            raise ConfigError(
                f"config file {path} ({how}) is larger than {format_size(MAX_CONFIG_FILE_BYTES)}; "
                f"a wspool configuration is a few hundred bytes"
            )
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"invalid YAML in config file {where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"invalid YAML in config file {path}: it nests too deeply") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path} ({how}): {exc}") from None
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        # PyYAML's constructors raise these for tagged or date-like scalars they cannot build
        # (!!timestamp x, !!bool maybe, 2021-13-45, !!int abc, an integer of 5,000 digits).
        detail = quote(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise ConfigError(f"invalid YAML value in config file {path}: {detail}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(
                f"config file {path}: top-level key {quote(key)} is not a string (the keys are {', '.join(keys)})"
            )
    _check_size_and_depth(data, path)
    return data


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (the last one would win silently).

    A scalar PyYAML cannot build (``!!timestamp x``, ``!!bool maybe``, ``2021-13-45``,
    ``!!int abc``, an integer of 5,000 digits) becomes a YAML error at its line.
    """

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)  # type: ignore[no-untyped-call]
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            shown = quote(node.value) if isinstance(node, yaml.ScalarNode) else node.tag
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {shown} as {node.tag.rsplit(':', 1)[-1]} ({type(exc).__name__})",
                node.start_mark,
            ) from None  # fmt: skip


def _construct_strict_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[object, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping refuses it with its own message
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {quote(key)} (first given on line {first.start_mark.line + 1})",
                key_node.start_mark,
            )  # fmt: skip
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_strict_mapping)


def _check_size_and_depth(data: object, path: Path) -> None:
    """Refuse a document too large or too deep once aliases are expanded (iteratively: no recursion)."""
    stack: list[tuple[object, int]] = [(data, 0)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"config file {path} holds more than {MAX_CONFIG_VALUES} values once its YAML aliases "
                f"are expanded; a wspool configuration holds a few dozen"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"config file {path} nests deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend((child, depth + 1) for child in node)
