"""``wspool doctor``: one command that says what a bug report about wspool needs, and what is wrong.

It reports versions, devices and their profiles, every engine integration, the
configuration's non-default values with their sources, and each problem with
its fix; exit status 1 when there are problems. It never imports an engine and
creates no CUDA context; without an NVIDIA driver or with a CPU torch it does
not import torch either. Not thread-safe: a command.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wspool import __version__
from wspool.cli import wrap
from wspool.errors import ConfigError, printable
from wspool.integrations import RESERVE_ENV_VAR, integration
from wspool.integrations.patching import Preflight, parse_switch
from wspool.settings.profiles import EngineSpec, ProfileChoice, choose_profile, engine_knobs, engine_specs
from wspool.settings.schema import (
    LAYERS_KEYWORD,
    Provenance,
    WspoolSettings,
    iter_settings,
    load_settings_with_provenance,
    profile_settings,
)

__all__ = ["FLASHINFER_DISTRIBUTION", "cmd_doctor", "diagnose", "format_report"]

#: FlashInfer's distribution name, whose version wspool's own requirement admits or not.
FLASHINFER_DISTRIBUTION = "flashinfer-python"


def cmd_doctor(args: argparse.Namespace) -> int:
    """``wspool doctor``: print the report (``--json``: as JSON); 1 where problems were found, else 0."""
    report = diagnose(args.config)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 1 if report["problems"] else 0


def diagnose(config: str | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the doctor's report as JSON-able data; ``report["problems"]`` lists what is wrong."""
    env = os.environ if environ is None else environ
    problems: list[str] = []
    configuration, settings, provenance = _configuration(config, problems)
    torch_info, devices = _devices(settings, problems)
    report: dict[str, Any] = {
        "wspool": _wspool(problems),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": torch_info,
        "devices": devices,
        "flashinfer": _flashinfer(problems),
        "engines": [_engine(info, env, settings, configuration, provenance, problems) for info in engine_specs()],
        "configuration": configuration,
        "problems": problems,
    }
    try:
        parse_switch(RESERVE_ENV_VAR, env)
    except ConfigError as exc:  # the engines warn and reserve: a value meant as off is a mistake to show
        problems.append(f"{exc} (each engine reserves its pools, as with 1)")
    if settings is not None:
        configuration["changed"] = _changed(settings, sorted({d["profile"] for d in devices}))
    return report


# -- wspool, Python, torch, devices, FlashInfer ----------------------------------------------------------------


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _wspool(problems: list[str]) -> dict[str, Any]:
    installed = _distribution_version("wspool")
    location = str(Path(__file__).resolve().parent.parent)
    if installed is not None and installed != __version__:
        problems.append(
            f"wspool {__version__} runs from {location}, but the installed distribution is wspool {installed}: "
            f"reinstall it from the same checkout (pip install --no-deps .)"
        )
    return {"version": __version__, "location": location, "installed": installed}


def _torch_build() -> dict[str, Any]:
    """torch's version and CUDA build from its metadata and ``torch/version.py``, without importing torch."""
    version = _distribution_version("torch")
    if "torch" in sys.modules:  # imported already (by the caller): ask it
        import torch

        return {"version": str(torch.__version__), "cuda": torch.version.cuda, "imported": True}
    cuda: str | None = None
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        build = Path(next(iter(spec.submodule_search_locations))) / "version.py"
        try:
            for node in ast.parse(build.read_text(encoding="utf-8")).body:
                target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
                value = getattr(node, "value", None)
                if isinstance(target, ast.Name) and target.id == "cuda" and value is not None:
                    cuda = ast.literal_eval(value)
        except (OSError, SyntaxError, ValueError):
            cuda = None
    return {"version": version, "cuda": cuda, "imported": False}


def _nvidia_driver_present() -> bool:
    """Whether this machine may have an NVIDIA driver; where that cannot be told without CUDA, ``True``."""
    if not sys.platform.startswith("linux"):
        return True
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/dxg")  # dxg: WSL's GPU


