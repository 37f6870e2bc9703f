"""The ``wspool`` commands that inspect or exercise the configuration: show, resolve, stats and demo.

``show``, ``resolve`` and ``stats`` allocate no device memory (``stats`` uses the
meta device); every value they print names its origin. Each returns the exit
status; bad input raises for :func:`wspool.cli.main` to report.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from wspool.cli import UsageError, wrap
from wspool.errors import describe_setting, printable, quote, setting_names
from wspool.settings.schema import (
    OWN_POOLS,
    Provenance,
    WspoolSettings,
    describe_unknown_facts,
    iter_settings,
    load_settings_with_provenance,
    profile_settings,
    unknown_rule_facts,
)
from wspool.units import format_size

if TYPE_CHECKING:  # the registry imports torch: each command imports it when it runs
    from wspool.registry import PoolRegistry

__all__ = [
    "DECLARED_INT_RULES",
    "cmd_demo",
    "cmd_plan",
    "cmd_resolve",
    "cmd_show",
    "cmd_stats",
    "config_line",
    "setting_rows",
]

#: The origin of a ``pools.flashinfer_int`` rule no source configures: wspool declares it in code.
DECLARED_INT_RULES = "wspool's default for FlashInfer wrappers' int workspaces (declared in code)"


def _show_devices() -> list[str]:
    """The devices ``show`` reports: every CUDA device, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    return ["cpu"]


def config_line(provenance: Provenance) -> str:
    """Say which configuration file is active and how it was named (``show`` and ``doctor``)."""
    if provenance.config_file is None:
        return "config file: none (built-in defaults, WSPOOL_* variables and engines' variables)"
    how = provenance.config_how.split(":")[0]
    if provenance.shipped is not None:
        return f"config file: shipped configuration {provenance.shipped} ({how}; {provenance.config_file})"
    return f"config file: {printable(str(provenance.config_file))} ({how})"


def setting_rows(settings: WspoolSettings, provenance: Provenance) -> list[dict[str, Any]]:
    """Every value of ``settings`` with its source, and what it overrides where an engine's variable is involved."""
    return [
        {
            "key": ".".join(path),
            "value": value,
            "source": provenance.source_of(path),
            "overrides": [{"source": label, "value": lower} for label, lower in provenance.overridden(path)],
        }
        for path, value in iter_settings(settings)
    ]


def cmd_show(args: argparse.Namespace) -> int:
    """``wspool show``: the effective settings per profile, with where each value came from."""
    from wspool.registry import PoolRegistry

    given, provenance = load_settings_with_provenance(args.config)
    registry = PoolRegistry(given)
    devices: list[dict[str, Any]] = []
    for device in _show_devices():
        choice = registry.profile_of(device)
        facts = dict(registry.device_facts(device))
        devices.append({"device": device, "profile": choice.profile, "reason": choice.reason, "facts": facts})
    # Each profile's settings once, in the order the devices name them.
    profiles: dict[str, tuple[WspoolSettings, Provenance]] = {}
    for entry in devices:
        if entry["profile"] not in profiles:
            profiles[entry["profile"]] = profile_settings(given, entry["profile"])
    warnings = _fact_warnings(profiles.values())
    int_workspaces = _int_workspaces(registry, devices[0]["device"], profiles[devices[0]["profile"]][1])
    tables = {name: setting_rows(settings, prov) for name, (settings, prov) in profiles.items()}
    if args.json:
        data = {
            "config_file": str(provenance.config_file) if provenance.config_file is not None else None,
            "config_named": provenance.config_how,
            "shipped_config": provenance.shipped,
            "profile": {"value": given.profile, "source": provenance.source_of(("profile",))},
            "devices": devices,
            "settings": tables[devices[0]["profile"]],
            "profiles": tables,
            "warnings": warnings,
            "int_workspaces": int_workspaces,
        }
        print(json.dumps(data, indent=2))
        return 0
    for warning in warnings:
        print(f"wspool show: warning: {printable(warning)}", file=sys.stderr)  # one line, as errors are
    print(wrap(config_line(provenance)))
    print(wrap(f"profile: {printable(given.profile)} (from {printable(provenance.source_of(('profile',)))})"))
    from wspool.settings.profiles import load_profile

    for entry in devices:
        shown = ", ".join(f"{k}={v}" for k, v in entry["facts"].items()) or "none (not a GPU)"
        print(
            wrap(
                f"device {entry['device']}: profile {entry['profile']} ({printable(entry['reason'])}); "
                f"device facts: {shown}"
            )
        )
    for name in profiles:
        print(wrap(f"profile {name}: {load_profile(name).description}"))
    print(
        wrap(
            f"FlashInfer wrappers' int workspaces: {printable(int_workspaces['mla'])}; paged wrappers take "
            "theirs through reset_workspace_buffer"
        )
    )
    for rule, entry in int_workspaces["rules"].items():
        print(wrap(f"  pools.flashinfer_int.rules.{rule} = {printable(entry['value'])} (from {entry['source']})"))
    for name, rows in tables.items():
        print(f"settings under profile {name}:")
        for row in rows:
            print(wrap(f"{printable(row['key'])} = {_show_value(row['key'], row['value'])} (from {_origin(row)})"))
    return 0


