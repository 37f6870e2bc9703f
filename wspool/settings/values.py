"""The value types of the settings: each checks one kind of value and says what it expected.

Sizes, growth policies, pool names, fact names and values, rule sources and
profile names, as pydantic ``Annotated`` types that
:class:`~wspool.settings.config.PoolConfig` and
:class:`~wspool.settings.config.WspoolSettings` are built from. A bad value
raises a ``ValueError`` that pydantic turns into a validation error, which
:mod:`~wspool.settings.forensics` names the setting of. Pure functions; nothing
here reads files or the environment.
"""

from __future__ import annotations

import keyword
from typing import Annotated

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from wspool.rules import FUNCTIONS, compile_rule
from wspool.settings.forensics import quote
from wspool.settings.profiles import AUTO, PROFILE_NAMES
from wspool.units import parse_size

__all__ = [
    "GROWTH_POLICIES",
    "RESERVED_FACT_NAMES",
    "FactName",
    "FactValue",
    "GrowthPolicy",
    "OptionalLimit",
    "PoolName",
    "ProfileSetting",
    "RuleSource",
]

GROWTH_POLICIES = ("exact", "power_of_two")


# Values quoted back in errors are shortened, so a hostile value cannot make a huge message.


def _rule_value(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a size or an expression string, got {type(value).__name__}")
    compile_rule(value)  # raises a RuleError (a ValueError) naming what is wrong
    return str(value)


def _growth_value(value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in GROWTH_POLICIES:
        return value.strip().lower()
    try:
        granularity = parse_size(value)
    except ValueError:
        raise ValueError(
            f"expected 'exact', 'power_of_two' or a granularity size such as '32MiB', got {value!r}"
        ) from None
    if granularity <= 0:
        raise ValueError("a growth granularity must be positive")
    return str(value)


def _size_value(value: object) -> int | None:
    if value is None:
        return None
    return parse_size(value)


def _limit_value(value: object) -> int | None:
    nbytes = _size_value(value)
    if nbytes == 0:
        raise ValueError("max_bytes must be positive (leave it out for no limit)")
    return nbytes


def _pool_name_value(value: object) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None  # empty: the pool has its own buffer
    if not isinstance(value, str):
        raise ValueError(f"expected the name of another pool, got {type(value).__name__}")
    return value.strip()


#: Names a default fact may not have: the parameters of the per-call methods (facts are
#: passed as keyword arguments next to them), Python's keywords and the rule functions.
RESERVED_FACT_NAMES = frozenset({"pool", "rule", "lane", "device", "self", *keyword.kwlist, *FUNCTIONS})


def _fact_name(value: object) -> str:
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "Input should be a valid string")
    if not value.isidentifier() or value.startswith("_"):
        raise ValueError(f"fact name {value!r} is not a name a rule can read (letters, digits, _; no leading _)")
    if value in RESERVED_FACT_NAMES:
        raise ValueError(
            f"fact name {value!r} is reserved (it names a parameter of the per-call methods, a Python keyword "
            f"or a rule function); choose another name"
        )
    return value


def _fact_value(value: object) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a fact must be a non-negative integer, got {type(value).__name__} {quote(value)}")
    return value


RuleSource = Annotated[str, BeforeValidator(_rule_value)]
FactName = Annotated[str, BeforeValidator(_fact_name)]
FactValue = Annotated[int, BeforeValidator(_fact_value)]
GrowthPolicy = Annotated[str, BeforeValidator(_growth_value)]
OptionalLimit = Annotated[int | None, BeforeValidator(_limit_value)]
PoolName = Annotated[str | None, BeforeValidator(_pool_name_value)]


def _profile_value(value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in (AUTO, *PROFILE_NAMES):
        return value.strip().lower()
    raise ValueError(f"unknown profile {quote(value)} (choose {AUTO} or one of {', '.join(PROFILE_NAMES)})")


ProfileSetting = Annotated[str, BeforeValidator(_profile_value)]
