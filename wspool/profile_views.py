"""Profile views: one profile's pool specs, shared buffers and staged declarations.

A registry holds one :class:`ProfileView` per profile in use; a declaration is
staged on every view and applied only once all validated it. The registry
changes a view under its own lock and swaps whole dicts, so lock-free readers
see a consistent view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from wspool.errors import ConfigError, describe_setting, unknown_pool, unknown_rule
from wspool.pool import PoolSpec
from wspool.rules import LiteralRule
from wspool.settings.schema import WspoolSettings, check_shared_pools, validate_pool
from wspool.units import format_size

__all__ = ["Declaration", "ProfileView", "check_rule_facts"]


def check_rule_facts(
    pool: str, spec: PoolSpec, rules: Iterable[str] | None, *, available: set[str], profile: str
) -> None:
    """Check that ``rules`` of ``pool`` (``None``: all) read only ``available`` facts, else name the setting."""
    for rule in sorted(spec.rules) if rules is None else rules:
        compiled = spec.rules.get(rule)
        if compiled is None:
            raise unknown_rule(pool, rule, spec.rules)
        missing = [name for name in compiled.names if name not in available]
        if missing:
            keys = ", ".join(describe_setting(("pools", pool, "facts", name)) for name in missing)
            raise ConfigError(
                f"rule {describe_setting(('pools', pool, 'rules', rule))} = {compiled.source!r} (profile "
                f"{profile}) needs fact(s) {', '.join(missing)}, which this call site does not pass "
                f"and no default supplies; set {keys}",
                path=("pools", pool, "facts", missing[0]),
            )


class Declaration(NamedTuple):
    """A pool declaration staged for one profile view: applied only once every view validated it."""

    spec: PoolSpec  # what declare_pool returns
    specs: dict[str, PoolSpec] | None  # the view's new specs; None: nothing changes
    host: str  # the pool whose buffer it draws from
    linked: PoolSpec | None  # the host buffer's new spec, when it is shared


def _build_declaration(
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

    ``replay`` replays an earlier declaration on a new view, where pools in use are no obstacle.
    """
    values: dict[str, Any] = {**declared, "rules": dict(declared["rules"])}
    configured = settings.pools.get(name)
    if configured is not None:
        values["rules"].update(configured.rules)
        for key in ("growth", "max_bytes"):
            if key in configured.model_fields_set:
                values[key] = getattr(configured, key)
    # Validated as YAML is (max_bytes 0, a fixed rule above max_bytes, growth's case).
    validated = validate_pool(name, values, settings)
    spec = PoolSpec(
        name, validated.rules, validated.growth, validated.max_bytes, facts=configured.facts if configured else None
    )
    host = hosts.get(name, name)
    if host != name and (declared.get("max_bytes") is not None or declared.get("growth", "exact") != "exact"):
        raise ConfigError(
            f"declare_pool({name!r}): pool {name!r} draws from {host!r}'s buffer (pools.{name}.shared_with), "
            f"whose cap and growth are {describe_setting(('pools', host, 'max_bytes'))} and "
            f"{describe_setting(('pools', host, 'growth'))}; declare them there",
            path=("pools", name, "max_bytes"),
        )
    current = specs.get(name)
    if not replay and current is not None and host_in_use(host):
        _check_unchanged(name, current, spec)
        return Declaration(current, None, host, None)
    new_specs = {**specs, name: spec}
    # May raise: nothing is set yet.
    linked = _linked_spec(host, new_specs, hosts, spec_of) if host in shared_hosts else None
    if linked is not None:
        _check_guest_literals(linked)  # the check a YAML file gets at load
    return Declaration(spec, new_specs, host, linked)


