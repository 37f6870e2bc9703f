"""The exceptions wspool raises, and how they name the setting to change.

Every error derives from :class:`WspoolError`. Configuration problems are also
``ValueError`` and limit problems are also ``MemoryError``, so callers that
already catch the builtin kinds keep working.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "MAX_EXACT_DIGITS",
    "ConfigError",
    "RuleError",
    "SizeError",
    "WorkspaceConflictError",
    "WorkspaceFrozenError",
    "WorkspaceLimitError",
    "WorkspaceOverflowError",
    "WspoolError",
    "missing_facts",
    "printable",
    "readable_int",
    "setting_names",
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