def _origin(row: dict[str, Any]) -> str:
    """A row's source, with what it overrides: ``YAML file c.yaml, over vLLM's variable VLLM_... = 1073741824``."""
    over = ", ".join(f"{o['source']} = {quote(o['value'])}" for o in row["overrides"])
    return printable(f"{row['source']}, over {over}" if over else row["source"])


def _int_workspaces(registry: PoolRegistry, device: str, provenance: Provenance) -> dict[str, Any]:
    """Whether MLA wrappers take wspool's int workspaces here (or why FlashInfer fails to import), and their rules."""
    from wspool.flashinfer import wrapper_buffers

    wrapper_buffers.declare_int_pool(registry)
    rules = registry.spec(wrapper_buffers.INT_POOL, device).rules
    listed = {
        name: {"value": str(rule.source), "source": _rule_origin(provenance, (wrapper_buffers.INT_POOL, name))}
        for name, rule in sorted(rules.items())
    }
    try:
        status = wrapper_buffers.mla_hook_status()
    except Exception as exc:  # FlashInfer's own import can raise anything; show still shows the configuration
        why = " ".join(str(exc).split()) or "no message"
        status = f"FlashInfer could not be loaded ({type(exc).__name__}: {why})"
    return {"mla": status, "rules": listed}


def _rule_origin(provenance: Provenance, pool_rule: tuple[str, str]) -> str:
    """Where a rule came from: a configured source, or wspool's declaration in code (pool ``flashinfer_int``)."""
    path = ("pools", pool_rule[0], "rules", pool_rule[1])
    if provenance.givers(path):
        return provenance.explain(path)
    from wspool.flashinfer.wrapper_buffers import INT_POOL

    return DECLARED_INT_RULES if pool_rule[0] == INT_POOL else "declared in code"


def _fact_warnings(profiles: Iterable[tuple[WspoolSettings, Provenance]]) -> list[str]:
    """One line per rule of a pool wspool does not own reading a fact nothing known supplies (flagged, not refused)."""
    lines: dict[tuple[str, ...], str] = {}
    for settings, provenance in profiles:
        for path, source, names in unknown_rule_facts(settings):
            if path[1] in OWN_POOLS or path in lines:
                continue
            where = f" (from {provenance.source_of(path)})"
            facts = describe_setting(("pools", path[1], "facts", names[0]))
            lines[path] = (
                f"{describe_unknown_facts(path, source, names, where)}: it resolves only for calls that pass "
                f"{', '.join(names)} (a backend that declares pool {path[1]!r} in code may); give a default in "
                f"{facts}, or fix {describe_setting(path)}"
            )
    return list(lines.values())


def _show_value(key: str, value: object) -> str:
    if key.endswith(".max_bytes") and isinstance(value, int):
        return f"{value} ({format_size(value)})"
    return printable(str(value))


def _registry(config: str | None) -> tuple[PoolRegistry, WspoolSettings]:
    """The registry ``resolve`` and ``demo`` use: the configuration, and the int pool wspool declares in code.

    So every pool ``show`` lists (``flashinfer_int`` included) resolves here too.
    """
    from wspool.flashinfer import wrapper_buffers
    from wspool.registry import PoolRegistry

    settings, _ = load_settings_with_provenance(config)
    registry = PoolRegistry(settings)
    wrapper_buffers.declare_int_pool(registry)
    return registry, settings


