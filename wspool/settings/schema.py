"""The configuration schema and its loading: pools, rules, facts, profile, with every value checked.

:func:`load_settings` merges code overrides > ``WSPOOL_*`` variables > the
user's YAML file > the engines' own variables > a shipped configuration > the
device profile > built-in defaults, key by key (pydantic-settings sources,
each read once per load), and validates the
result: a bad value, or a rule of wspool's own pools that reads a fact nothing
supplies, raises one :class:`~wspool.errors.ConfigError` naming the YAML key,
the variable, the value and its source; nothing is allocated. The settings are
immutable and thread-safe; nothing here touches CUDA. Keys: docs/profiles.md.
"""

from __future__ import annotations

import keyword
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from wspool.errors import (
    ENV_DELIMITER,
    ENV_PREFIX,
    MAX_REPORTED_ERRORS,
    ConfigError,
    config_error,
    describe_setting,
    env_error,
    miscased_env_vars,
    quote,
    setting_names,
    unknown_env_vars,
)
from wspool.rules import FUNCTIONS, MAX_MAGNITUDE, LiteralRule, compile_rule
from wspool.settings.profiles import (
    AUTO,
    PROFILE_NAMES,
    engine_knob_layers,
    engine_knob_settings,
    engine_specs,
    find_config_file,
    load_profile,
    shipped_name_of,
)
from wspool.settings.sources import (
    CONFIG_ENV_VAR,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_FILE_BYTES,
    MAX_CONFIG_VALUES,
    LoadInputs,
    Provenance,
    SettingsLayer,
    Source,
    read_sources,
)
from wspool.units import MiB, format_size, parse_size, size_spelling_hint

__all__ = [
    "BUILTIN_DEFAULTS",
    "CONFIG_ENV_VAR",
    "DEVICE_FACTS",
    "EXTRA_ENV_VARS",
    "GROWTH_POLICIES",
    "LAYERS_KEYWORD",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_FILE_BYTES",
    "MAX_CONFIG_VALUES",
    "MAX_REPORTED_ERRORS",
    "OWN_POOLS",
    "RESERVED_FACT_NAMES",
    "SHAPE_FACTS",
    "VLLM_FIXED_MLA_WORKSPACE_BYTES",
    "FactName",
    "FactValue",
    "GrowthPolicy",
    "OptionalLimit",
    "PoolConfig",
    "PoolName",
    "ProfileSetting",
    "Provenance",
    "RuleSource",
    "WspoolSettings",
    "all_extra_env_vars",
    "check_env_names",
    "check_pool_names",
    "check_rule_facts",
    "check_shared_pools",
    "describe_unknown_facts",
    "iter_settings",
    "load_settings",
    "load_settings_with_provenance",
    "profile_settings",
    "unknown_rule_facts",
    "validate_pool",
]


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
        hint = size_spelling_hint(value) if isinstance(value, str) else None
        raise ValueError(
            f"expected 'exact', 'power_of_two' or a granularity size such as '32MiB', got {value!r}"
            + (f"; {hint}" if hint else "")
        ) from None
    if granularity <= 0:
        raise ValueError("a growth granularity must be positive")
    return str(value)


def _size_value(value: object) -> int | None:
    if value is None:
        return None
    return parse_size(value)


def _limit_value(value: object) -> int | None:
    nbytes = _size_value(value)
    if nbytes == 0:
        raise ValueError("max_bytes must be positive (leave it out for no limit)")
    return nbytes


def _pool_name_value(value: object) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None  # empty: the pool has its own buffer
    if not isinstance(value, str):
        raise ValueError(f"expected the name of another pool, got {type(value).__name__}")
    return value.strip()


#: Names no fact may have: the parameters of the per-call methods (``PoolRegistry.workspace``,
#: ``resolve``, ``reserve``: facts are passed as keyword arguments next to them), Python's
#: keywords and the rule functions. Default facts and ``--fact`` on the command line check it.
RESERVED_FACT_NAMES = frozenset({"pool", "rule", "lane", "device", "nbytes", "self", *keyword.kwlist, *FUNCTIONS})


