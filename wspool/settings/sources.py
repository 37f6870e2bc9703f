"""Where settings come from: the strict YAML reader, the engines' own workspace variables, and provenance.

:func:`read_sources` reads one load's inputs once. Every YAML file wspool
reads goes through :func:`read_yaml_file`, which refuses duplicate keys,
unsafe tags and documents over its bounds; every value keeps where it came
from (:class:`Provenance`), so an error names the source, the YAML key and the
``WSPOOL_*`` variable. An engine's own workspace variable
(``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``...) sits below the user's file and
``WSPOOL_*``, and above a shipped configuration. Pure functions over files,
text and mappings; thread-safe. Precedence: README.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsError

from wspool.errors import (
    ENV_DELIMITER,
    ENV_PREFIX,
    ConfigError,
    WspoolError,
    env_error,
    quote,
    setting_names,
)
from wspool.units import KiB, format_size

__all__ = [
    "CONFIG_ENV_VAR",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_FILE_BYTES",
    "MAX_CONFIG_VALUES",
    "SOURCE_KINDS",
    "LoadInputs",
    "Provenance",
    "SettingsLayer",
    "Source",
    "config_file_from",
    "deep_copy",
    "parse_yaml",
    "read_sources",
    "read_text_file",
    "read_yaml",
    "read_yaml_file",
]


def deep_copy(data: Any) -> Any:
    """Copy nested mappings (so a source never shares dicts with another); other values as they are."""
    if isinstance(data, Mapping):
        return {k: deep_copy(v) for k, v in data.items()}
    return data


class SettingsLayer(PydanticBaseSettingsSource):
    """A pydantic-settings source holding one layer of settings already read.

    The environment, a YAML file, an engine knob, a profile or the built-in
    defaults: :func:`wspool.settings.schema.load_settings` reads each once and
    lists them in ``WspoolSettings.settings_customise_sources``' order.
    """

    def __init__(self, settings_cls: type[BaseSettings], data: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        self.data = data

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """Return one field's value (pydantic-settings calls :meth:`__call__` instead)."""
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        """Return the layer, copied: the merge of the sources must not share dicts between them."""
        return dict(deep_copy(self.data))


#: The kinds of :class:`Source`, highest precedence first (README's "Configuration").
SOURCE_KINDS = ("code", "environment", "file", "engine", "shipped", "profile", "default")


@dataclass(frozen=True)
class Source:
    """One layer of settings, and where it came from.

    Attributes:
        kind: One of :data:`SOURCE_KINDS`: values given in code, ``WSPOOL_*`` variables,
            the user's YAML file, an engine's own workspace variable, a shipped
            configuration, a device profile, the built-in defaults.
        data: The layer's settings, in the configuration's schema.
        name: The file's path, the shipped configuration's or the profile's name, or
            the engine's variable; empty for the other kinds.
        engine: The engine whose variable it is (``"vLLM"``), for kind ``engine``.
    """

    kind: str
    data: Mapping[str, Any]
    name: str = ""
    engine: str = ""

    def value_at(self, path: Sequence[str]) -> tuple[bool, Any]:
        """Return ``(True, value)`` where this layer gives ``path``, else ``(False, None)``."""
        node: Any = self.data
        for part in path:
            if not isinstance(node, Mapping):
                return False, None
            # YAML keys need not be strings (``1:``), while error paths are.
            found = part if part in node else next((k for k in node if str(k) == part), _ABSENT)
            if found is _ABSENT:
                return False, None
            node = node[found]
        return True, node


_ABSENT = object()
#: The kinds a user sets on purpose, or that ship for an engine: when an engine's variable and
#: one of these give one key, ``show`` and ``doctor`` name both and say which wins.
_EXPLICIT_KINDS = frozenset({"code", "environment", "file", "engine", "shipped"})