def cmd_resolve(args: argparse.Namespace) -> int:
    """``wspool resolve``: the size a call would get, its rule and each fact the rule read, with their origins."""
    from wspool.devices import resolve_device
    from wspool.registry import check_given_facts

    registry, settings = _registry(args.config)
    given = dict(args.fact or [])
    device = resolve_device(args.device)
    choice = registry.profile_of(device)
    _, provenance = profile_settings(settings, choice.profile)
    rule = _rule_of(registry, args.pool, args.rule, device, provenance)
    check_given_facts(registry.spec(args.pool, device), args.rule, given)  # a typo before a missing fact
    facts = _facts_read(registry, args.pool, rule, device, given, provenance)
    nbytes = registry.resolve(args.pool, args.rule, device=device, **given)
    unread = {name: value for name, value in given.items() if name not in rule.names}
    origin = _rule_origin(provenance, (args.pool, args.rule))
    key, variable = setting_names(("pools", args.pool, "rules", args.rule))
    if args.json:
        print(
            json.dumps(
                {
                    "pool": args.pool,
                    "rule": args.rule,
                    "bytes": nbytes,
                    "size": format_size(nbytes),
                    "rule_source": str(rule.source),
                    "source": origin,
                    "key": key,
                    "variable": variable,
                    "device": str(device),
                    "profile": choice.profile,
                    "profile_reason": choice.reason,
                    "facts": facts,
                    "unread_facts": unread,
                },
                indent=2,
            )
        )
    elif args.bytes:
        print(nbytes)
    else:
        print(f"{args.pool}.{args.rule} = {nbytes} bytes ({format_size(nbytes)})")
        print(wrap(f"  rule {printable(repr(rule.source))}, from {printable(origin)}"))
        for name, fact in facts.items():
            print(wrap(f"  fact {name} = {fact['value']} (from {printable(fact['source'])})"))
        if not facts:
            print("  facts: none (the rule is a fixed size)")
        if unread:
            shown = ", ".join(f"{name}={value}" for name, value in unread.items())
            print(wrap(f"  given, but not read by this rule: {shown}"))
        chosen = "--device" if args.device is not None else "the current device"
        print(wrap(f"  on {device} ({chosen}), profile {choice.profile} ({printable(choice.reason)})"))
        print(wrap(f"  set {key} / {variable}"))
    return 0


def _rule_of(registry: PoolRegistry, pool: str, rule: str, device: Any, provenance: Provenance) -> Any:
    """Return ``pool``'s compiled ``rule``; an unknown one names the shipped configuration that defines it."""
    from wspool.errors import ConfigError, unknown_rule
    from wspool.settings.profiles import shipped_configs_defining

    try:
        spec = registry.spec(pool, device)
        found = spec.rules.get(rule)
        if found is None:
            raise unknown_rule(pool, rule, spec.rules)
        return found
    except ConfigError as exc:
        asked = rule if pool in registry.pool_names() else None  # an unknown pool: a configuration that has it
        shipped = [name for name in shipped_configs_defining(pool, asked) if name != provenance.shipped]
        if not shipped:
            raise
        which = " or ".join(f"--config {name}" for name in shipped)
        raise UsageError(f"{exc}; or take the shipped configuration that defines it: {which}") from None


def _facts_read(
    registry: PoolRegistry, pool: str, rule: Any, device: Any, given: dict[str, int], provenance: Provenance
) -> dict[str, dict[str, Any]]:
    """Each fact ``rule`` reads, with its value and where it came from: --fact, a default fact's source, the device.

    A fact nothing supplies is a :class:`UsageError` naming ``--fact`` and the default fact that gives it.
    """
    spec = registry.spec(pool, device)
    device_facts = registry.device_facts(device)
    read: dict[str, dict[str, Any]] = {}
    missing = []
    for name in rule.names:
        if name in given:
            read[name] = {"value": given[name], "source": "--fact"}
        elif name in spec.facts:
            path = ("pools", pool, "facts", name)
            source = provenance.explain(path) if provenance.givers(path) else "declared in code"
            read[name] = {"value": spec.facts[name], "source": source}
        elif name in device_facts:
            read[name] = {"value": device_facts[name], "source": f"device {device}"}
        else:
            missing.append(name)
    if missing:
        from wspool.rules import rule_label
        from wspool.settings.schema import DEVICE_FACTS

        supplied = ", ".join(sorted({*given, *spec.facts, *device_facts})) or "none"
        flags = " ".join(f"--fact {name}=VALUE" for name in missing)
        defaults = " or ".join(describe_setting(("pools", pool, "facts", name)) for name in missing)
        on_device = [name for name in missing if name in DEVICE_FACTS]
        device_note = f" ({', '.join(on_device)}: a CUDA device gives it, {device} does not)" if on_device else ""
        raise UsageError(
            f"rule {rule_label(rule.setting, rule.source)} needs fact(s) {', '.join(missing)} that the call did not "
            f"supply (supplied: {supplied}){device_note}; give {'it' if len(missing) == 1 else 'them'} with "
            f"{flags}, or set a default fact: {defaults}"
        )
    return read


