"""The ``wspool`` commands that inspect the configuration: show, resolve and stats.

They read the settings and resolve rules; ``stats`` requests every rule on
the meta device, so none of them allocates device memory. Each prints to
stdout and returns the exit status; bad input raises for :func:`wspool.cli.main`
to report in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

from wspool.errors import describe_setting, printable
from wspool.registry import PoolRegistry
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

__all__ = ["cmd_resolve", "cmd_show", "cmd_stats"]


def _show_devices() -> list[str]:
    """The devices ``show`` reports: every CUDA device, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    return ["cpu"]


def cmd_show(args: argparse.Namespace) -> int:
    """``wspool show``: the effective settings per profile, with where each value came from."""
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
    int_workspaces = _int_workspaces(registry, devices[0]["device"])
    if args.json:
        tables = {
            name: [
                {"key": ".".join(path), "value": value, "source": prov.source_of(path)}
                for path, value in iter_settings(settings)
            ]
            for name, (settings, prov) in profiles.items()
        }
        data = {
            "config_file": str(provenance.config_file or ""),
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
        print(f"wspool show: warning: {printable(warning)}", file=sys.stderr)
    print(f"config file: {printable(str(provenance.config_file or '(none: built-in defaults and environment)'))}")
    print(f"profile: {printable(given.profile)} (from {printable(provenance.source_of(('profile',)))})")
    for entry in devices:
        shown = ", ".join(f"{k}={v}" for k, v in entry["facts"].items()) or "none (not a GPU)"
        reason = printable(entry["reason"])
        print(f"device {entry['device']}: profile {entry['profile']} ({reason}); device facts: {shown}")
    from wspool.settings.profiles import load_profile

    for name in profiles:
        print(f"profile {name}: {load_profile(name).description}")
    print(f"FlashInfer wrappers' int workspaces: {printable(int_workspaces['mla'])}; paged wrappers take theirs "
          "through reset_workspace_buffer")  # fmt: skip
    for rule, source in int_workspaces["rules"].items():
        print(f"  pools.flashinfer_int.rules.{rule} = {printable(source)}")
    for name, (settings, prov) in profiles.items():
        if len(profiles) > 1:
            print(f"settings under profile {name}:")
        table = [
            (printable(".".join(path)), _show_value(path, value), printable(prov.source_of(path)))
            for path, value in iter_settings(settings)
        ]
        width = max(len(key) for key, _, _ in table)
        vwidth = max(len(value) for _, value, _ in table)
        for key, value, source in table:
            print(f"{key:<{width}}  {value:<{vwidth}}  {source}")
    return 0


def _int_workspaces(registry: PoolRegistry, device: str) -> dict[str, Any]:
    """Whether MLA wrappers take wspool's int workspaces here, and the rules that size them (configured or declared)."""
    from wspool.flashinfer import wrapper_buffers

    wrapper_buffers.declare_int_pool(registry)
    rules = registry.spec(wrapper_buffers.INT_POOL, device).rules
    sources = {name: str(rule.source) for name, rule in sorted(rules.items())}
    return {"mla": wrapper_buffers.mla_hook_status(), "rules": sources}


def _fact_warnings(profiles: Iterable[tuple[WspoolSettings, Provenance]]) -> list[str]:
    """One line per rule of a pool wspool does not own that reads a fact nothing known supplies.

    Loading refuses such a rule in wspool's own pools; another pool's facts may come
    from the backend that declares it in code, so its rule is flagged, not refused.
    """
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


def _show_value(path: tuple[str, ...], value: object) -> str:
    if path and path[-1] == "max_bytes" and isinstance(value, int):
        return f"{value} ({format_size(value)})"
    return printable(str(value))


def cmd_resolve(args: argparse.Namespace) -> int:
    """``wspool resolve``: the size a call would get, and the setting that sizes it."""
    from wspool.devices import resolve_device

    registry = PoolRegistry.from_config(args.config)
    facts = dict(args.fact or [])
    device = resolve_device(args.device)
    nbytes = registry.resolve(args.pool, args.rule, device=device, **facts)
    if args.bytes:
        print(nbytes)
    else:
        rule = registry.spec(args.pool, device).rules[args.rule]
        profile = registry.profile_of(device).profile
        print(
            f"{args.pool}.{args.rule} = {nbytes} bytes ({format_size(nbytes)})  [rule {rule.source!r}, profile "
            f"{profile}; set {describe_setting(('pools', args.pool, 'rules', args.rule))}]"
        )
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """``wspool stats``: what the pools would hold for given facts (a dry run on the meta device)."""
    from wspool.devices import describe_device, resolve_device
    from wspool.memory import dry_run, memory_summary
    from wspool.settings.schema import load_settings

    # The meta device stands in for the current one: its profile and device facts size the rules.
    current = resolve_device(None)
    registry = PoolRegistry(
        load_settings(args.config), describe_device=lambda d: describe_device(current if d.type == "meta" else d)
    )
    data = dry_run(registry, dict(args.fact or []), device="meta")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    choice = registry.profile_of("meta")
    print(f"every rule requested once with these facts, on the meta device (nothing is allocated), as {current} "
          f"(profile {choice.profile}: {choice.reason}):")  # fmt: skip
    print(memory_summary(registry))
    print(
        f"held: {format_size(data['held_bytes'])}; with a buffer per pool (no shared_with): "
        f"{format_size(data['separate_bytes'])}"
    )
    for key, why in data["skipped"].items():
        print(f"skipped {key} (give its facts with --fact NAME=VALUE): {why}")
    return 0
