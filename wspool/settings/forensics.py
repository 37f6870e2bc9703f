"""Error forensics: turn what pydantic and pydantic-settings raise into a :class:`~wspool.errors.ConfigError`.

The error names the YAML key and the ``WSPOOL_*`` variable, the value (shortened,
control characters escaped), where it came from and what was expected.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from wspool.errors import ENV_DELIMITER, ENV_PREFIX, ConfigError, describe_setting, setting_names
from wspool.settings.provenance import Provenance

__all__ = ["MAX_REPORTED_ERRORS", "config_error", "env_error", "quote"]

#: Validation errors quoted in one ConfigError; the rest are counted.
MAX_REPORTED_ERRORS = 5

_quote = reprlib.Repr()
_quote.maxlevel = 3
_quote.maxstring = 80
_quote.maxother = 80


def quote(value: object) -> str:
    """Return ``value``'s repr, shortened for quoting in an error."""
    return _quote.repr(value)


def env_error(exc: Exception) -> ConfigError:
    """Name the variable whose value could not be decoded as the JSON its key needs."""
    match = re.search(r'field "(\w+)"', str(exc))
    field = match.group(1) if match else ""
    cause = exc.__cause__
    why = "nests too deeply" if isinstance(exc, RecursionError) else "is not valid JSON"
    if isinstance(cause, json.JSONDecodeError):
        why = f"is not valid JSON ({cause.msg} at char {cause.pos})"
    name = _undecodable_env_var(field, getattr(cause, "doc", None))
    path = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_DELIMITER)) if name else (field or "?",)
    key, env = setting_names(path)
    value = quote(os.environ.get(env, "")) if name else "its value"
    return ConfigError(
        f"invalid environment variable {env} = {value}: {why}, and {key} takes a mapping; "
        f"give a JSON object, or set single values through nested variables such as {env}__<KEY>=...",
        path=path,
    )


def _undecodable_env_var(field: str, doc: object) -> str | None:
    """Find the ``WSPOOL_*`` variable whose value failed to decode (``doc``: that value, if known)."""
    prefix = (ENV_PREFIX + field).upper()
    for name in sorted(os.environ):
        upper = name.upper()
        if not upper.startswith(prefix):
            continue
        value = os.environ[name]
        if doc is not None:
            if value == doc:
                return upper
            continue
        try:
            json.loads(value)
        except RecursionError:
            return upper
        except ValueError:
            continue
    return None


def config_error(exc: ValidationError, provenance: Provenance, prefix: tuple[str, ...] = ()) -> ConfigError:
    lines = []
    first_path: tuple[str, ...] | None = None
    for error in exc.errors(include_url=False):
        loc = [*prefix, *(str(p) for p in error["loc"] if not str(p).startswith("function-"))]
        path = tuple(p for p in loc if p != "[key]")
        if first_path is None:
            first_path = path
        key, env = setting_names(path)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key (check its spelling and nesting)"
        if "[key]" in loc and not isinstance(error.get("input"), str):
            message = f"a key must be a string, not {type(error.get('input')).__name__}"
        if error["type"] == "rule_above_max_bytes":
            lines.append(_rule_above_max_bytes(path, error.get("ctx") or {}, provenance))
            continue
        value = error.get("input")
        shown = f" = {quote(value)}" if not isinstance(value, Mapping) else ""
        lines.append(f"{key}{shown} (from {provenance.source_of(path)}): {message}; set {key} / {env}")
    count = len(lines)
    header = "invalid wspool configuration" + (f" ({count} errors)" if count > 1 else "")
    reported = lines[:MAX_REPORTED_ERRORS]
    if count > MAX_REPORTED_ERRORS:
        reported.append(f"and {count - MAX_REPORTED_ERRORS} more")
    return ConfigError(header + ": " + "; ".join(reported), path=first_path)


def _rule_above_max_bytes(pool: tuple[str, ...], ctx: Mapping[str, Any], provenance: Provenance) -> str:
    rule, limit = (*pool, "rules", str(ctx.get("rule"))), (*pool, "max_bytes")
    return (
        f"{setting_names(rule)[0]} = {quote(ctx.get('source'))} ({ctx.get('size')}, from "
        f"{provenance.source_of(rule)}) is above {setting_names(limit)[0]} = {ctx.get('limit')} (from "
        f"{provenance.source_of(limit)}), so it could never be served; lower {describe_setting(rule)} "
        f"or raise {describe_setting(limit)}"
    )
