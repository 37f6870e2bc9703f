"""Configuration: pydantic-settings over built-in defaults, a YAML file and ``WSPOOL_*``.

Precedence, highest first: values passed in code, environment variables, the
YAML file (named in code or by ``WSPOOL_CONFIG``), built-in defaults. Sources
are deep-merged, so ``WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE=512MiB``
overrides that one rule and keeps every other value of the file.

Every value is validated before anything is allocated; a bad value raises
:class:`~wspool.errors.ConfigError` naming the YAML key, the environment
variable, the value, where it came from and what was expected.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from wspool.errors import ENV_DELIMITER, ENV_PREFIX, ConfigError, setting_names
from wspool.rules import compile_rule
from wspool.units import parse_size

__all__ = [
    "BUILTIN_DEFAULTS",
    "CONFIG_ENV_VAR",
    "GROWTH_POLICIES",
    "PoolConfig",
    "Provenance",
    "WspoolSettings",
    "iter_settings",
    "load_settings",
]

#: The environment variable that names the YAML file.
CONFIG_ENV_VAR = "WSPOOL_CONFIG"

#: The seed's sizes: 128 MiB for plain MLA decode, 256 MiB when the LSE is returned.
#: ``configs/default.yaml`` carries the same values (a test keeps them equal).
BUILTIN_DEFAULTS: dict[str, Any] = {
    "pools": {
        "flashinfer_mla": {
            "rules": {"default": "128MiB", "lse": "256MiB"},
        },
    },
}

GROWTH_POLICIES = ("exact", "power_of_two")


def _rule_value(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a size or an expression string, got {type(value).__name__}")
    compile_rule(value)  # raises a RuleError (a ValueError) naming what is wrong
    return str(value)


def _growth_value(value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in GROWTH_POLICIES:
        return value.strip().lower()
    try:
        granularity = parse_size(value)
    except ValueError:
        raise ValueError(
            f"expected 'exact', 'power_of_two' or a granularity size such as '32MiB', got {value!r}"
        ) from None
    if granularity <= 0:
        raise ValueError("a growth granularity must be positive")
    return str(value)


def _size_value(value: object) -> int | None:
    if value is None:
        return None
    return parse_size(value)


RuleSource = Annotated[str, BeforeValidator(_rule_value)]
GrowthPolicy = Annotated[str, BeforeValidator(_growth_value)]
OptionalSize = Annotated[int | None, BeforeValidator(_size_value)]


class PoolConfig(BaseModel):
    """One pool's settings (``pools.<name>`` in YAML).

    Attributes:
        rules: Named sizing rules, e.g. ``{"default": "128MiB", "lse": "256MiB"}``.
        growth: ``exact`` (grow to the request), ``power_of_two``, or a
            granularity such as ``32MiB`` that capacities are rounded up to.
        max_bytes: The most the pool may hold on one device and lane.
        description: Free text shown by ``wspool show``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: dict[str, RuleSource] = Field(default_factory=dict)
    growth: GrowthPolicy = "exact"
    max_bytes: OptionalSize = None
    description: str = ""