class Provenance:
    """Where each value of a loaded configuration came from.

    Attributes:
        config_file: The YAML file that was read, if any.
        config_how: How it was named: ``"given explicitly"``, ``"named by WSPOOL_CONFIG"``,
            with ``": the shipped configuration NAME"`` where a name found a shipped file;
            empty without a file.
        shipped: The shipped configuration the file is, if it is one.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        config_file: Path | None = None,
        *,
        config_how: str = "",
        shipped: str | None = None,
        environ_names: Iterable[str] = (),
    ) -> None:
        self.sources = tuple(sources)
        self.config_file = config_file
        self.config_how = config_how
        self.shipped = shipped
        self._environ_names = frozenset(environ_names)

    def givers(self, path: Sequence[str]) -> list[Source]:
        """Return every source that gives ``path``, highest precedence first (the first one wins)."""
        return [source for source in self.sources if source.value_at(path)[0]]

    def label(self, source: Source, path: Sequence[str]) -> str:
        """Name ``source`` as the origin of ``path``: the variable, file, profile... it is."""
        if source.kind == "environment":
            return f"environment variable {self._variable_of(path)}"
        if source.kind == "file":
            return f"YAML file {source.name}"
        if source.kind == "engine":
            return f"{source.engine}'s variable {source.name}"
        if source.kind == "shipped":
            return f"shipped configuration {source.name}"
        if source.kind == "profile":
            return f"profile {source.name}"
        if source.kind == "default":
            return "built-in default"
        return f"code ({source.name})" if source.name else "code"

    def source_of(self, path: Sequence[str]) -> str:
        """Return where ``path``'s value came from, e.g. ``"environment variable WSPOOL_..."``.

        One of ``"code"``, ``"environment variable NAME"`` (the variable that was set),
        ``"YAML file PATH"``, ``"<engine>'s variable NAME"``, ``"shipped configuration NAME"``,
        ``"profile NAME"`` or ``"built-in default"``.
        """
        givers = self.givers(path)
        return self.label(givers[0], path) if givers else "built-in default"

    def overridden(self, path: Sequence[str]) -> list[tuple[str, Any]]:
        """Return ``(source, value)`` of what the winner of ``path`` overrides, where an engine's variable is involved.

        Empty unless an engine's variable and another explicit source (code, ``WSPOOL_*``,
        the user's file, a shipped configuration) both give the key: then the variable the
        winner beats, or what the winning variable beats.
        """
        givers = [s for s in self.givers(path) if s.kind in _EXPLICIT_KINDS]
        if len(givers) < 2 or not any(s.kind == "engine" for s in givers):
            return []
        losers = [s for s in givers[1:] if s.kind == "engine" or givers[0].kind == "engine"]
        return [(self.label(s, path), s.value_at(path)[1]) for s in losers]

    def explain(self, path: Sequence[str]) -> str:
        """Return :meth:`source_of`, naming too an engine's variable that gives the key and what wins.

        ``"YAML file my.yaml, over vLLM's variable VLLM_... = 1073741824"`` where the
        user's rule wins; ``"vLLM's variable VLLM_..., over shipped configuration vllm
        = '394MiB'"`` where the variable does.
        """
        losers = self.overridden(path)
        if not losers:
            return self.source_of(path)
        return f"{self.source_of(path)}, over {', '.join(f'{label} = {quote(value)}' for label, value in losers)}"

    def variables_under(self, path: Sequence[str]) -> list[str]:
        """Return the ``WSPOOL_*`` variables that were set for ``path`` or a key below it, sorted."""
        name = setting_names(path)[1]
        return sorted(n for n in self._environ_names if n == name or n.startswith(name + ENV_DELIMITER))

    def _variable_of(self, path: Sequence[str]) -> str:
        """The ``WSPOOL_*`` variable that set ``path``: the one named for it, or for a key above it (JSON)."""
        for end in range(len(path), 0, -1):
            name = setting_names(path[:end])[1]
            if name in self._environ_names:
                return name
        below = self.variables_under(path)  # a key the schema refuses, set through a variable for a key below it
        return below[0] if below else setting_names(path)[1]


#: The variable that names the YAML file.
CONFIG_ENV_VAR = "WSPOOL_CONFIG"
#: The largest YAML file read; a real configuration is a few hundred bytes. The bound keeps
#: parsing with pure-Python PyYAML well under a second.
MAX_CONFIG_FILE_BYTES = 64 * KiB
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


def read_yaml_file(
    path: Path, *, what: str = "config file", how: str = "", error: type[ConfigError] = ConfigError
) -> Any:
    """Read any YAML file wspool takes with the strict safe loader, within the size and nesting bounds.

    Args:
        path: The file.
        what: What the file is, named in errors (``"config file"``, ``"shapes file"``).
        how: How it was named (``"given explicitly"``), named in errors; empty: not named.
        error: The :class:`~wspool.errors.ConfigError` subclass to raise.

    Returns:
        The document: ``None`` for an empty file, else a mapping, list or scalar.

    Raises:
        ConfigError: The file is missing, unreadable, malformed or over a bound (as ``error``).
    """
    config = what == "config file"
    typical = "; a wspool configuration is a few hundred bytes" if config else ""
    text = read_text_file(path, what=what, how=how, max_bytes=MAX_CONFIG_FILE_BYTES, error=error, typical=typical)
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"invalid YAML in {what} {where}: {problem}") from None
    except RecursionError:
        raise error(f"invalid YAML in {what} {path}: it nests too deeply") from None
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        # PyYAML's constructors raise these for tagged or date-like scalars they cannot build
        # (!!timestamp x, !!bool maybe, 2021-13-45, !!int abc, an integer of 5,000 digits).
        detail = quote(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise error(f"invalid YAML value in {what} {path}: {detail}") from None
    _check_size_and_depth(data, f"{what} {path}", config, error)
    return data


def read_text_file(
    path: Path,
    *,
    what: str,
    max_bytes: int,
    how: str = "",
    error: type[WspoolError] = ConfigError,
    typical: str = "",
) -> str:
    """Read a regular file of at most ``max_bytes`` as UTF-8: every file input wspool takes goes through here.

    A FIFO, a device (``/dev/zero``), a directory or a file over the bound is refused
    before anything is read from it: opening never waits for a FIFO's writer, and
    the file is checked once open, so it cannot be swapped in between.

    Args:
        path: The file.
        what: What the file is, named in errors (``"config file"``, ``"figures file"``).
        max_bytes: The largest file read.
        how: How it was named (``"given explicitly"``), named in errors; empty: not named.
        error: The :class:`~wspool.errors.WspoolError` subclass to raise.
        typical: Appended to the error for a file over the bound (what such a file usually holds).

    Raises:
        WspoolError: The file is missing, not a regular file, unreadable, over the bound or not UTF-8
            (as ``error``).
    """
    named = f" ({how})" if how else ""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{what} {path}{named} does not exist or is not a file") from None
    except (OSError, ValueError) as exc:  # a name too long, a directory that cannot be searched, a NUL
        why = getattr(exc, "strerror", None) or type(exc).__name__  # not str(exc): it repeats the whole path
        raise error(f"cannot read {what} {quote(str(path))}{named}: {why}") from None
    try:
        try:
            regular = stat.S_ISREG(os.fstat(descriptor).st_mode)
        except OSError:
            os.close(descriptor)
            raise
        if not regular:
            os.close(descriptor)
            raise error(f"{what} {path}{named} does not exist or is not a file (a FIFO, device or directory)")
        with os.fdopen(descriptor, "rb") as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}{named}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise error(f"{what} {path}{named} is larger than {format_size(max_bytes)}{typical}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"it is not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise error(f"cannot read {what} {path}{named}: {why}") from None


def read_yaml(path: Path, how: str, keys: Iterable[str]) -> dict[str, Any]:
    """Read a configuration file: :func:`read_yaml_file`, and a mapping with string keys at the top.

    ``keys`` are the top-level settings, named in the error for a key that is not a string.

    Raises:
        ConfigError: The file is missing, unreadable, malformed or over a bound.
    """
    data = read_yaml_file(path, how=how)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(
                f"config file {path}: top-level key {quote(key)} is not a string (the keys are {', '.join(keys)})"
            )
    return data


def parse_yaml(text: str, where: str) -> Any:
    """Parse YAML text that wspool ships (its profiles) with the strict loader.

    Raises:
        ConfigError: The text is not valid YAML, naming ``where``.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {where}: {' '.join(str(exc).split())}") from None


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (the last one would win silently).

    A plain key that YAML 1.1 reads as a boolean (``off``, ``no``, ``yes``, ``on``,
    ``true``) is read as the text written, as YAML 1.2 reads ``off``; values keep
    YAML 1.1's booleans (``debug_streams: yes`` is true).

    A key that a merge (``<<: *base``) brings in may be given again explicitly: the
    explicit one wins, as YAML specifies. A scalar PyYAML cannot build
    (``!!timestamp x``, ``!!bool maybe``, ``2021-13-45``, ``!!int abc``, an integer of
    5,000 digits) becomes a YAML error at its line.
    """

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)  # type: ignore[no-untyped-call]
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            shown = quote(node.value) if isinstance(node, yaml.ScalarNode) else node.tag
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"cannot read {shown} as {node.tag.rsplit(':', 1)[-1]} ({type(exc).__name__})",
                node.start_mark,
            ) from None


_MERGE_TAG = "tag:yaml.org,2002:merge"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_STR_TAG = "tag:yaml.org,2002:str"


def _refuse_repeated_keys(loader: _StrictLoader, node: yaml.MappingNode, deep: bool, checked: set[int]) -> None:
    """Refuse a key written twice in ``node`` or in a mapping it merges in (``checked``: nodes already seen)."""
    if id(node) in checked:
        return
    checked.add(id(node))
    seen: dict[object, yaml.Node] = {}
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE_TAG:
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in sources:
                if isinstance(source, yaml.MappingNode):
                    _refuse_repeated_keys(loader, source, deep, checked)
            continue
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag == _BOOL_TAG and key_node.style is None:
            # A key is a name, read as written: YAML 1.1 would make `off:` or `yes:` a boolean (YAML 1.2 does not).
            key_node.tag = _STR_TAG
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping refuses it with its own message
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {quote(key)} (first given on line {first.start_mark.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node


def _construct_strict_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    # Checked before the merge keys are flattened: flattening puts the merged keys first and the
    # explicit ones after them, so construct_mapping lets an explicit key override a merged one.
    _refuse_repeated_keys(loader, node, deep, set())
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_strict_mapping)


def _check_size_and_depth(data: object, where: str, config: bool, error: type[ConfigError]) -> None:
    """Refuse a document too large or too deep once aliases are expanded (iteratively: no recursion)."""
    stack: list[tuple[object, int]] = [(data, 0)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            typical = "; a wspool configuration holds a few dozen" if config else ""
            expanded = f"values once its YAML aliases are expanded{typical}"
            raise error(f"{where} holds more than {MAX_CONFIG_VALUES} {expanded}")
        if depth > MAX_CONFIG_DEPTH:
            raise error(f"{where} nests deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend((child, depth + 1) for child in node)


@dataclass(frozen=True)
class LoadInputs:
    """What one load read, highest precedence first; settings built from equal sources are equal."""

    overrides: dict[str, Any]
    sources: tuple[Source, ...]  # the environment, the file or the shipped configuration, the engines' variables
    path: Path | None = field(compare=False)
    how: str = field(compare=False)
    shipped: str | None = field(compare=False)
    environ_names: frozenset[str] = field(compare=False)


def read_sources(
    settings_cls: type[BaseSettings],
    overrides: Mapping[str, Any],
    path: Path | None,
    how: str = "",
    shipped: str | None = None,
    engines: Sequence[Source] = (),
) -> LoadInputs:
    """Read every source of one load once: ``WSPOOL_*``, the YAML file, the engines' variables.

    Args:
        settings_cls: The settings whose fields the file and the ``WSPOOL_*`` variables set.
        overrides: The values given in code (copied, so the caller's later edits reach nothing).
        path: The YAML file, or ``None``.
        how: How the file was named (``"named by WSPOOL_CONFIG"``), for messages.
        shipped: The shipped configuration ``path`` is, or ``None`` for the user's own file.
        engines: The engines' variables that are set, one layer each
            (:func:`wspool.settings.profiles.engine_knob_layers`).

    Raises:
        ConfigError: The file is missing or not valid YAML, or a ``WSPOOL_*`` value is not the JSON its key needs.
    """
    yaml_data = read_yaml(path, how, settings_cls.model_fields) if path is not None else {}
    try:
        env_data = EnvSettingsSource(settings_cls)()
    except (SettingsError, RecursionError) as exc:
        raise env_error(exc) from None
    sources = [Source("environment", env_data)]
    if path is None:
        sources += engines
    elif shipped is None:  # the user's own file: over the engines' variables
        sources += [Source("file", yaml_data, name=str(path)), *engines]
    else:  # a shipped configuration is a shipped default: the engines' variables override it
        sources += [*engines, Source("shipped", yaml_data, name=shipped)]
    return LoadInputs(
        overrides=deep_copy(overrides),
        sources=tuple(sources),
        path=path,
        how=how,
        shipped=shipped,
        environ_names=frozenset(n for n in os.environ if n.startswith(ENV_PREFIX)),
    )
