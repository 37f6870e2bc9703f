"""The exceptions wspool raises, and the builders of their messages, which name the setting to change.

Every error derives from :class:`WspoolError`. Configuration problems are also
``ValueError`` and limit problems are also ``MemoryError``, so callers that
already catch the builtin kinds keep working. A configuration error quotes the
value (shortened by :func:`quote`, so a hostile value cannot make a huge
message), where it came from, its YAML key and its ``WSPOOL_*`` variable.
Importing this module imports neither torch nor pydantic.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import reprlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = [
    "MAX_EXACT_DIGITS",
    "MAX_REPORTED_ERRORS",
    "ConfigError",
    "RuleError",
    "SettingSources",
    "SizeError",
    "WorkspaceConflictError",
    "WorkspaceFrozenError",
    "WorkspaceLimitError",
    "WorkspaceOverflowError",
    "WspoolError",
    "config_error",
    "env_error",
    "growth_above_limit",
    "growth_failed",
    "growth_while_frozen",
    "miscased_env_vars",
    "missing_facts",
    "printable",
    "quote",
    "readable_int",
    "setting_names",
    "unknown_env_vars",
    "unknown_pool",
    "unknown_rule",
]

ENV_PREFIX = "WSPOOL_"
ENV_DELIMITER = "__"


def printable(text: str) -> str:
    """Return ``text`` with control characters escaped (``"\\x1b"``, ``"\\n"``), so it cannot forge terminal output."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


#: Integers with more digits than this are shown in scientific notation (``repr`` cannot print
#: one of more than 4,300 digits, and a number that long says nothing more to a reader).
MAX_EXACT_DIGITS = 40


def readable_int(value: int) -> str:
    """Return ``value``'s digits, or for an integer of more than :data:`MAX_EXACT_DIGITS` digits
    its magnitude to three significant digits (``"1.23e+400"``), whatever its size."""
    magnitude = abs(value)
    if magnitude < 10**MAX_EXACT_DIGITS:
        return str(value)
    exponent = math.floor(math.log10(magnitude))
    mantissa = f"{10 ** (math.log10(magnitude) - exponent):.3g}"
    if mantissa == "10":  # log10 rounded up to the next power of ten
        mantissa, exponent = "1", exponent + 1
    return f"{'-' if value < 0 else ''}{mantissa}e+{exponent}"


def setting_names(path: Sequence[str]) -> tuple[str, str]:
    """Return a setting's YAML key and environment variable.

    Args:
        path: The key's parts, e.g. ``("pools", "flashinfer_mla", "rules", "lse")``.

    Returns:
        ``("pools.flashinfer_mla.rules.lse", "WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE")``.
    """
    parts = [printable(str(p)) for p in path]
    return ".".join(parts), ENV_PREFIX + ENV_DELIMITER.join(p.upper() for p in parts)


def describe_setting(path: Sequence[str]) -> str:
    """Return ``"key / ENV_VAR"`` for use inside error messages."""
    key, env = setting_names(path)
    return f"{key} / {env}"


class WspoolError(Exception):
    """Base class of every error wspool raises."""


class ConfigError(WspoolError, ValueError):
    """A configuration value, size or rule is invalid.

    Attributes:
        key: The YAML key of the offending setting, when one is known.
        env_var: The matching ``WSPOOL_*`` environment variable, when known.
    """

    def __init__(self, message: str, *, path: Sequence[str] | None = None) -> None:
        super().__init__(message)
        self.key: str | None = None
        self.env_var: str | None = None
        if path is not None:
            self.key, self.env_var = setting_names(path)


class SizeError(ConfigError):
    """A size (``"256MiB"``, ``4096``) could not be parsed."""


class RuleError(ConfigError):
    """A sizing rule is malformed, or could not be resolved for a call."""


class WorkspaceLimitError(WspoolError, MemoryError):
    """A pool could not grow: ``max_bytes`` was reached or the device ran out.

    The pool keeps serving its previous buffer.
    """


class WorkspaceFrozenError(WspoolError, RuntimeError):
    """A pool would have to grow while frozen or during CUDA-graph capture.

    Nothing is allocated and the pool's buffer is left exactly as it was.
    """


class WorkspaceOverflowError(WspoolError, RuntimeError):
    """A kernel still overflowed its workspace after wspool grew it and retried."""


class WorkspaceConflictError(WspoolError, RuntimeError):
    """A plan would have to replan where it cannot (during CUDA-graph capture).

    Its int workspace holds another plan's metadata (a shared region), or its
    buffer changed since it planned. Nothing is planned or captured.
    """


