"""Checks across the settings that no single value's type makes: names and shared buffers.

Unknown ``WSPOOL_*`` variables, empty pool or rule names, pool names that
differ only in case, and ``shared_with`` links that name no pool, a pool's
own buffer or a chain. Each raises a :class:`~wspool.errors.ConfigError`
naming the setting and where its value came from. Pure checks; only
:func:`check_env_names` reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from wspool.errors import ENV_DELIMITER, ENV_PREFIX, ConfigError, describe_setting, printable, setting_names
from wspool.settings.forensics import MAX_REPORTED_ERRORS, quote

if TYPE_CHECKING:
    from wspool.settings.config import PoolConfig, WspoolSettings
    from wspool.settings.provenance import Provenance

__all__ = ["check_env_names", "check_pool_names", "check_shared_pools"]


def check_env_names(setting_names: Iterable[str], extra_env_vars: Iterable[str]) -> None:
    """Refuse a ``WSPOOL_*`` variable that names no setting (pydantic-settings would ignore it).

    Args:
        setting_names: The top-level settings.
        extra_env_vars: ``WSPOOL_*`` variables that are not settings but are read elsewhere.
    """
    extra = tuple(extra_env_vars)
    fields = {name.upper() for name in setting_names}
    unknown = []
    for name in sorted(os.environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in extra:
            continue
        head, nested, _ = upper[len(ENV_PREFIX) :].partition(ENV_DELIMITER)
        if head not in fields or (nested and head != "POOLS"):
            unknown.append(name)
    if unknown:
        known = ", ".join([*extra, *(f"{ENV_PREFIX}{f}" for f in sorted(fields))])
        shown = ", ".join(printable(n) for n in unknown[:MAX_REPORTED_ERRORS])
        more = f" and {len(unknown) - MAX_REPORTED_ERRORS} more" if len(unknown) > MAX_REPORTED_ERRORS else ""
        raise ConfigError(
            f"unknown environment variable(s) {shown}{more}: no wspool setting has that name "
            f"(check the spelling; the variables are {known}, and pools are set through "
            f"{ENV_PREFIX}POOLS{ENV_DELIMITER}<POOL>{ENV_DELIMITER}<KEY>)",
            path=(unknown[0][len(ENV_PREFIX) :].lower(),),
        )


def check_pool_names(pools: Mapping[str, PoolConfig], source_of: Any = None) -> None:
    """Refuse empty pool or rule names, and pool names that differ only in case.

    Environment variables are matched case-insensitively, so ``WSPOOL_POOLS__MYPOOL__...``
    names ``mypool``: a YAML pool ``MyPool`` next to it would otherwise be a second pool.
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