class WspoolSettings(BaseSettings):
    """All of wspool's settings; build with :func:`load_settings`.

    Attributes:
        pools: Pool name -> its settings. Pool names are lower case (environment
            variable names are matched case-insensitively).
        debug_streams: Warn when one pool's buffer is handed to two CUDA streams
            without ordering between them (costs a stream query per call).
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_DELIMITER,
        extra="forbid",
        frozen=True,
    )

    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    debug_streams: bool = False

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = settings_cls.model_config.get("yaml_file")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        sources.append(InitSettingsSource(settings_cls, init_kwargs=_deep_copy(BUILTIN_DEFAULTS)))
        return tuple(sources)


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    return data


class Provenance:
    """Where each value of a loaded configuration came from.

    Attributes:
        config_file: The YAML file that was read, if any.
    """

    def __init__(self, layers: list[tuple[str, dict[str, Any]]], config_file: Path | None) -> None:
        self._layers = layers
        self.config_file = config_file

    def source_of(self, path: tuple[str, ...]) -> str:
        """Return ``"code"``, ``"environment variable WSPOOL_..."``, ``"YAML file ..."`` or ``"default"``."""
        for label, data in self._layers:
            node: Any = data
            for part in path:
                if not isinstance(node, Mapping) or part not in node:
                    break
                node = node[part]
            else:
                if label == "env":
                    return f"environment variable {setting_names(path)[1]}"
                if label == "yaml":
                    return f"YAML file {self.config_file}"
                return label
        return "default"


def _config_file_from(config_file: str | os.PathLike[str] | None) -> tuple[Path | None, str]:
    if config_file is not None:
        return Path(config_file), "given explicitly"
    named = os.environ.get(CONFIG_ENV_VAR)
    if named:
        return Path(named), f"named by {CONFIG_ENV_VAR}"
    return None, ""


def _read_yaml(path: Path, how: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} ({how}) does not exist or is not a file")
    try:
        with path.open(encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"invalid YAML in config file {where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path} ({how}): {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> WspoolSettings:
    """Load and validate the configuration.

    Args:
        config_file: A YAML file; when ``None``, the file named by
            ``WSPOOL_CONFIG``, if set. A named file that does not exist is an error.
        **overrides: Values given in code, highest precedence, e.g.
            ``pools={"flashinfer_mla": {"rules": {"lse": "512MiB"}}}``.

    Returns:
        The validated settings. Its provenance is available as
        ``settings_provenance(settings)``.

    Raises:
        ConfigError: The file is missing or not valid YAML, or a value is invalid.
    """
    settings, _ = load_settings_with_provenance(config_file, **overrides)
    return settings


def load_settings_with_provenance(
    config_file: str | os.PathLike[str] | None = None, **overrides: Any
) -> tuple[WspoolSettings, Provenance]:
    """Like :func:`load_settings`, also returning where each value came from."""
    path, how = _config_file_from(config_file)
    yaml_data = _read_yaml(path, how) if path is not None else {}
    settings_cls: type[WspoolSettings] = WspoolSettings
    if path is not None:
        settings_cls = type(
            "WspoolSettings",
            (WspoolSettings,),
            {"model_config": {**WspoolSettings.model_config, "yaml_file": path}},
        )
    try:
        env_data = EnvSettingsSource(settings_cls)()
    except SettingsError as exc:
        raise _env_error(exc) from None
    provenance = Provenance(
        [("code", overrides), ("env", env_data), ("yaml", yaml_data), ("default", BUILTIN_DEFAULTS)], path
    )
    try:
        settings = settings_cls(**overrides)
    except SettingsError as exc:
        raise _env_error(exc) from None
    except ValidationError as exc:
        raise _config_error(exc, provenance) from None
    return settings, provenance


def _env_error(exc: SettingsError) -> ConfigError:
    match = re.search(r'field "(\w+)"', str(exc))
    field = match.group(1) if match else "?"
    key, env = setting_names((field,))
    return ConfigError(
        f"invalid environment variable {env}: its value is not valid JSON for {key} "
        f"(set single values through nested variables such as {env}__<NAME>__RULES__DEFAULT=256MiB)",
        path=(field,),
    )


def _config_error(exc: ValidationError, provenance: Provenance) -> ConfigError:
    lines = []
    first_path: tuple[str, ...] | None = None
    for error in exc.errors(include_url=False):
        path = tuple(str(p) for p in error["loc"] if not str(p).startswith("function-"))
        if first_path is None:
            first_path = path
        key, env = setting_names(path)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key (check its spelling and nesting)"
        value = error.get("input")
        shown = f" = {value!r}" if not isinstance(value, Mapping) else ""
        lines.append(f"{key}{shown} (from {provenance.source_of(path)}): {message}; set {key} / {env}")
    count = len(lines)
    header = "invalid wspool configuration" + (f" ({count} errors)" if count > 1 else "")
    return ConfigError(header + ": " + "; ".join(lines), path=first_path)


def iter_settings(settings: WspoolSettings) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield ``(key path, value)`` for every leaf value, in a stable order."""

    def walk(prefix: tuple[str, ...], node: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
        if isinstance(node, Mapping):
            for key in sorted(node):
                yield from walk((*prefix, str(key)), node[key])
        else:
            yield prefix, node

    yield from walk((), settings.model_dump())