#: The facts wspool's own ops and integrations pass to their pools' rules: MLA decode
#: (``wspool.flashinfer.backends.call_facts``, the trtllm-gen counters), paged attention
#: (``wspool.flashinfer.paged``), and each engine's, as its spec lists them (``facts``: the
#: vLLM plugin's counters' ``min_bytes``, SGLang's ``sglang_bytes``, what its own code would
#: allocate...; the specs as read when the settings are imported). The one list of them: tests
#: keep it in step with those modules.
SHAPE_FACTS = frozenset(
    {
        "batch_size", "q_len", "num_heads", "max_seq_len", "page_size", "dtype_bytes", "cp_world",
        "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
        "num_tokens", "num_qo_heads", "num_kv_heads", "head_dim",
        *(fact for spec in engine_specs() for fact in spec.facts),
    }
)  # fmt: skip
#: The facts a CUDA device supplies to every rule of every pool
#: (:meth:`wspool.devices.DeviceDescription.facts`; a test keeps the two in step). Kept here,
#: beside :data:`SHAPE_FACTS`, so the settings check a rule's names without importing torch.
DEVICE_FACTS = ("sm_count", "cc_major", "cc_minor", "device_memory")
#: The pools of wspool's own ops and of the engines' integrations (each spec's ``pools``). Their
#: callers pass :data:`SHAPE_FACTS` and nothing else, so a rule of theirs that reads another name
#: (not a device fact or one of the pool's default facts either) can never resolve: it is refused
#: when the configuration loads.
OWN_POOLS = frozenset(
    {
        "flashinfer_mla", "flashinfer", "flashinfer_mla_counters", "flashinfer_int",
        *(pool for spec in engine_specs() for pool in spec.pools),
    }
)  # fmt: skip


def unknown_rule_facts(settings: WspoolSettings) -> list[tuple[tuple[str, ...], str, list[str]]]:
    """Return the rules that read a name no known source supplies.

    Known: :data:`SHAPE_FACTS`, the device facts (``sm_count``, ...) and the pool's own
    default facts. A pool a backend declares in code (``declare_pool``) may pass others.

    Returns:
        ``(the rule's key path, its source, the unknown names)`` per such rule, sorted by key.
    """
    found: list[tuple[tuple[str, ...], str, list[str]]] = []
    for pool_name in sorted(settings.pools):
        pool = settings.pools[pool_name]
        known = SHAPE_FACTS | set(DEVICE_FACTS) | set(pool.facts)
        for rule_name in sorted(pool.rules):
            source = pool.rules[rule_name]
            unknown = [name for name in compile_rule(source).names if name not in known]
            if unknown:
                found.append((("pools", pool_name, "rules", rule_name), source, unknown))
    return found


def describe_unknown_facts(path: tuple[str, ...], source: str, names: list[str], where: str = "") -> str:
    """Say what a rule that reads unknown ``names`` reads (see :func:`unknown_rule_facts`), and what is known.

    Args:
        path: The rule's key path.
        source: The rule as written.
        names: The names no known source supplies.
        where: Where the rule came from, e.g. ``" (from YAML file c.yaml)"``.
    """
    return (
        f"{setting_names(path)[0]} = {quote(source)}{where} reads {', '.join(names)}, which is neither a size "
        f"nor a fact that pool {path[1]!r} is given (wspool's ops pass {', '.join(sorted(SHAPE_FACTS))}; the "
        f"device gives {', '.join(DEVICE_FACTS)}; the pool's default facts are set in pools.{path[1]}.facts)"
    )