def cmd_plan(args: argparse.Namespace) -> int:
    """``wspool plan``: each rule's bound over the limits, the facts that give it, and how it was found."""
    from wspool.bounds import parse_limit, plan_reservation
    from wspool.devices import resolve_device

    limits = dict(parse_limit(text) for text in args.limit or [])
    registry, _ = _registry(args.config)
    device = resolve_device(args.device)
    for name in args.pool or []:
        registry.spec(name)  # an unknown pool is the error naming the pools there are
    _check_fact_names(registry, dict(args.fact or []), "--fact", device)
    _check_fact_names(registry, limits, "--limit", device)
    plan = plan_reservation(
        registry, limits, pools=args.pool, devices=[device], lanes=args.lane or ["main"], facts=dict(args.fact or [])
    )
    if args.json:
        print(json.dumps({"device": str(device), "profile": registry.profile_of(device).profile, **plan.as_dict()}))
        return 1 if plan.refusals else 0
    shown = ", ".join(f"{name}={limit.describe()}" for name, limit in plan.limits.items()) or "none"
    print(wrap(f"limits: {shown}; on {device}, profile {registry.profile_of(device).profile}; nothing is allocated"))
    for row in plan.rows:
        where = f"{row.pool}.{row.rule} on {row.device} lane {row.lane}"
        if row.bound is None:
            print(wrap(f"{where}: refused: {printable(str(row.refusal))}"))
            continue
        bound = row.bound
        at = ", ".join(f"{k}={v}" for k, v in sorted(bound.facts.items())) or "any facts"
        how = bound.method + (f" over {bound.points} points ({', '.join(bound.searched)})" if bound.searched else "")
        print(wrap(f"{where}: {bound.nbytes} bytes ({format_size(bound.nbytes)}), {how}, at {at}"))
    for (name, buffer_device, lane), nbytes in plan.buffers.items():
        print(f"buffer {name} on {buffer_device} lane {lane}: {nbytes} bytes ({format_size(nbytes)})")
    print(f"total: {plan.total_bytes} bytes ({format_size(plan.total_bytes)})")
    return 1 if plan.refusals else 0


def cmd_stats(args: argparse.Namespace) -> int:
    """``wspool stats``: what the pools would hold for given facts (a dry run on the meta device), or ``--from DIR``."""
    if getattr(args, "from_dir", None):
        return _stats_from(args.from_dir, args.json)
    from wspool.devices import describe_device, resolve_device
    from wspool.memory import dry_run, memory_summary
    from wspool.registry import PoolRegistry
    from wspool.settings.schema import load_settings

    # The meta device stands in for the current one: its profile and device facts size the rules.
    current = resolve_device(None)
    registry = PoolRegistry(
        load_settings(args.config), describe_device=lambda d: describe_device(current if d.type == "meta" else d)
    )
    facts = dict(args.fact or [])
    _check_fact_names(registry, facts, "--fact", "meta")
    data = dry_run(registry, facts, device="meta")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    choice = registry.profile_of("meta")
    print(
        wrap(
            f"every rule requested once with these facts, on the meta device (nothing is allocated), as "
            f"{current} (profile {choice.profile}: {choice.reason}):"
        )
    )
    print(memory_summary(registry))
    print(
        f"held: {format_size(data['held_bytes'])}; with a buffer per pool (no shared_with): "
        f"{format_size(data['separate_bytes'])}"
    )
    for key, why in data["skipped"].items():
        print(wrap(f"skipped {key} (give its facts with --fact NAME=VALUE): {why}"))
    return 0


