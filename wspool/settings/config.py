"""Configuration: pydantic-settings over built-in defaults, a YAML file and ``WSPOOL_*``.

Precedence, highest first: values passed in code, environment variables, the
YAML file (named in code or by ``WSPOOL_CONFIG``), the engines' own workspace
variables (:mod:`wspool.settings.engine_knobs`), built-in defaults. Sources
are deep-merged, so ``WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE=512MiB``
overrides that one rule and keeps every other value of the file.

Every value is validated before anything is allocated; a bad value raises
:class:`~wspool.errors.ConfigError` naming the YAML key, the environment
variable, the value, where it came from and what was expected.

Hostile input: the YAML file is read with the safe loader, must be at most
:data:`MAX_CONFIG_FILE_BYTES`, and may hold at most :data:`MAX_CONFIG_VALUES`
values nested at most :data:`MAX_CONFIG_DEPTH` deep after expanding aliases
(so an alias bomb is refused before validation walks it). Values quoted back
in errors are shortened. Nothing is silently dropped: a key given twice in one
YAML mapping, a ``WSPOOL_*`` variable that names no setting, and pool names that
differ only in case are errors. Whatever the file or the environment holds,
loading raises nothing but :class:`~wspool.errors.ConfigError`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from wspool.errors import ENV_DELIMITER, ENV_PREFIX, ConfigError
from wspool.rules import LiteralRule, compile_rule
from wspool.settings.engine_knobs import engine_knob_layers, engine_knob_settings
from wspool.settings.forensics import MAX_REPORTED_ERRORS, config_error, env_error, quote
from wspool.settings.name_checks import check_env_names, check_pool_names, check_shared_pools
from wspool.settings.profiles import AUTO, load_profile
from wspool.settings.provenance import Provenance, deep_copy
from wspool.settings.values import (
    GROWTH_POLICIES,
    RESERVED_FACT_NAMES,
    FactName,
    FactValue,
    GrowthPolicy,
    OptionalLimit,
    PoolName,
    ProfileSetting,
    RuleSource,
)
from wspool.settings.yaml_file import (
    CONFIG_ENV_VAR,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_FILE_BYTES,
    MAX_CONFIG_VALUES,
    config_file_from,
    read_yaml,
)
from wspool.units import format_size

__all__ = [
    "BUILTIN_DEFAULTS",
    "CONFIG_ENV_VAR",
    "EXTRA_ENV_VARS",
    "GROWTH_POLICIES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_FILE_BYTES",
    "MAX_CONFIG_VALUES",
    "MAX_REPORTED_ERRORS",
    "RESERVED_FACT_NAMES",
    "SEED_MLA_WORKSPACE_BYTES",
    "PoolConfig",
    "Provenance",
    "WspoolSettings",
    "check_pool_names",
    "check_shared_pools",
    "iter_settings",
    "load_settings",
    "load_settings_with_provenance",
    "profile_settings",
    "validate_pool",
]

#: ``WSPOOL_*`` variables that are not settings but are read elsewhere; any other
#: ``WSPOOL_*`` variable must name a setting (a misspelt one is an error, not ignored).
#: The vLLM plugin reads ``WSPOOL_VLLM`` and ``WSPOOL_VLLM_DEVICE``; the SGLang integration
#: ``WSPOOL_SGLANG`` and ``WSPOOL_SGLANG_DEVICE``.
EXTRA_ENV_VARS: tuple[str, ...] = (
    CONFIG_ENV_VAR,
    "WSPOOL_VLLM",
    "WSPOOL_VLLM_DEVICE",
    "WSPOOL_SGLANG",
    "WSPOOL_SGLANG_DEVICE",
)

#: The seed's sizes: 128 MiB for plain MLA decode, 256 MiB when the LSE is returned.
#: FlashInfer paged attention (pool ``flashinfer``) shares that buffer: engines run the
#: two one after another on one stream. Its rules bound the split-KV partial outputs that
#: FlashInfer's eager plans carve (``wspool.flashinfer.paged`` derives them).
#: The ``flashinfer_mla`` pool's default facts are DeepSeek's and Kimi's MLA geometry, for
#: call sites that pass none (a caller's facts win). ``configs/default.yaml`` carries the
#: same values (a test keeps them equal).
SEED_MLA_WORKSPACE_BYTES: Mapping[str, int] = MappingProxyType({"default": 128 << 20, "lse": 256 << 20})
BUILTIN_DEFAULTS: dict[str, Any] = {
    "pools": {
        "flashinfer_mla": {
            "rules": {rule: f"{nbytes >> 20}MiB" for rule, nbytes in SEED_MLA_WORKSPACE_BYTES.items()},
            "facts": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "q_len": 1, "cp_world": 1},
        },
        "flashinfer": {
            "shared_with": "flashinfer_mla",
            "rules": {
                "decode": "(512 * sm_count + num_qo_heads) * (head_dim + 1) * 4 + 1MiB",
                "prefill": "(256 * sm_count + num_qo_heads) * (head_dim + 1) * 4 + 1MiB",
            },
        },
    },
}


class PoolConfig(BaseModel):
    """One pool's settings (``pools.<name>`` in YAML).

    Attributes:
        rules: Named sizing rules, e.g. ``{"default": "128MiB", "lse": "256MiB"}``.
        growth: ``exact`` (grow to the request), ``power_of_two``, or a
            granularity such as ``32MiB`` that capacities are rounded up to.
        max_bytes: The most the pool may hold on one device and lane.
        shared_with: Another pool whose buffer this pool's rules draw from (on the
            same device and lane), so backends that run one after another on one
            stream hold one buffer; that pool's growth and max_bytes apply. Empty
            or ``null``: the pool has its own buffer.
        description: Free text shown by ``wspool show``.
        facts: Default facts of this pool's rules, e.g. ``{"kv_lora_rank": 512}``:
            non-negative integers, below a caller's facts and above the device's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: dict[str, RuleSource] = Field(default_factory=dict)
    growth: GrowthPolicy = "exact"
    max_bytes: OptionalLimit = None
    shared_with: PoolName = None
    description: str = ""
    facts: dict[FactName, FactValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _literal_rules_fit_max_bytes(self) -> PoolConfig:
        """Refuse a fixed-size rule above ``max_bytes``: it could never be served."""
        if self.max_bytes is None:
            return self
        for name, source in self.rules.items():
            rule = compile_rule(source)
            if isinstance(rule, LiteralRule) and rule.nbytes > self.max_bytes:
                # The pool's name is not known here: _config_error names both full keys.
                raise PydanticCustomError(
                    "rule_above_max_bytes",
                    "rule {rule} = {source} ({size}) is above max_bytes = {limit}",
                    {
                        "rule": name,
                        "source": source,
                        "size": format_size(rule.nbytes),
                        "limit": format_size(self.max_bytes),
                    },
                )
        return self


class WspoolSettings(BaseSettings):
    """All of wspool's settings; build with :func:`load_settings`.

    Attributes:
        pools: Pool name -> its settings. Pool names are lower case (environment
            variable names are matched case-insensitively).
        debug_streams: Warn when one pool's buffer is handed to two CUDA streams
            without ordering between them (costs a stream query per call).
        profile: ``auto`` (pick per device from its compute capability) or the
            name of a profile (:mod:`wspool.settings.profiles`) for every device.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_DELIMITER,
        extra="forbid",
        frozen=True,
    )

    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    debug_streams: bool = False
    profile: ProfileSetting = AUTO

    # The profile layer of this class's sources (see profile_settings), just above the built-in defaults.
    _profile_layer: ClassVar[tuple[str, Mapping[str, Any]] | None] = None
    # How load_settings built these settings, so profile_settings can layer a profile under the same inputs.
    _load_inputs: tuple[Path | None, dict[str, Any]] | None = PrivateAttr(default=None)

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
        knobs = engine_knob_settings()
        if knobs:
            sources.append(InitSettingsSource(settings_cls, init_kwargs=knobs))
        layer = getattr(settings_cls, "_profile_layer", None)
        if layer is not None:
            sources.append(InitSettingsSource(settings_cls, init_kwargs=deep_copy(layer[1])))
        sources.append(InitSettingsSource(settings_cls, init_kwargs=deep_copy(BUILTIN_DEFAULTS)))
        return tuple(sources)


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
    return _load(config_file, None, overrides)


def profile_settings(settings: WspoolSettings, profile: str) -> tuple[WspoolSettings, Provenance]:
    """Return ``settings`` with the profile ``profile`` layered just above the built-in defaults.

    The file, the environment and the code overrides that :func:`load_settings`
    read are read again under the profile, which they override key by key.
    Settings not built by :func:`load_settings` are returned as they are.

    Raises:
        ConfigError: The profile's settings do not validate with the configuration's.
    """
    inputs = settings._load_inputs
    if inputs is None:
        return settings, Provenance([("default", BUILTIN_DEFAULTS)], None)
    return _load(inputs[0], profile, inputs[1])


def _load(
    config_file: str | os.PathLike[str] | None, profile: str | None, overrides: dict[str, Any]
) -> tuple[WspoolSettings, Provenance]:
    path, how = config_file_from(config_file)
    yaml_data = read_yaml(path, how, WspoolSettings.model_fields) if path is not None else {}
    settings_cls: type[WspoolSettings] = WspoolSettings
    profile_layer = None if profile is None else (f"profile {profile}", load_profile(profile).settings)
    if path is not None or profile_layer is not None:
        settings_cls = type(
            "WspoolSettings",
            (WspoolSettings,),
            {"model_config": {**WspoolSettings.model_config, "yaml_file": path}, "_profile_layer": profile_layer},
        )
    check_env_names(WspoolSettings.model_fields, EXTRA_ENV_VARS)
    try:
        env_data = EnvSettingsSource(settings_cls)()
    except (SettingsError, RecursionError) as exc:
        raise env_error(exc) from None
    layers = [("code", overrides), ("env", env_data), ("yaml", yaml_data), *engine_knob_layers()]
    if profile_layer is not None:
        layers.append((profile_layer[0], dict(profile_layer[1])))
    provenance = Provenance([*layers, ("default", BUILTIN_DEFAULTS)], path)
    try:
        settings = settings_cls(**overrides)
    except (SettingsError, RecursionError) as exc:
        raise env_error(exc) from None
    except ValidationError as exc:
        raise config_error(exc, provenance) from None
    _check_names(settings, provenance)
    check_shared_pools(settings, provenance)
    settings._load_inputs = (path, overrides)
    return settings, provenance


def validate_pool(name: str, values: Mapping[str, Any]) -> PoolConfig:
    """Validate one pool's settings given in code exactly as a YAML file's ``pools.<name>`` is.

    Raises:
        ConfigError: Naming each offending key, as for a file.
    """
    provenance = Provenance([("code (declare_pool)", {"pools": {name: dict(values)}})], None)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"invalid pool name {quote(name)}: a pool name must be a non-empty string")
    try:
        pool = PoolConfig(**values)
    except ValidationError as exc:
        raise config_error(exc, provenance, prefix=("pools", name)) from None
    check_pool_names({name: pool}, provenance.source_of)
    return pool


def _check_names(settings: WspoolSettings, provenance: Provenance) -> None:
    check_pool_names(settings.pools, provenance.source_of)


def iter_settings(settings: WspoolSettings) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield ``(key path, value)`` for every leaf value, in a stable order."""

    def walk(prefix: tuple[str, ...], node: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
        if isinstance(node, Mapping):
            for key in sorted(node):
                yield from walk((*prefix, str(key)), node[key])
        else:
            yield prefix, node

    yield from walk((), settings.model_dump())
