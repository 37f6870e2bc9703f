"""Byte sizes: the one place where ``"256MiB"`` becomes 268435456 and back.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, SI units (KB, MB, GB,
TB) powers of 1000; units are case-insensitive and a bare number means bytes.
A fractional size (``"1.5GiB"``) is rounded up to a whole byte.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

from wspool.errors import MAX_EXACT_DIGITS, SizeError, describe_setting, readable_int

__all__ = [
    "MAX_SIZE_BYTES",
    "UNIT_BYTES",
    "GiB",
    "KiB",
    "MiB",
    "TiB",
    "ceil_div",
    "format_size",
    "parse_size",
    "positive_int",
    "round_up",
    "size_spelling_hint",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: Sizes above this are rejected: no device has a petabyte of memory, and the
#: bound keeps rule arithmetic on small integers.
MAX_SIZE_BYTES = 1024 * TiB

UNIT_BYTES: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}

# ASCII only: \d and str.isdigit would take fullwidth and Arabic-Indic digits.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$", re.ASCII)
_BINARY_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_UNITS = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


# A number with a unit as Kubernetes quantities and Docker write it: 512M, 1G, 512Mi, 64k, 2g.
_FOREIGN_SIZE_RE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*([kmgt]i?)(?![\w.])", re.IGNORECASE | re.ASCII)


def _spelling_fix(text: str) -> tuple[str, str] | None:
    """Return a size in ``text`` spelled the Kubernetes or Docker way, and how wspool spells it, else None."""
    match = _FOREIGN_SIZE_RE.search(text)
    if match is None:
        return None
    number, unit = match.groups()
    prefix = unit[0].upper()
    if unit.lower().endswith("i"):  # Kubernetes' binary suffixes: Mi is MiB
        return match.group(0).strip(), f"write {number}{prefix}iB"
    return match.group(0).strip(), f"write {number}{prefix}iB (powers of 1024) or {number}{prefix}B (powers of 1000)"


def size_spelling_hint(text: str) -> str | None:
    """Say how to write a size ``text`` spells as Kubernetes or Docker do (``512M``, ``1Gi``); None if it has none.

    ``"'512M' is not a size wspool reads: write 512MiB (powers of 1024) or 512MB (powers of 1000);
    the units are B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"``.
    """
    found = _spelling_fix(text)
    if found is None:
        return None
    return f"{found[0]!r} is not a size wspool reads: {found[1]}; the units are {_UNITS}"


def ceil_div(value: int, divisor: int) -> int:
    """Return ``value / divisor`` rounded up; ``ZeroDivisionError`` unless ``divisor`` is positive."""
    if divisor <= 0:
        raise ZeroDivisionError("ceil_div's divisor must be positive")
    return -(-value // divisor)


def positive_int(value: object) -> int | None:
    """Return ``value`` when it is a positive ``int`` (a bool is not), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def round_up(value: int, multiple: int) -> int:
    """Return the smallest multiple of ``multiple`` at least ``value``; ``ZeroDivisionError`` unless it is positive."""
    if multiple <= 0:
        raise ZeroDivisionError("round_up's multiple must be positive")
    return ceil_div(value, multiple) * multiple


def _shown(value: object) -> str:
    """A value quoted in an error: an integer's digits (or its magnitude, when huge), else its repr."""
    return readable_int(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)


def _fail(message: str, setting: Sequence[str] | None) -> SizeError:
    where = f" (setting {describe_setting(setting)})" if setting else ""
    return SizeError(message + where, path=setting)


def parse_size(value: object, *, setting: Sequence[str] | None = None) -> int:
    """Parse an ``int`` or a string such as ``"1.5GiB"`` into bytes, ``0 <= size <= MAX_SIZE_BYTES``.

    ``SizeError``, naming ``setting``: booleans, floats, negatives, NaN, empty strings, unknown units, too large.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _fail(
            f"size must be an integer number of bytes or a string like '256MiB', got {type(value).__name__} {value!r}",
            setting,
        )
    if isinstance(value, int):
        nbytes = value
    else:
        match = _SIZE_RE.match(value)
        if match is None:
            raise _fail(
                f"invalid size {value!r}: expected a non-negative number with an optional "
                f"unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '256MiB'",
                setting,
            )
        number, unit = match.groups()
        scale = UNIT_BYTES.get(unit.lower())
        if scale is None:
            found = _spelling_fix(value)
            raise _fail(
                f"invalid size {value!r}: unknown unit {unit!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
                + (f"; {found[1]}" if found else ""),
                setting,
            )
        try:
            exact = Decimal(number) * scale
        except InvalidOperation as exc:  # pragma: no cover - the regex admits only digits
            raise _fail(f"invalid size {value!r}", setting) from exc
        if exact > MAX_SIZE_BYTES:
            raise _fail(f"size {value!r} exceeds the limit of {format_size(MAX_SIZE_BYTES)}", setting)
        nbytes = math.ceil(exact)
    if nbytes < 0:
        raise _fail(f"size must not be negative, got {_shown(value)}", setting)
    if nbytes > MAX_SIZE_BYTES:
        raise _fail(f"size {_shown(value)} exceeds the limit of {format_size(MAX_SIZE_BYTES)}", setting)
    return nbytes


def format_size(nbytes: int) -> str:
    """Format a byte count for people: ``268435456`` -> ``"256MiB"``, ``17301504`` -> ``"16.5MiB"``, ``"123B"``.

    Up to two decimals of the largest binary unit that fits; over 40 digits, scientific notation.
    """
    sign, magnitude = ("-" if nbytes < 0 else ""), abs(nbytes)
    if magnitude >= 10**MAX_EXACT_DIGITS:
        return f"{readable_int(nbytes)}B"
    for unit, scale in _BINARY_UNITS:
        if magnitude >= scale:
            whole, rest = divmod(magnitude, scale)
            if rest == 0:
                return f"{sign}{whole}{unit}"
            # Hundredths in integer arithmetic, rounded half to even as float formatting rounds:
            # exact for any size, where a float overflows.
            hundredths, remainder = divmod(100 * rest, scale)
            if 2 * remainder > scale or (2 * remainder == scale and hundredths % 2):
                hundredths += 1
            whole, hundredths = whole + hundredths // 100, hundredths % 100
            # Keep a decimal point on inexact sizes so they never read as exact ("2.0KiB").
            decimals = f"{hundredths:02d}".rstrip("0") or "0"
            return f"{sign}{whole}.{decimals}{unit}"
    return f"{nbytes}B"