def _stats_from(folder: str, as_json: bool) -> int:
    """``wspool stats --from DIR``: each rank's snapshots (after reserving, after capture, at exit), then totals."""
    from wspool.integrations.reserving import read_snapshots

    ranks = read_snapshots(folder)
    latest = []
    for rank in ranks:
        events = rank["events"]
        latest.append(events[max(events, key=lambda e: events[e].get("time", 0))] if events else {})
    total = {
        "capacity_bytes": sum(p["capacity_bytes"] for s in latest for p in s.get("pools", [])),
        "grow_count": sum(p["grow_count"] for s in latest for p in s.get("pools", [])),
        "refused_count": sum(p["refused_count"] for s in latest for p in s.get("pools", [])),
        "ranks": len(ranks),
    }
    if as_json:
        print(json.dumps({"ranks": ranks, "total": total}, indent=2))
        return 0
    for rank in ranks:
        print(f"rank {rank.get('rank')} (pid {rank.get('pid')}):")
        for event, snap in sorted(rank["events"].items(), key=lambda item: item[1].get("time", 0)):
            pools = snap.get("pools", [])
            held = sum(p["capacity_bytes"] for p in pools)
            own = f"; the engine's constants: {format_size(snap['engine_bytes'])}" if "engine_bytes" in snap else ""
            print(f"  {event}: {format_size(held)} held in {len(pools)} pool(s){own}")
            for p in pools:
                print(
                    wrap(
                        f"    {p['pool']} on {p['device']} lane {p['lane']}: {format_size(p['capacity_bytes'])}, "
                        f"peak request {format_size(p['peak_request_bytes'])}, {p['request_count']} requests, "
                        f"{p['grow_count']} grows, {p['refused_count']} refused",
                        "      ",
                    )
                )
    print(
        f"total over {total['ranks']} rank(s), each at its latest snapshot: {format_size(total['capacity_bytes'])} "
        f"held, {total['grow_count']} grows, {total['refused_count']} refused"
    )
    return 0


def _check_fact_names(registry: PoolRegistry, facts: Mapping[str, object], option: str, device: Any) -> None:
    """Refuse a negative fact, or a fact name no rule of any pool reads (a typo would otherwise be ignored).

    A negative value is refused before any rule sees it, as ``resolve`` and a default fact in
    YAML or ``WSPOOL_*`` refuse it, rather than the dry run skipping the rules that read it.
    """
    import difflib

    from wspool.settings.schema import DEVICE_FACTS, SHAPE_FACTS

    for name, value in sorted(facts.items()):
        if isinstance(value, int) and value < 0:
            raise UsageError(f"{option} {name}={value} is negative: a fact is a non-negative integer")
    read: set[str] = set()
    for name in registry.pool_names():
        spec = registry.spec(name, device)
        read.update(spec.facts, *(rule.names for rule in spec.rules.values()))
    for name in sorted(facts):
        if name not in read and name not in SHAPE_FACTS and name not in DEVICE_FACTS:
            close = difflib.get_close_matches(name, sorted({*read, *SHAPE_FACTS, *DEVICE_FACTS}), n=1, cutoff=0.75)
            raise UsageError(
                f"{option} {name}: no rule of any pool reads {name!r}, so it would be ignored (the rules read "
                f"{', '.join(sorted(read)) or 'no fact'})" + (f"; did you mean {close[0]!r}?" if close else "")
            )


def cmd_demo(args: argparse.Namespace) -> int:
    """``wspool demo``: MLA decode through the pool, checked; refused, as ``resolve`` is, where a fact is missing."""
    from wspool.devices import resolve_device
    from wspool.flashinfer.backends import call_facts
    from wspool.flashinfer.mla import MLA_POOL
    from wspool.settings.schema import DEVICE_FACTS
    from wspool.tools.demo import run_demo

    registry, _ = _registry(args.config)
    device = resolve_device(args.device)
    # The demo's calls pass their shape; the device facts come from the device, as for `resolve`. A rule
    # that reads one this device lacks (sm_count on the CPU under --config hopper) is refused here with
    # resolve's error, rather than sized for a stand-in.
    shape = call_facts(
        batch_size=1, q_len=1, num_heads=1, max_seq_len=1, page_size=64, dtype_bytes=2, sm_count=0, cp_world=None
    )
    for name in DEVICE_FACTS:
        shape.pop(name, None)
    for rule in ("default", "lse"):
        registry.resolve(MLA_POOL, rule, device=device, **shape)
    return 0 if run_demo(registry, device, echo=lambda line: print(wrap(line))) else 1