def unknown_pool(pool: str, known: Iterable[str]) -> ConfigError:
    """The error for a pool that is neither configured nor declared, naming where to define it."""
    listed = ", ".join(sorted(known)) or "none"
    return ConfigError(
        f"unknown pool {pool!r} (configured: {listed}); define pools.{pool}.rules in the YAML "
        f"file or WSPOOL_POOLS__{pool.upper()}__RULES__DEFAULT",
        path=("pools", pool),
    )


def unknown_rule(pool: str, rule: str, known: Iterable[str]) -> RuleError:
    """The error for a rule ``pool`` does not have, naming its rules and the setting that adds it."""
    listed = ", ".join(sorted(known)) or "none"
    return RuleError(
        f"pool {pool!r} has no rule {rule!r} (rules: {listed}); set {describe_setting(('pools', pool, 'rules', rule))}",
        path=("pools", pool, "rules", rule),
    )


def missing_facts(exc: Exception, passer: str, known: Mapping[str, int], names: Iterable[str], see: str) -> RuleError:
    """Return ``exc`` (a rule that read a fact the call lacks) with what an engine's call site passes.

    Args:
        exc: The rule's error.
        passer: Who passes the facts, e.g. ``"the vLLM plugin"``.
        known: The facts it passed.
        names: Every fact it can pass.
        see: Where the engine's facts are documented, or what gives them.
    """
    given = ", ".join(f"{k}={v}" for k, v in known.items()) or "none"
    unknown = ", ".join(name for name in names if name not in known) or "none"
    return RuleError(f"{exc} ({passer} passes the facts it knows: {given}; unknown here: {unknown}; {see})")


def growth_above_limit(
    where: str, nbytes: int, size: str, reason: str, what: str, limit: int, limit_size: str, hint: str
) -> WorkspaceLimitError:
    """The error for a growth to ``nbytes`` (``size``) above ``what`` = ``limit``; ``hint`` says what to change."""
    return WorkspaceLimitError(
        f"{where} needs {readable_int(nbytes)} bytes ({size}) for {reason}, above {what} = {limit} bytes "
        f"({limit_size}); {hint}"
    )


def growth_while_frozen(
    where: str, why: str, reason: str, nbytes: int, size: str, old: int, setting: str
) -> WorkspaceFrozenError:
    """The error for a growth refused ``why`` (while frozen, during capture), naming the setting to raise."""
    return WorkspaceFrozenError(
        f"{where} would have to grow {why}: {reason} needs {readable_int(nbytes)} bytes ({size}), {old} bytes "
        f"available. Reserve or warm up that size before capturing/freezing, or raise {setting}"
    )


def growth_failed(
    where: str, old: int, old_size: str, capacity: int, capacity_size: str, reason: str, cause: str, setting: str
) -> WorkspaceLimitError:
    """The error for an allocator that failed (``cause``) to grow a buffer; the pool keeps its old one."""
    return WorkspaceLimitError(
        f"{where} could not grow from {old} to {capacity} bytes ({capacity_size}) for {reason}: {cause}; "
        f"the pool keeps its {old_size} buffer. Lower {setting} or free device memory"
    )


# -- configuration errors: each names the value, where it came from, its key and its variable --------


class SettingSources(Protocol):
    """Where each configuration value came from (:class:`wspool.settings.sources.Provenance`)."""

    def source_of(self, path: Sequence[str]) -> str: ...

    def variables_under(self, path: Sequence[str]) -> list[str]: ...


#: Validation errors quoted in one ConfigError; the rest are counted.
MAX_REPORTED_ERRORS = 5


class _ShortRepr(reprlib.Repr):
    """reprlib's shortened repr, with integers of any size (``repr`` refuses more than 4,300 digits)."""

    def repr_int(self, x: int, level: int) -> str:
        return readable_int(x)


_quote = _ShortRepr()
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


def config_error(
    exc: ValidationError,
    provenance: SettingSources,
    prefix: tuple[str, ...] = (),
    keys_at: Callable[[tuple[str, ...]], Sequence[str]] | None = None,
) -> ConfigError:
    """Turn a validation error into one :class:`ConfigError` naming each key, its source and its fix.

    Args:
        exc: The validation error.
        provenance: Where each value came from.
        prefix: The key path the validated model sits at (``("pools", "mine")``).
        keys_at: The keys the schema has under a key path, for the suggestion an unknown
            key gets (``rule`` -> ``rules``); ``None``: no suggestion.
    """
    lines = []
    first_path: tuple[str, ...] | None = None
    for error in exc.errors(include_url=False):
        loc = [*prefix, *(str(p) for p in error["loc"] if not str(p).startswith("function-"))]
        path = tuple(p for p in loc if p != "[key]")
        if first_path is None:
            first_path = path
        if error["type"] == "extra_forbidden":
            lines.append(_unknown_key(path, error.get("input"), provenance, keys_at))
            continue
        key, env = setting_names(path)
        message = error["msg"].removeprefix("Value error, ")
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


