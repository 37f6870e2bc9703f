"""Where settings come from: the strict YAML reader, the engines' own workspace variables, and provenance.

Every YAML file wspool reads goes through :func:`read_yaml_file`, which refuses
duplicate keys, unsafe tags and documents over its bounds; every value keeps
where it came from (:class:`Provenance`), so an error names the source, the
YAML key and the ``WSPOOL_*`` variable. The engine knobs
(``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``...) sit just above the profile.
Pure functions over files, text and mappings; thread-safe. Precedence: README.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from wspool.errors import ENV_DELIMITER, ENV_PREFIX, ConfigError, describe_setting, readable_int, setting_names
from wspool.units import KiB, MiB, format_size

__all__ = [
    "CONFIG_ENV_VAR",
    "ENGINE_KNOBS",
    "ENGINE_KNOB_UNITS",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_FILE_BYTES",
    "MAX_CONFIG_VALUES",
    "MAX_REPORTED_ERRORS",
    "Provenance",
    "SettingsLayer",
    "config_error",
    "config_file_from",
    "deep_copy",
    "engine_knob_layers",
    "engine_knob_settings",
    "env_error",
    "parse_yaml",
    "quote",
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


class Provenance:
    """Where each value of a loaded configuration came from.

    Attributes:
        config_file: The YAML file that was read, if any.
    """

    def __init__(self, layers: Sequence[tuple[str, Mapping[str, Any]]], config_file: Path | None) -> None:
        self._layers = layers
        self.config_file = config_file

    def source_of(self, path: tuple[str, ...]) -> str:
        """Return ``"code"``, ``"environment variable WSPOOL_..."``, ``"YAML file ..."`` or ``"default"``.

        Where a higher source sets a key that an engine's own variable also sets,
        the text says so: ``"YAML file f.yaml; overrides environment variable X"``.
        """
        for index, (label, data) in enumerate(self._layers):
            if not _holds(data, path):
                continue
            if label == "env":
                shown = f"environment variable {setting_names(path)[1]}"
            elif label == "yaml":
                shown = f"YAML file {self.config_file}"
            else:
                return label
            knobs = [
                k for k, d in self._layers[index + 1 :] if k.startswith("environment variable ") and _holds(d, path)
            ]
            return "; ".join([shown, *(f"overrides {knob}" for knob in knobs)])
        return "default"


def _holds(data: Mapping[str, Any], path: tuple[str, ...]) -> bool:
    """Whether the layer ``data`` sets the key ``path``."""
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping):
            return False
        # YAML keys need not be strings (``1:``), while error paths are.
        found = part if part in node else next((k for k in node if str(k) == part), None)
        if found is None:
            return False
        node = node[found]
    return True


#: Validation errors quoted in one ConfigError; the rest are counted.
MAX_REPORTED_ERRORS = 5


class _ShortRepr(reprlib.Repr):
    """reprlib's shortened repr, with integers of any size (``repr`` refuses more than 4,300 digits)."""

    def repr_int(self, x: int, level: int) -> str:
        return readable_int(x)


_quote = _ShortRepr()
_quote.maxlevel = 3
_quote.maxstring = 80
_quote.maxother = 80


def quote(value: object) -> str:
    """Return ``value``'s repr, shortened for quoting in an error."""
    return _quote.repr(value)


def env_error(exc: Exception) -> ConfigError:
    """Name the variable whose value could not be decoded as the JSON its key needs."""
    match = re.search(r'field "(\w+)"', str(exc))
    field = match.group(1) if match else ""
    cause = exc.__cause__
    why = "nests too deeply" if isinstance(exc, RecursionError) else "is not valid JSON"
    if isinstance(cause, json.JSONDecodeError):
        why = f"is not valid JSON ({cause.msg} at char {cause.pos})"
    name = _undecodable_env_var(field, getattr(cause, "doc", None))
    path = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_DELIMITER)) if name else (field or "?",)
    key, env = setting_names(path)
    value = quote(os.environ.get(env, "")) if name else "its value"
    return ConfigError(
        f"invalid environment variable {env} = {value}: {why}, and {key} takes a mapping; "
        f"give a JSON object, or set single values through nested variables such as {env}__<KEY>=...",
        path=path,
    )


