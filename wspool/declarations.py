"""Pool declarations and shared buffers: the specs a registry serves, built and validated before any is set.

A backend declares its pool with default rules below the configuration
(:meth:`wspool.registry.PoolRegistry.declare_pool`); a pool configured with
``shared_with`` draws from its host's buffer, whose spec carries the rules of
both. Both are built here as plain values, validated as YAML is, so a
declaration that fails changes nothing. Nothing here allocates or touches a
device. Thread semantics: pure functions; the registry calls them under its
lock and swaps in the results whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from wspool.errors import ConfigError, describe_setting
from wspool.pool_spec import PoolSpec
from wspool.settings.config import WspoolSettings, validate_pool

__all__ = ["Declaration", "linked_spec", "stage_declaration"]


class Declaration(NamedTuple):
    """A pool declaration staged for one profile view: applied only once every view validated it."""

    spec: PoolSpec  # what declare_pool returns
    specs: dict[str, PoolSpec] | None  # the view's new specs; None: nothing changes
    host: str  # the pool whose buffer it draws from
    linked: PoolSpec | None  # the host buffer's new spec, when it is shared


def stage_declaration(
    name: str,
    declared: Mapping[str, Any],
    *,
    settings: WspoolSettings,
    specs: Mapping[str, PoolSpec],
    hosts: Mapping[str, str],
    shared_hosts: Mapping[str, PoolSpec],
    host_in_use: Callable[[str], bool],
    spec_of: Callable[[str], PoolSpec],
    replay: bool = False,
) -> Declaration:
    """Build one profile view's spec for a declaration, validated as YAML is; change nothing.

    Args:
        name: The declared pool.
        declared: Its ``rules``, ``growth`` and ``max_bytes`` as declared.
        settings: The view's settings (configured values override the declared ones rule by rule).
        specs: The view's current specs, by pool.
        hosts: Each ``shared_with`` pool's host.
        shared_hosts: The current spec of each shared buffer, by host.
        host_in_use: Whether a pool instance of that host exists already.
        spec_of: The view's spec of a pool (raises for an unknown one).
        replay: Replaying an earlier declaration on a new view (in-use pools are no obstacle).

    Raises:
        ConfigError: A declared rule is invalid, or the pool is in use with other rules.
    """
    values: dict[str, Any] = {**declared, "rules": dict(declared["rules"])}
    configured = settings.pools.get(name)
    if configured is not None:
        values["rules"].update(configured.rules)
        for key in ("growth", "max_bytes"):
            if key in configured.model_fields_set:
                values[key] = getattr(configured, key)
    # Validated as YAML is (max_bytes 0, a fixed rule above max_bytes, growth's case).
    validated = validate_pool(name, values)
    spec = PoolSpec(
        name, validated.rules, validated.growth, validated.max_bytes, facts=configured.facts if configured else None
    )
    host = hosts.get(name, name)
    current = specs.get(name)
    if not replay and current is not None and host_in_use(host):
        if {k: r.source for k, r in current.rules.items()} != {k: r.source for k, r in spec.rules.items()}:
            raise ConfigError(f"pool {name!r} is in use; declare it before its first request")
        return Declaration(current, None, host, None)
    new_specs = {**specs, name: spec}
    # May raise: nothing is set yet.
    linked = linked_spec(host, new_specs, hosts, spec_of) if host in shared_hosts else None
    return Declaration(spec, new_specs, host, linked)


def linked_spec(
    host: str, specs: Mapping[str, PoolSpec], hosts: Mapping[str, str], spec_of: Callable[[str], PoolSpec]
) -> PoolSpec:
    """Return the spec of ``host``'s buffer: its own rules and those of the pools that share it.

    Raises:
        ConfigError: Two pools sharing the buffer have a rule of the same name.
    """
    own = specs[host] if host in specs else spec_of(host)
    rules: dict[str, str | int] = {rule: compiled.source for rule, compiled in own.rules.items()}
    owners: dict[str, str] = {}
    facts: dict[str, Mapping[str, int]] = {}
    for guest in sorted(g for g, h in hosts.items() if h == host):
        facts.update(dict.fromkeys(specs[guest].rules, specs[guest].facts))
        for rule, compiled in specs[guest].rules.items():
            if rule in rules:
                raise ConfigError(
                    f"pools {guest!r} and {host!r} share one buffer (pools.{guest}.shared_with) and both "
                    f"have a rule {rule!r}; rename one, or set {describe_setting(('pools', guest, 'shared_with'))} "
                    f"empty to give {guest!r} its own buffer",
                    path=("pools", guest, "rules", rule),
                )
            rules[rule] = compiled.source
            owners[rule] = guest
    return PoolSpec(host, rules, own.growth, own.max_bytes, rule_pools=owners, facts=own.facts, rule_facts=facts)