def _unknown_key(
    path: tuple[str, ...],
    value: object,
    provenance: SettingSources,
    keys_at: Callable[[tuple[str, ...]], Sequence[str]] | None,
) -> str:
    """Say that ``path`` names no setting, and name the key meant: its variable as the user spelt the rest."""
    key = setting_names(path)[0]
    source = provenance.source_of(path)
    known = list(keys_at(path[:-1])) if keys_at is not None else []
    if not known:
        return f"{key} (from {source}): unknown key (check its spelling and nesting)"
    meant = difflib.get_close_matches(path[-1].lower(), known, n=1, cutoff=0.6)
    if not meant:
        return f"{key} (from {source}): unknown key; the keys there are {', '.join(known)}"
    fixed = (*path[:-1], meant[0])
    # The rest of the path as the user wrote it: the variable's tail, or a single key below it in YAML.
    variables = provenance.variables_under(path)
    if variables:
        tail = variables[0][len(setting_names(path)[1]) :]
        fixed_env = setting_names(fixed)[1] + tail
        fixed_key = setting_names(fixed)[0] + tail.replace(ENV_DELIMITER, ".").lower()
    else:
        below = (str(next(iter(value))),) if isinstance(value, Mapping) and len(value) == 1 else ()
        fixed_key, fixed_env = setting_names((*fixed, *below))
    return f"{key} (from {source}): unknown key; did you mean {meant[0]!r}? set {fixed_key} / {fixed_env}"


def _rule_above_max_bytes(pool: tuple[str, ...], ctx: Mapping[str, Any], provenance: SettingSources) -> str:
    rule, limit = (*pool, "rules", str(ctx.get("rule"))), (*pool, "max_bytes")
    return (
        f"{setting_names(rule)[0]} = {quote(ctx.get('source'))} ({ctx.get('size')}, from "
        f"{provenance.source_of(rule)}) is above {setting_names(limit)[0]} = {ctx.get('limit')} (from "
        f"{provenance.source_of(limit)}), so it could never be served; lower {describe_setting(rule)} "
        f"or raise {describe_setting(limit)}"
    )


def _first_names(names: Sequence[str]) -> str:
    """``names`` for a message: the first :data:`MAX_REPORTED_ERRORS`, escaped, and how many more."""
    more = f" and {len(names) - MAX_REPORTED_ERRORS} more" if len(names) > MAX_REPORTED_ERRORS else ""
    return ", ".join(printable(n) for n in names[:MAX_REPORTED_ERRORS]) + more


def miscased_env_vars(names: Sequence[str]) -> ConfigError:
    """The error for ``WSPOOL_*`` variables ``names`` that are not in upper case, naming each fix."""
    fixes = "; ".join(f"set {printable(n.upper())}, not {printable(n)}" for n in names[:MAX_REPORTED_ERRORS])
    return ConfigError(
        f"environment variable(s) {_first_names(names)} "
        f"not in upper case: wspool's {ENV_PREFIX}* variables are upper case, and one in another case "
        f"would be ignored or clash with its upper-case twin; {fixes}",
        path=tuple(names[0].upper()[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER)),
    )


def unknown_env_vars(names: Sequence[str], fields: set[str], extra: Sequence[str]) -> ConfigError:
    """The error for ``WSPOOL_*`` variables ``names`` that name no setting (top-level ``fields``) nor ``extra``."""
    known_names = ", ".join([*extra, *(f"{ENV_PREFIX}{f}" for f in sorted(fields))])
    meant = [m for m in (_meant_variable(n, fields, extra) for n in names[:MAX_REPORTED_ERRORS]) if m]
    return ConfigError(
        f"unknown environment variable(s) {_first_names(names)}: no wspool setting has that name "
        f"(check the spelling; the variables are {known_names}, and pools are set through "
        f"{ENV_PREFIX}POOLS{ENV_DELIMITER}<POOL>{ENV_DELIMITER}<KEY>)"
        + (f"; did you mean {', '.join(meant)}?" if meant else ""),
        path=(names[0][len(ENV_PREFIX) :].lower(),),
    )


def _meant_variable(name: str, fields: set[str], extra: Iterable[str]) -> str | None:
    """The variable ``name`` most likely misspells (``WSPOOL_POOL__P__RULES__X`` -> ``WSPOOL_POOLS__...``)."""
    upper = name.upper()
    whole = difflib.get_close_matches(upper, list(extra), n=1, cutoff=0.8)
    if whole:
        return whole[0]
    head, nested, rest = upper[len(ENV_PREFIX) :].partition(ENV_DELIMITER)
    found = difflib.get_close_matches(head, sorted(fields), n=1, cutoff=0.6)
    if not found or (nested and found[0] != "POOLS"):
        return None
    return f"{ENV_PREFIX}{found[0]}{nested}{rest}"