def _undecodable_env_var(field: str, doc: object) -> str | None:
    """Find the ``WSPOOL_*`` variable whose value failed to decode (``doc``: that value, if known)."""
    prefix = (ENV_PREFIX + field).upper()
    for name in sorted(os.environ):
        upper = name.upper()
        if not upper.startswith(prefix):
            continue
        value = os.environ[name]
        if doc is not None:
            if value == doc:
                return upper
            continue
        try:
            json.loads(value)
        except RecursionError:
            return upper
        except ValueError:
            continue
    return None


def config_error(exc: ValidationError, provenance: Provenance, prefix: tuple[str, ...] = ()) -> ConfigError:
    lines = []
    first_path: tuple[str, ...] | None = None
    for error in exc.errors(include_url=False):
        loc = [*prefix, *(str(p) for p in error["loc"] if not str(p).startswith("function-"))]
        path = tuple(p for p in loc if p != "[key]")
        if first_path is None:
            first_path = path
        key, env = setting_names(path)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key (check its spelling and nesting)"
        if "[key]" in loc and not isinstance(error.get("input"), str):
            message = f"a key must be a string, not {type(error.get('input')).__name__}"
        if error["type"] == "rule_above_max_bytes":
            lines.append(_rule_above_max_bytes(path, error.get("ctx") or {}, provenance))
            continue
        value = error.get("input")
        shown = f" = {quote(value)}" if not isinstance(value, Mapping) else ""
        lines.append(f"{key}{shown} (from {provenance.source_of(path)}): {message}; set {key} / {env}")
    count = len(lines)
    header = "invalid wspool configuration" + (f" ({count} errors)" if count > 1 else "")
    reported = lines[:MAX_REPORTED_ERRORS]
    if count > MAX_REPORTED_ERRORS:
        reported.append(f"and {count - MAX_REPORTED_ERRORS} more")
    return ConfigError(header + ": " + "; ".join(reported), path=first_path)


def _rule_above_max_bytes(pool: tuple[str, ...], ctx: Mapping[str, Any], provenance: Provenance) -> str:
    rule, limit = (*pool, "rules", str(ctx.get("rule"))), (*pool, "max_bytes")
    return (
        f"{setting_names(rule)[0]} = {quote(ctx.get('source'))} ({ctx.get('size')}, from "
        f"{provenance.source_of(rule)}) is above {setting_names(limit)[0]} = {ctx.get('limit')} (from "
        f"{provenance.source_of(limit)}), so it could never be served; lower {describe_setting(rule)} "
        f"or raise {describe_setting(limit)}"
    )


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
    named = f" ({how})" if how else ""
    config = what == "config file"
    try:
        is_file = path.is_file()
    except (OSError, ValueError) as exc:  # a name too long, a directory that cannot be searched, a NUL
        why = getattr(exc, "strerror", None) or type(exc).__name__  # not str(exc): it repeats the whole path
        raise error(f"cannot read {what} {quote(str(path))}{named}: {why}") from None
    if not is_file:
        raise error(f"{what} {path}{named} does not exist or is not a file")
    try:
        with path.open(encoding="utf-8") as handle:
            text = handle.read(MAX_CONFIG_FILE_BYTES + 1)
        if len(text) > MAX_CONFIG_FILE_BYTES:
            typical = "; a wspool configuration is a few hundred bytes" if config else ""
            raise error(f"{what} {path}{named} is larger than {format_size(MAX_CONFIG_FILE_BYTES)}{typical}")
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"invalid YAML in {what} {where}: {problem}") from None
    except RecursionError:
        raise error(f"invalid YAML in {what} {path}: it nests too deeply") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {what} {path}{named}: {exc}") from None
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        # PyYAML's constructors raise these for tagged or date-like scalars they cannot build
        # (!!timestamp x, !!bool maybe, 2021-13-45, !!int abc, an integer of 5,000 digits).
        detail = quote(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise error(f"invalid YAML value in {what} {path}: {detail}") from None
    _check_size_and_depth(data, f"{what} {path}", config, error)
    return data


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
                None, None, f"cannot read {shown} as {node.tag.rsplit(':', 1)[-1]} ({type(exc).__name__})",
                node.start_mark,
            ) from None  # fmt: skip