def check_rule_facts(settings: WspoolSettings, provenance: Provenance | None = None) -> None:
    """Refuse a rule of one of :data:`OWN_POOLS` that reads a name no call, device or default supplies.

    Raises:
        ConfigError: Naming the rule's key and variable, its source and the facts that are known.
    """
    for path, source, names in unknown_rule_facts(settings):
        if path[1] in OWN_POOLS:
            where = f" (from {provenance.source_of(path)})" if provenance is not None else ""
            raise ConfigError(
                f"invalid wspool configuration: {describe_unknown_facts(path, source, names, where)}; set "
                f"{describe_setting(path)} (a size takes a unit, e.g. 256MiB), or, if a call passes {names[0]}, "
                f"give it a default in {describe_setting(('pools', path[1], 'facts', names[0]))}",
                path=path,
            )


def _fact_name(value: object) -> str:
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "Input should be a valid string")
    if not value.isidentifier() or value.startswith("_"):
        raise ValueError(f"fact name {value!r} is not a name a rule can read (letters, digits, _; no leading _)")
    if value in RESERVED_FACT_NAMES:
        raise ValueError(
            f"fact name {value!r} is reserved (it names a parameter of the per-call methods, a Python keyword "
            f"or a rule function); choose another name"
        )
    return value


def _fact_value(value: object) -> int:
    number = value
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        # 2**64 has 20 digits; a longer string need not be converted (and int() refuses 4,300 digits).
        number = int(value.strip()) if len(value.strip()) <= 20 else MAX_MAGNITUDE + 1
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise ValueError(f"a fact must be a non-negative integer, got {type(value).__name__} {quote(value)}")
    if number > MAX_MAGNITUDE:
        raise ValueError(f"a fact must be at most 2**64 (a rule refuses larger facts), got {quote(value)}")
    return number


RuleSource = Annotated[str, BeforeValidator(_rule_value)]
FactName = Annotated[str, BeforeValidator(_fact_name)]
FactValue = Annotated[int, BeforeValidator(_fact_value)]
GrowthPolicy = Annotated[str, BeforeValidator(_growth_value)]
OptionalLimit = Annotated[int | None, BeforeValidator(_limit_value)]
PoolName = Annotated[str | None, BeforeValidator(_pool_name_value)]


