"""Checks of a pool's name, rules and facts, and the errors that name the setting to fix.

The cold side of a registry's lookups: a lookup that misses builds its error
here, and a call site checks its rules' facts here once at load time. Nothing
here allocates or touches a device. Thread semantics: pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable

from wspool.errors import ConfigError, describe_setting
from wspool.pool_spec import PoolSpec

__all__ = ["check_rule_facts", "unknown_pool", "unknown_rule"]


def unknown_pool(pool: str, known: Iterable[str]) -> ConfigError:
    """The error for a pool that is neither configured nor declared, naming where to define it."""
    listed = ", ".join(sorted(known)) or "none"
    return ConfigError(
        f"unknown pool {pool!r} (configured: {listed}); define pools.{pool}.rules in the YAML "
        f"file or WSPOOL_POOLS__{pool.upper()}__RULES__DEFAULT",
        path=("pools", pool),
    )


def unknown_rule(pool: str, rule: str, spec: PoolSpec) -> ConfigError:
    """The error for a rule ``pool`` does not have, naming its rules and the setting to add."""
    known = ", ".join(sorted(spec.rules)) or "none"
    return ConfigError(
        f"pool {pool!r} has no rule {rule!r} (rules: {known}); set {spec.setting('rules', rule)}",
        path=("pools", pool, "rules", rule),
    )


def check_rule_facts(
    pool: str, spec: PoolSpec, rules: Iterable[str] | None, *, available: set[str], profile: str
) -> None:
    """Check that ``rules`` of ``pool`` (``None``: all) read only ``available`` facts.

    Raises:
        ConfigError: A rule is unknown, or reads a fact that is not available; the
            message names ``pools.<pool>.facts.<name>`` / ``WSPOOL_POOLS__<POOL>__FACTS__<NAME>``.
    """
    for rule in sorted(spec.rules) if rules is None else rules:
        compiled = spec.rules.get(rule)
        if compiled is None:
            raise ConfigError(
                f"pool {pool!r} has no rule {rule!r} (rules: {', '.join(sorted(spec.rules))}); "
                f"set {spec.setting('rules', rule)}",
                path=("pools", pool, "rules", rule),
            )
        missing = [name for name in compiled.names if name not in available]
        if missing:
            keys = ", ".join(describe_setting(("pools", pool, "facts", name)) for name in missing)
            raise ConfigError(
                f"rule {describe_setting(('pools', pool, 'rules', rule))} = {compiled.source!r} (profile "
                f"{profile}) needs fact(s) {', '.join(missing)}, which this call site does not pass "
                f"and no default supplies; set {keys}",
                path=("pools", pool, "facts", missing[0]),
            )