_MERGE_TAG = "tag:yaml.org,2002:merge"


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


#: (variable, engine, the (pool, rule) keys it sets), highest precedence first. A variable counts
#: bytes unless :data:`ENGINE_KNOB_UNITS` names another unit.
ENGINE_KNOBS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE",
        "vLLM",
        (
            ("flashinfer", "decode"),
            ("flashinfer", "prefill"),
            ("flashinfer", "vllm"),
            ("flashinfer_mla_sparse", "default"),
        ),
    ),
    (
        "SGLANG_FLASHINFER_WORKSPACE_SIZE",
        "SGLang",
        (
            ("flashinfer", "decode"),
            ("flashinfer", "prefill"),
            ("flashinfer_mla", "default"),
            ("flashinfer_mla", "lse"),
            # The SGLang integration's rules for the workspaces SGLang sizes with this variable alone.
            ("flashinfer", "sglang"),
            ("flashinfer_mla", "sglang_mla"),
            ("sglang_dsa_sparse_mla", "default"),
        ),
    ),
    # The TokenSpeed integration's rules for the workspaces TokenSpeed sizes with each variable.
    ("TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB", "TokenSpeed", (("tokenspeed_scratch", "trtllm_mha"),)),
    ("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "TokenSpeed", (("tokenspeed_trtllm_mla", "default"),)),
    ("FLASHINFER_WORKSPACE_SIZE", "TokenSpeed", (("flashinfer", "tokenspeed_flashmla"),)),
)

#: The unit of each engine variable that does not count bytes: ``(bytes per unit, its name)``.
ENGINE_KNOB_UNITS: Mapping[str, tuple[int, str]] = {
    "TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB": (MiB, "MiB"),
    "TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB": (MiB, "MiB"),
}


def engine_knob_layers(environ: Mapping[str, str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Return ``(source label, settings)`` for each knob that is set, highest precedence first.

    Args:
        environ: The environment to read; default ``os.environ``.

    Raises:
        ConfigError: A knob is set to something other than a positive whole number of bytes.
    """
    environ = os.environ if environ is None else environ
    layers = []
    for name, engine, keys in ENGINE_KNOBS:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        unit, unit_name = ENGINE_KNOB_UNITS.get(name, (1, "bytes"))
        try:
            nbytes = int(raw, 10) * unit
        except ValueError:
            nbytes = 0
        if nbytes <= 0:
            names = ", ".join(setting_names(("pools", pool, "rules", rule))[0] for pool, rule in keys)
            raise ConfigError(
                f"invalid environment variable {name} = {raw[:80]!r}: {engine} reads it as a positive whole "
                f"number of {unit_name}, and wspool sizes {names} with it; fix or unset it (the YAML file and "
                f"WSPOOL_* variables take precedence over it)"
            )
        data: dict[str, Any] = {"pools": {}}
        for pool, rule in keys:
            data["pools"].setdefault(pool, {"rules": {}})["rules"][rule] = nbytes
        layers.append((f"environment variable {name}", data))
    return layers


def engine_knob_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the settings of every knob that is set, merged (the first knob wins a shared key)."""
    merged: dict[str, Any] = {"pools": {}}
    for _, data in reversed(engine_knob_layers(environ)):
        for pool, config in data["pools"].items():
            merged["pools"].setdefault(pool, {"rules": {}})["rules"].update(config["rules"])
    return merged if merged["pools"] else {}