def _profile_value(value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in (AUTO, *PROFILE_NAMES):
        return value.strip().lower()
    raise ValueError(f"unknown profile {quote(value)} (choose {AUTO} or one of {', '.join(PROFILE_NAMES)})")


ProfileSetting = Annotated[str, BeforeValidator(_profile_value)]


def check_env_names(
    setting_names: Iterable[str] | None = None,
    extra_env_vars: Iterable[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Refuse a ``WSPOOL_*`` variable that is not in upper case, or that names no setting.

    wspool reads its variables by their exact, upper-case names, so ``wspool_config``
    would be ignored, and one setting given in two cases would be decided by the
    environment's order: such a variable is refused by name. A ``WSPOOL_*`` variable
    that names no setting would be ignored too (pydantic-settings skips it): refused.
    Components that read a ``WSPOOL_*`` variable of their own (the vLLM plugin's
    ``WSPOOL_VLLM``) call this before reading it.

    Args:
        setting_names: The top-level settings; default :class:`WspoolSettings`' fields.
        extra_env_vars: ``WSPOOL_*`` variables that are not settings but are read elsewhere;
            default :func:`all_extra_env_vars`.
        environ: The environment; default ``os.environ``.

    Raises:
        ConfigError: Naming the variable and the name to use instead.
    """
    environ = os.environ if environ is None else environ
    fields = {name.upper() for name in (WspoolSettings.model_fields if setting_names is None else setting_names)}
    extra = all_extra_env_vars() if extra_env_vars is None else tuple(extra_env_vars)
    unknown, miscased = [], []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        head, nested, _ = upper[len(ENV_PREFIX) :].partition(ENV_DELIMITER)
        known = upper in extra or (head in fields and (not nested or head == "POOLS"))
        if not known:
            unknown.append(name)
        elif name != upper:
            miscased.append(name)
    if miscased:
        raise miscased_env_vars(miscased)
    if unknown:
        raise unknown_env_vars(unknown, fields, extra)


def check_pool_names(pools: Mapping[str, PoolConfig], source_of: Any = None) -> None:
    """Refuse empty pool or rule names, and pool names that differ only in case.

    Environment variables are upper case and name pools in lower case, so
    ``WSPOOL_POOLS__MYPOOL__...`` names ``mypool``: a YAML pool ``MyPool`` next to it
    would otherwise be a second pool.
    """
    where = source_of or (lambda path: "code")
    by_folded: dict[str, str] = {}
    for name, pool in pools.items():
        if not name.strip():
            raise ConfigError(f"invalid wspool configuration: a pool name is empty ({quote(name)})", path=("pools",))
        for rule in pool.rules:
            if not rule.strip():
                path = ("pools", name, "rules")
                raise ConfigError(
                    f"invalid wspool configuration: pool {name!r} has a rule with an empty name "
                    f"({quote(rule)}, from {where(path)})",
                    path=path,
                )
        other = by_folded.setdefault(name.lower(), name)
        if other != name:
            first, second = sorted((other, name))
            raise ConfigError(
                f"invalid wspool configuration: pools {first!r} (from {where(('pools', first))}) and {second!r} "
                f"(from {where(('pools', second))}) differ only in case; environment variables name pools in "
                f"lower case ({ENV_PREFIX}POOLS{ENV_DELIMITER}{name.upper()}{ENV_DELIMITER}... is "
                f"pools.{name.lower()}), so write the pool's name in lower case",
                path=("pools", first),
            )


def check_shared_pools(settings: WspoolSettings, provenance: Provenance | None = None) -> None:
    """Refuse a ``shared_with`` that names no pool, itself, or a pool that shares yet another's buffer."""
    pools = settings.pools
    for name, pool in pools.items():
        host = pool.shared_with
        if host is None:
            continue
        target = pools.get(host)
        clash = sorted(set(pool.rules) & set(target.rules)) if target is not None else []
        if host == name:
            problem = "a pool cannot share its own buffer"
        elif target is None:
            problem = f"there is no pool {host!r} (configured: {', '.join(sorted(pools))})"
        elif target.shared_with is not None:
            problem = f"pool {host!r} itself draws from {target.shared_with!r}; name {target.shared_with!r}"
        elif {"growth", "max_bytes"} & pool.model_fields_set:
            problem = f"its buffer is {host!r}'s, so set growth and max_bytes under pools.{host}"
        elif clash:
            problem = f"both pools have a rule {clash[0]!r}, and rule names on one buffer must differ"
        else:
            continue
        path = ("pools", name, "shared_with")
        source = f" (from {provenance.source_of(path)})" if provenance is not None else ""
        raise ConfigError(
            f"invalid wspool configuration: {setting_names(path)[0]} = {host!r}{source}: {problem}; "
            f"set {describe_setting(path)} (empty: its own buffer)",
            path=path,
        )


#: The init keyword through which :func:`load_settings` hands :class:`WspoolSettings` the layers
#: below the code overrides, read once: the environment, the YAML file, the engine knobs, a profile.
LAYERS_KEYWORD = "_wspool_layers"

#: wspool's own ``WSPOOL_*`` variables that are not settings but are read elsewhere: the
#: configuration file's, and every engine's reservation ``WSPOOL_RESERVE`` and ``WSPOOL_STATS_DIR``.
#: With the engines' switches and devices (:func:`all_extra_env_vars`), any other ``WSPOOL_*``
#: variable must name a setting (a misspelt one is an error, not ignored).
EXTRA_ENV_VARS: tuple[str, ...] = (CONFIG_ENV_VAR, "WSPOOL_RESERVE", "WSPOOL_STATS_DIR")


def all_extra_env_vars() -> tuple[str, ...]:
    """Return every ``WSPOOL_*`` variable that is not a setting: :data:`EXTRA_ENV_VARS` and each engine's.

    An engine's are its switch and device variable, as its spec names them
    (:func:`~wspool.settings.profiles.engine_specs`: ``WSPOOL_VLLM``, ``WSPOOL_VLLM_DEVICE``...).
    """
    engines = (name for spec in engine_specs() for name in spec.wspool_variables)
    return (EXTRA_ENV_VARS[0], *engines, *EXTRA_ENV_VARS[1:])


#: vLLM's fixed sizes (its FlashInfer MLA backend after PR #47074): 128 MiB for plain MLA
#: decode, 256 MiB when the LSE is returned. FlashInfer paged attention (pool ``flashinfer``)
#: shares that buffer: engines run the two one after another on one stream. Its rules bound
#: the split-KV partial outputs that FlashInfer's eager plans carve (``wspool.flashinfer.paged``
#: derives them).
#: The ``flashinfer_mla`` pool's default facts are DeepSeek's and Kimi's MLA geometry, for
#: call sites that pass none (a caller's facts win). ``configs/default.yaml`` carries the
#: same values (a test keeps them equal).
VLLM_FIXED_MLA_WORKSPACE_BYTES: Mapping[str, int] = MappingProxyType({"default": 128 * MiB, "lse": 256 * MiB})
BUILTIN_DEFAULTS: dict[str, Any] = {
    "pools": {
        "flashinfer_mla": {
            "rules": {rule: format_size(nbytes) for rule, nbytes in VLLM_FIXED_MLA_WORKSPACE_BYTES.items()},
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


def __getattr__(name: str) -> Any:
    """Serve ``SEED_MLA_WORKSPACE_BYTES``, the deprecated name of :data:`VLLM_FIXED_MLA_WORKSPACE_BYTES`."""
    if name == "SEED_MLA_WORKSPACE_BYTES":
        warnings.warn(
            "wspool.settings.schema.SEED_MLA_WORKSPACE_BYTES is deprecated; use VLLM_FIXED_MLA_WORKSPACE_BYTES",
            DeprecationWarning,
            stacklevel=2,
        )
        return VLLM_FIXED_MLA_WORKSPACE_BYTES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
                # The pool's name is not known here: config_error names both full keys.
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
            variables are upper case and name pools in lower case).
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

    # What load_settings read for these settings, so profile_settings layers a profile under the same inputs.
    _load_inputs: LoadInputs | None = PrivateAttr(default=None)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Return the sources, highest precedence first: code, the layers below it, the built-in defaults.

        :func:`load_settings` reads each layer once (the environment, the YAML file,
        the engine knobs, a profile) for its provenance too, and passes them in the
        init keyword :data:`LAYERS_KEYWORD`. Settings built directly
        (``WspoolSettings()``) read the environment and the engine knobs here.
        """
        code = dict(init_settings.init_kwargs) if isinstance(init_settings, InitSettingsSource) else {}
        layers: Sequence[Mapping[str, Any]] | None = code.pop(LAYERS_KEYWORD, None)
        below_code = (
            [SettingsLayer(settings_cls, data) for data in layers]
            if layers is not None
            else [env_settings, SettingsLayer(settings_cls, engine_knob_settings())]
        )
        return (
            InitSettingsSource(settings_cls, init_kwargs=code),
            *below_code,
            SettingsLayer(settings_cls, BUILTIN_DEFAULTS),
        )


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> WspoolSettings:
    """Load and validate the configuration.

    Args:
        config_file: A YAML file, or a shipped configuration's name (``"hopper"``; a
            file of that name wins); when ``None``, the one ``WSPOOL_CONFIG`` names,
            if set. One that is neither a file nor a shipped name is an error.
        **overrides: Values given in code, highest precedence, e.g.
            ``pools={"flashinfer_mla": {"rules": {"lse": "512MiB"}}}``.

    Returns:
        The validated settings; :func:`load_settings_with_provenance` also says
        where each value came from.

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

    The profile goes under what :func:`load_settings` read for ``settings`` (the
    code overrides, the environment, the file, the engines' variables), which
    override it key by key; nothing is read again, so a file edited or deleted
    since, or an environment changed, makes no difference. Settings not built by
    :func:`load_settings` are returned as they are.

    Raises:
        ConfigError: The profile's settings do not validate with the configuration's.
    """
    inputs = settings._load_inputs
    if inputs is None:
        return settings, Provenance([Source("default", BUILTIN_DEFAULTS)])
    return _build(inputs, profile)


def _load(
    config_file: str | os.PathLike[str] | None, profile: str | None, overrides: dict[str, Any]
) -> tuple[WspoolSettings, Provenance]:
    check_env_names()
    path, how = find_config_file(config_file)
    shipped = shipped_name_of(path) if path is not None else None
    return _build(read_sources(WspoolSettings, overrides, path, how, shipped, engine_knob_layers()), profile)


def _build(inputs: LoadInputs, profile: str | None) -> tuple[WspoolSettings, Provenance]:
    """Validate the settings of ``inputs``, with ``profile``'s settings under them (``None``: none)."""
    layers = list(inputs.sources)
    if profile is not None:
        layers.append(Source("profile", load_profile(profile).settings, name=profile))
    provenance = Provenance(
        [Source("code", inputs.overrides), *layers, Source("default", BUILTIN_DEFAULTS)],
        inputs.path,
        config_how=inputs.how,
        shipped=inputs.shipped,
        environ_names=inputs.environ_names,
    )
    try:
        given: dict[str, Any] = {**inputs.overrides, LAYERS_KEYWORD: [layer.data for layer in layers]}
        settings = WspoolSettings(**given)
    except (SettingsError, RecursionError) as exc:
        raise env_error(exc) from None
    except ValidationError as exc:
        raise config_error(exc, provenance, keys_at=_schema_keys) from None
    _check_names(settings, provenance)
    check_shared_pools(settings, provenance)
    check_rule_facts(settings, provenance)
    settings._load_inputs = inputs
    return settings, provenance


def _schema_keys(parent: tuple[str, ...]) -> list[str]:
    """The keys the schema has under ``parent`` (top level, or one pool's), for an unknown key's suggestion."""
    if not parent:
        return list(WspoolSettings.model_fields)
    if len(parent) == 2 and parent[0] == "pools":
        return list(PoolConfig.model_fields)
    return []


def validate_pool(name: str, values: Mapping[str, Any], configured: WspoolSettings | None = None) -> PoolConfig:
    """Validate one pool's settings given in code exactly as a YAML file's ``pools.<name>`` is.

    Args:
        name: The pool.
        values: Its settings: a declaration's, with ``configured``'s values for this pool over it.
        configured: The loaded configuration whose values ``values`` carries; an error names
            their sources (a ``WSPOOL_*`` variable, a file), the declaration for the rest.

    Raises:
        ConfigError: Naming each offending key, as for a file.
    """
    layers = [Source("code", {"pools": {name: dict(values)}}, name="declare_pool")]
    inputs = None if configured is None else configured._load_inputs
    if inputs is not None:
        layers = [Source("code", inputs.overrides), *inputs.sources, Source("default", BUILTIN_DEFAULTS), *layers]
    names = () if inputs is None else inputs.environ_names
    provenance = Provenance(layers, None if inputs is None else inputs.path, environ_names=names)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"invalid pool name {quote(name)}: a pool name must be a non-empty string")
    try:
        pool = PoolConfig(**values)
    except ValidationError as exc:
        raise config_error(exc, provenance, prefix=("pools", name), keys_at=_schema_keys) from None
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