def _devices(settings: WspoolSettings | None, problems: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """torch's build, CUDA's availability and each visible device with its profile (no CUDA context is made)."""
    torch_info = _torch_build()
    setting = settings.profile if settings is not None else "auto"
    cpu = {"device": "cpu", **_choice(choose_profile(setting, None))}
    if torch_info["version"] is None:
        problems.append("torch is not installed: pip install torch (a CPU build: see README, Quick start)")
        torch_info["cuda_available"], torch_info["why"] = False, "torch is not installed"
        return torch_info, [cpu]
    if torch_info["cuda"] is None:
        torch_info["cuda_available"], torch_info["why"] = False, "a CPU build of torch"
        return torch_info, [cpu]
    if not _nvidia_driver_present():
        torch_info["cuda_available"], torch_info["why"] = False, "no NVIDIA driver on this machine"
        return torch_info, [cpu]
    # A CUDA build on a machine with a driver: only torch can tell. Reading the devices' properties
    # initialises CUDA's runtime but creates no context on any device.
    import torch

    from wspool.devices import DeviceDescription

    torch_info["imported"] = True
    if not torch.cuda.is_available():
        torch_info["cuda_available"], torch_info["why"] = False, "torch finds no CUDA device"
        return torch_info, [cpu]
    torch_info["cuda_available"], torch_info["why"] = True, f"{torch.cuda.device_count()} CUDA device(s)"
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        described = DeviceDescription(
            str(props.name),
            int(props.major),
            int(props.minor),
            int(props.multi_processor_count),
            int(props.total_memory),
        )
        devices.append(
            {"device": f"cuda:{index}", "name": described.label(), **_choice(choose_profile(setting, described))}
        )
    return torch_info, devices


def _choice(choice: ProfileChoice) -> dict[str, str]:
    return {"profile": choice.profile, "reason": choice.reason}


def _admitted_flashinfer() -> str | None:
    """The FlashInfer versions wspool's installed distribution requires, e.g. ``<0.7.5,>=0.7.2``."""
    try:
        requirements = importlib.metadata.requires("wspool") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        from packaging.requirements import InvalidRequirement, Requirement

        try:
            parsed = Requirement(requirement)
        except InvalidRequirement:
            continue
        if parsed.name == FLASHINFER_DISTRIBUTION and parsed.marker is None:
            return str(parsed.specifier)
    return None


def _flashinfer(problems: list[str]) -> dict[str, Any]:
    version = _distribution_version(FLASHINFER_DISTRIBUTION)
    admitted = _admitted_flashinfer()
    allowed: bool | None = None
    if version is not None and admitted is not None:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            allowed = Version(version) in SpecifierSet(admitted, prereleases=True)
        except InvalidVersion:
            allowed = False
    wanted = f"'{FLASHINFER_DISTRIBUTION}{admitted}'" if admitted else FLASHINFER_DISTRIBUTION
    if version is None:
        problems.append(f"FlashInfer is not installed: wspool's kernels need it; pip install {wanted}")
    elif allowed is False:
        problems.append(f"FlashInfer {version} is not a version wspool admits ({admitted}): pip install {wanted}")
    return {"version": version, "admitted_versions": admitted, "admitted": allowed}


# -- engines -----------------------------------------------------------------------------------------------------


def _entry_point(info: EngineSpec) -> dict[str, Any]:
    """Whether wspool's entry point is registered in the engine's group, as the engine would find it."""
    found = [ep.value for ep in importlib.metadata.entry_points(group=info.entry_point_group) if ep.name == "wspool"]
    return {
        "group": info.entry_point_group,
        "expected": info.entry_point,
        "found": found,
        "registered": info.entry_point in found,
    }


def _switch(variable: str, env: Mapping[str, str]) -> bool | None:
    """Whether a switch variable is on; ``None`` where its value is not understood."""
    try:
        return parse_switch(variable, env)
    except ConfigError:
        return None


def _engine(
    info: EngineSpec,
    env: Mapping[str, str],
    settings: WspoolSettings | None,
    configuration: Mapping[str, Any],
    provenance: Provenance | None,
    problems: list[str],
) -> dict[str, Any]:
    version = info.installed_version()
    entry = _entry_point(info)
    try:
        switch_on: bool | None = parse_switch(info.switch_var, env)
    except ConfigError:
        switch_on = None
    selection = info.selection(env)
    result: dict[str, Any] = {
        "key": info.key,
        "name": info.name,
        "installed": version is not None,
        "version": version,
        "supported_versions": info.supported,
        "supported": info.supports(version) if version is not None else None,
        "entry_point": entry,
        "switch": {"variable": info.switch_var, "value": env.get(info.switch_var), "on": switch_on},
        "reserve": {
            "variable": RESERVE_ENV_VAR,
            "value": env.get(RESERVE_ENV_VAR),
            "on": _switch(RESERVE_ENV_VAR, env),
        },
        "plugin_selection": {
            name: {"variable": var, "value": env.get(var)}
            for name, var in (("allowlist", info.allowlist_var), ("denylist", info.denylist_var))
            if var
        },
        "excluded_by": selection,
        "engine_variables": [_engine_variable(name, env, provenance) for name in info.engine_variables],
    }
    if version is None:
        result["active"], result["why_inactive"] = False, [f"{info.name} is not installed"]
        return result
    try:
        engine = integration(info.key)  # wspool's package for it, not the engine
        verdict = engine.preflight(env, lambda: _registry(settings, configuration))
        result["targets"] = [
            {
                "group": group.name,
                "targets": [{"module": t.module, "path": t.path, "what": t.what} for t in group.targets],
            }
            for group in engine.groups()
        ]
    except Exception as exc:  # wspool's package for the engine fails to import: say so, and go on
        result["targets"] = None
        result["active"] = False
        result["why_inactive"] = [f"wspool's {info.name} integration cannot be imported"]
        problems.append(f"wspool's {info.name} integration cannot be imported ({type(exc).__name__}: {exc})")
        return result
    why_not = _why_inactive(info, result, verdict, configuration["valid"], problems)
    result["active"] = not why_not
    result["why_inactive"] = why_not
    return result


def _registry(settings: WspoolSettings | None, configuration: Mapping[str, Any]) -> Any:
    """A registry of the configuration doctor read, to run an engine's preflight in; nothing is allocated."""
    if settings is None:
        raise ConfigError(configuration["error"])
    from wspool.registry import PoolRegistry

    return PoolRegistry(settings)


def _why_inactive(
    info: EngineSpec, result: dict[str, Any], verdict: Preflight, valid: bool, problems: list[str]
) -> list[str]:
    """Why the engine would start without wspool: the preflight its load() runs, and its entry point.

    Each reason that is a mistake also goes to ``problems`` (once: a configuration
    that does not load is listed there already).
    """
    name, reasons, entry = info.name, [], result["entry_point"]
    for refusal in verdict.refusals:
        if refusal.kind == "config" and not valid:
            reasons.append("wspool's configuration is invalid (see the problems)")
            continue
        reasons.append(refusal.reason if refusal.kind != "config" else f"{refusal.reason}: {refusal.cause}")
        if refusal.problem is not None and refusal.problem not in problems:
            problems.append(refusal.problem)
    if not entry["registered"]:
        found = f" (registered: {', '.join(entry['found'])})" if entry["found"] else ""
        reasons.append(f"wspool's entry point is not registered in {entry['group']}{found}")
        problems.append(
            f"{name} is installed, but wspool's entry point {entry['expected']} is not registered in "
            f"{entry['group']}{found}: install wspool into this environment (pip install --no-deps <wspool "
            f"checkout or wheel>)"
        )
    return reasons


def _engine_variable(name: str, env: Mapping[str, str], provenance: Provenance | None) -> dict[str, Any]:
    """An engine's own workspace variable: its value, and each key it sets with what wins there."""
    keys = next((knob.keys for knob in engine_knobs() if knob.name == name), ())
    sets = []
    for pool, rule in keys:
        path = ("pools", pool, "rules", rule)
        source = provenance.explain(path) if provenance is not None and name in env else None
        sets.append({"key": ".".join(path), "source": source})
    return {"name": name, "value": env.get(name), "sets": sets}


# -- configuration -----------------------------------------------------------------------------------------------


def _configuration(
    config: str | None, problems: list[str]
) -> tuple[dict[str, Any], WspoolSettings | None, Provenance | None]:
    try:
        settings, provenance = load_settings_with_provenance(config)
    except ConfigError as exc:
        problems.append(str(exc))
        named = config if config is not None else os.environ.get("WSPOOL_CONFIG")
        return {"valid": False, "file": named, "named": "", "shipped": None, "error": str(exc)}, None, None
    from wspool.cli.commands import config_line

    return (
        {
            "valid": True,
            "file": str(provenance.config_file) if provenance.config_file is not None else None,
            "named": provenance.config_how,
            "shipped": provenance.shipped,
            "summary": config_line(provenance),
            "profile": {"value": settings.profile, "source": provenance.source_of(("profile",))},
        },
        settings,
        provenance,
    )


def _changed(settings: WspoolSettings, profiles: list[str]) -> list[dict[str, Any]]:
    """Every value that differs from the built-in defaults under each profile the devices use, with its source."""
    no_layers: dict[str, Any] = {LAYERS_KEYWORD: []}
    builtin = dict(iter_settings(WspoolSettings(**no_layers)))
    rows: dict[str, dict[str, Any]] = {}
    for profile in profiles:
        layered, provenance = profile_settings(settings, profile)
        for path, value in iter_settings(layered):
            key = ".".join(path)
            givers = provenance.givers(path)
            # A field no source gives (a new pool's growth, say) keeps the schema's own default.
            unset = not givers or givers[0].kind == "default"
            if key in rows or unset or (path in builtin and builtin[path] == value):
                continue
            rows[key] = {
                "key": key,
                "value": value,
                "default": builtin.get(path),
                "source": provenance.explain(path),
                "profile": profile,
            }
    return list(rows.values())


# -- the text report ---------------------------------------------------------------------------------------------


def format_report(report: Mapping[str, Any]) -> str:
    """Return the report as text, every line at most 100 columns (continuations indented)."""
    lines: list[str] = []
    w, t, f = report["wspool"], report["torch"], report["flashinfer"]
    installed = f"installed: wspool {w['installed']}" if w["installed"] else "not installed as a distribution"
    lines.append(f"wspool {w['version']} ({w['location']}; {installed})")
    lines.append(f"Python {report['python']['version']} ({report['python']['executable']})")
    if t["version"] is None:
        lines.append("torch: not installed")
    else:
        build = f"CUDA {t['cuda']} build" if t["cuda"] else "CPU build"
        available = "available" if t.get("cuda_available") else "not available"
        lines.append(f"torch {t['version']} ({build}); CUDA {available}: {t.get('why')}")
    for device in report["devices"]:
        name = f" ({device['name']})" if device.get("name") else ""
        lines.append(f"device {device['device']}{name}: profile {device['profile']} ({device['reason']})")
    if f["version"] is None:
        lines.append("FlashInfer: not installed")
    else:
        verdict = {True: "admitted", False: "NOT admitted", None: "admission unknown"}[f["admitted"]]
        lines.append(f"FlashInfer {f['version']}: {verdict} (wspool requires {f['admitted_versions'] or '?'})")
    lines.append("engines:")
    for engine in report["engines"]:
        lines.extend(_engine_lines(engine))
    lines.extend(_configuration_lines(report["configuration"]))
    problems = report["problems"]
    lines.append(f"problems: {len(problems) if problems else 'none'}")
    lines.extend(f"  - {printable(' '.join(p.split()))}" for p in problems)
    # A continuation line is indented past its line's own indent.
    return "\n".join(wrap(printable(line), " " * (len(line) - len(line.lstrip()) + 4)) for line in lines)


def _reserve_text(reserve: Mapping[str, Any]) -> str:
    value = "unset" if reserve["value"] is None else repr(reserve["value"])
    state = {True: "yes", False: "no", None: "not understood (read as yes)"}[reserve["on"]]
    return f"{state} ({reserve['variable']}: {value})"


def _engine_lines(engine: Mapping[str, Any]) -> list[str]:
    name = engine["name"]
    entry, switch = engine["entry_point"], engine["switch"]
    registered = "registered" if entry["registered"] else "NOT registered"
    if not engine["installed"]:
        return [f"  {name}: not installed (wspool supports {engine['supported_versions']}); entry point {registered}"]
    supported = "supported" if engine["supported"] else f"NOT supported ({engine['supported_versions']})"
    active = "active" if engine["active"] else f"NOT active: {'; '.join(engine['why_inactive'])}"
    switch_text = "unset (on)" if switch["value"] is None else repr(switch["value"])
    selection = "".join(
        f"; {v['variable']}: {'unset' if v['value'] is None else repr(v['value'])}"
        for v in engine["plugin_selection"].values()
    )
    lines = [
        f"  {name} {engine['version']}: installed, {supported}, {active}",
        f"    entry point {entry['expected']} in {entry['group']}: {registered}; {switch['variable']}: "
        f"{switch_text}{selection}",
        f"    reserves its pools before sizing its KV cache: {_reserve_text(engine['reserve'])}",
    ]
    for variable in engine["engine_variables"]:
        if variable["value"] is None:
            lines.append(f"    {variable['name']}: unset")
            continue
        sets = "; ".join(f"{s['key']} from {s['source']}" for s in variable["sets"])
        lines.append(f"    {variable['name']} = {variable['value']}: {sets}")
    groups = engine.get("targets") or []
    if groups:
        count = sum(len(group["targets"]) for group in groups)
        shown = f"{_count(len(groups), 'group')}, {_count(count, 'target')}"
        lines.append(f"    what it patches ({shown}; a target absent from a version is skipped):")
    for group in groups:
        lines.append(f"      {group['group']}:")
        modules: dict[str, list[str]] = {}
        for target in group["targets"]:
            modules.setdefault(target["module"], []).append(f"{target['path']} -> {target['what']}")
        lines.extend(f"        {module}: {'; '.join(paths)}" for module, paths in modules.items())
    return lines


def _configuration_lines(configuration: Mapping[str, Any]) -> list[str]:
    if not configuration["valid"]:
        return [f"configuration: INVALID ({configuration['file'] or 'no file'}): see the problems"]
    lines = [configuration["summary"]]
    profile = configuration["profile"]
    lines.append(f"profile: {profile['value']} (from {profile['source']})")
    changed = configuration.get("changed", [])
    lines.append("values that differ from the built-in defaults:" + ("" if changed else " none"))
    for row in changed:
        lines.append(f"  {row['key']} = {row['value']} (from {row['source']})")
    return lines


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