def _check_unchanged(name: str, current: PoolSpec, spec: PoolSpec) -> None:
    """Refuse a declaration of a pool in use that changes its rules, cap or growth (its buffers keep those in force)."""
    if {k: r.source for k, r in current.rules.items()} != {k: r.source for k, r in spec.rules.items()}:
        raise ConfigError(f"pool {name!r} is in use; declare it before its first request", path=("pools", name))
    for key in ("max_bytes", "growth"):
        was, given = getattr(current, key), getattr(spec, key)
        if was != given:
            shown = [("none" if v is None else format_size(v)) if key == "max_bytes" else v for v in (was, given)]
            raise ConfigError(
                f"pool {name!r} is in use: this declaration would change {describe_setting(('pools', name, key))} "
                f"from {shown[0]} to {shown[1]}, and its buffers keep the {key} in force; declare the pool before "
                f"its first request, set the key in the configuration, or reset() the registry first",
                path=("pools", name, key),
            )


def _linked_spec(
    host: str, specs: Mapping[str, PoolSpec], hosts: Mapping[str, str], spec_of: Callable[[str], PoolSpec]
) -> PoolSpec:
    """Return the spec of ``host``'s buffer: its own rules and those of the pools that share it (names unique)."""
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


def _check_guest_literals(buffer: PoolSpec) -> None:
    """Raise a ConfigError naming both keys for a fixed rule a guest brings to ``buffer`` above its ``max_bytes``."""
    for rule, compiled in buffer.rules.items():
        owner = buffer.rule_pools.get(rule, buffer.name)
        if owner == buffer.name or buffer.max_bytes is None or not isinstance(compiled, LiteralRule):
            continue
        if compiled.nbytes > buffer.max_bytes:
            raise ConfigError(
                f"{describe_setting(('pools', owner, 'rules', rule))} = {compiled.source!r} is above "
                f"{describe_setting(('pools', buffer.name, 'max_bytes'))} = {buffer.max_bytes}, the cap of the buffer "
                f"it shares (pools.{owner}.shared_with = {buffer.name}), so it could never be served; lower the rule "
                f"or raise the cap",
                path=("pools", owner, "rules", rule),
            )


class ProfileView:
    """One profile's configuration of a registry's pools: its settings, specs and shared buffers."""

    def __init__(self, settings: WspoolSettings) -> None:
        self.settings = settings
        self.specs: dict[str, PoolSpec] = {
            name: PoolSpec(name, pool.rules, pool.growth, pool.max_bytes, facts=pool.facts)
            for name, pool in settings.pools.items()
        }
        check_shared_pools(settings)
        # A pool configured with shared_with draws from its host's buffer, whose spec
        # carries the rules of both (self.specs keeps each pool's own).
        self.hosts = {name: p.shared_with for name, p in settings.pools.items() if p.shared_with}
        self.buffer_specs: dict[str, PoolSpec] = {}
        for host in sorted(set(self.hosts.values())):
            self.buffer_specs[host] = _linked_spec(host, self.specs, self.hosts, self.spec)
            _check_guest_literals(self.buffer_specs[host])

    def spec(self, pool: str) -> PoolSpec:
        """Return ``pool``'s own configuration under this profile."""
        spec = self.specs.get(pool)
        if spec is None:
            raise unknown_pool(pool, self.specs)
        return spec

    def buffer_spec(self, host: str) -> PoolSpec:
        """Return the spec of ``host``'s buffer: its own, or with the rules of the pools that share it."""
        return self.buffer_specs.get(host) or self.spec(host)

    def stage(
        self, name: str, declared: Mapping[str, Any], host_in_use: Callable[[str], bool], replay: bool = False
    ) -> Declaration:
        """Build this view's spec for a declaration, validated as YAML is; change nothing."""
        return _build_declaration(
            name,
            declared,
            settings=self.settings,
            specs=self.specs,
            hosts=self.hosts,
            shared_hosts=self.buffer_specs,
            host_in_use=host_in_use,
            spec_of=self.spec,
            replay=replay,
        )

    def apply(self, change: Declaration) -> None:
        """Install a staged declaration; swapping whole dicts keeps lock-free readers consistent."""
        if change.specs is None:
            return
        self.specs = change.specs
        if change.linked is not None:
            self.buffer_specs = {**self.buffer_specs, change.host: change.linked}
