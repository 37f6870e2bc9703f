"""The largest size a rule asks for over limits on its facts: proven from the expression, or searched.

A limit gives a fact a range (``1..high``, or ``low..high``) or a set of values;
a fact with a default and no limit is fixed at its default. :func:`bound_rule`
walks the expression's syntax tree (:func:`wspool.rules.parse_expression`) once
and proves, fact by fact, whether the size is non-decreasing or non-increasing
in it over the whole box of limits (sums, products of operands of known sign,
``max``, ``min``, ``round_up``/``ceil_div``/``//`` by positive divisors). A
proven fact is fixed at the corner that maximises the size; the others are
searched value by value (sets, or ranges of at most :data:`MAX_RANGE_VALUES`);
where neither works the rule is refused, naming the rule and the fact. The
bound is never below what any call within the limits asks. Pure Python on the
host; nothing here touches a device. Tables: docs/profiles.md.
"""

from __future__ import annotations

import ast
import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, Protocol

from wspool.devices import DEFAULT_LANE, DeviceLike
from wspool.errors import RuleError, WorkspaceFrozenError, describe_setting
from wspool.pool import WorkspacePool
from wspool.rules import FUNCTIONS, ExpressionRule, LiteralRule, SizeRule, parse_expression, rule_label
from wspool.units import format_size, round_up

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_RANGE_VALUES",
    "MAX_SEARCH_POINTS",
    "FactLimit",
    "PlannedRule",
    "Reservation",
    "RuleBound",
    "apply_reservation",
    "bound_rule",
    "facts_beyond",
    "parse_limit",
    "plan_reservation",
    "to_limits",
]

#: A range with more values than this is searched only where the rule is proven monotone in it.
MAX_RANGE_VALUES = 4096
#: The most fact combinations one rule's search evaluates before it is refused.
MAX_SEARCH_POINTS = 1 << 16


@dataclass(frozen=True)
class FactLimit:
    """The values a fact may take: ``low..high``, or exactly ``values`` (then ``low``/``high`` are their extremes).

    ``source`` says where the limit comes from and so where to raise it
    (``"--limit batch_size"``, ``"vLLM's max_num_seqs (--max-num-seqs)"``).
    """

    low: int
    high: int
    values: tuple[int, ...] | None = None
    source: str = "the limits given to reserve_for"

    def allows(self, value: int) -> bool:
        """Whether a call's ``value`` of the fact lies within this limit."""
        if self.values is not None:
            return value in self.values
        return self.low <= value <= self.high

    def describe(self) -> str:
        """Return the limit as the command line writes it: ``256``, ``1,2,4`` or ``8..64``."""
        if self.values is not None:
            return ",".join(str(v) for v in self.values)
        return str(self.high) if self.low == 1 else f"{self.low}..{self.high}"

    def count(self) -> int:
        """Return how many values the fact may take."""
        return len(self.values) if self.values is not None else self.high - self.low + 1


def _limit_of(name: str, value: object, source: str) -> FactLimit:
    if isinstance(value, FactLimit):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise RuleError(f"limit {name}={value}: a largest value must be a positive integer ({source})")
        return FactLimit(1, value, None, source)
    if isinstance(value, range) and value.step == 1 and len(value):
        return FactLimit(value.start, value.stop - 1, None, source)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items = tuple(value)
        if items and all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            ordered = tuple(sorted(set(items)))
            return FactLimit(ordered[0], ordered[-1], ordered, source)
    raise RuleError(
        f"limit {name}={value!r:.60}: give a largest value (int), a range (range(lo, hi + 1)) or a set of ints "
        f"({source})"
    )


def to_limits(limits: Mapping[str, object], source: str = "the limits given to reserve_for") -> dict[str, FactLimit]:
    """Normalise ``{fact: int | range | iterable of ints | FactLimit}`` to :class:`FactLimit` values.

    Raises:
        RuleError: A value is neither a positive integer, a range nor a non-empty set of integers.
    """
    return {name: _limit_of(name, value, source) for name, value in limits.items()}


def parse_limit(text: str) -> tuple[str, FactLimit]:
    """Parse ``NAME=MAX``, ``NAME=LO..HI`` or ``NAME=A,B,C`` (the ``--limit`` argument of ``wspool plan``).

    Raises:
        RuleError: The text is not one of those forms, or a value is not a non-negative integer.
    """
    name, sep, value = text.partition("=")
    name = name.strip()
    source = f"--limit {name}"
    if not sep or not name.isidentifier() or not value.strip():
        raise RuleError(f"--limit {text!r}: expected NAME=MAX, NAME=LO..HI or NAME=A,B,C (e.g. batch_size=256)")
    try:
        if ".." in value:
            low, _, high = value.partition("..")
            lo, hi = int(low), int(high)
            if lo < 0 or hi < lo:
                raise ValueError
            return name, FactLimit(lo, hi, None, source)
        parts = [int(p) for p in value.split(",")]
        if any(p < 0 for p in parts):
            raise ValueError
    except ValueError:
        raise RuleError(
            f"--limit {text!r}: values must be non-negative integers, LO..HI with LO <= HI, or A,B,C"
        ) from None
    if len(parts) == 1:
        return name, _limit_of(name, parts[0], source)
    return name, _limit_of(name, parts, source)


@dataclass(frozen=True)
class RuleBound:
    """One rule's bound: ``nbytes`` at the fact values ``facts``; ``method`` is literal, proven or searched.

    ``points`` counts the fact combinations evaluated; ``searched`` names the facts
    whose every value was tried (empty where the bound is proven).
    """

    rule: str
    source: str
    setting: tuple[str, ...]
    nbytes: int
    method: str
    facts: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    points: int = 1
    searched: tuple[str, ...] = ()


# -- the analysis: per fact, a direction (+1 non-decreasing, -1 non-increasing, 0 unread,
# None unknown), and a sound interval of the value over the box of limits ----------------

_Dirs = dict[str, int | None]
_Interval = tuple[int, int] | None


@dataclass
class _Value:
    dirs: _Dirs
    span: _Interval

    @property
    def constant(self) -> bool:
        return not self.dirs

    def sign(self) -> int | None:
        if self.span is None:
            return None
        if self.span[0] >= 0:
            return 1
        return -1 if self.span[1] <= 0 else None


def _combine(a: int | None, b: int | None) -> int | None:
    if a == 0:
        return b
    if b == 0 or a == b:
        return a
    return None


def _merge(*parts: _Dirs) -> _Dirs:
    out: _Dirs = {}
    for dirs in parts:
        for name, d in dirs.items():
            out[name] = _combine(out[name], d) if name in out else d
    return out


def _scaled(dirs: _Dirs, sign: int | None) -> _Dirs:
    """``dirs`` of a factor, times the sign of the other factor (unknown sign: unknown direction)."""
    return {n: (0 if d == 0 else None if d is None or sign is None else d * sign) for n, d in dirs.items()}


def _corners(op: object, a: _Interval, b: _Interval) -> _Interval:
    """The interval of ``op(x, y)`` over two intervals, for ``op`` monotone in each argument."""
    if a is None or b is None:
        return None
    values = [op(x, y) for x in a for y in b]  # type: ignore[operator]
    return min(values), max(values)


class _Analysis:
    """Walks a checked expression tree; reads the box of limits and the fixed facts."""

    def __init__(self, limits: Mapping[str, FactLimit], fixed: Mapping[str, int]) -> None:
        self.limits = limits
        self.fixed = fixed
        self.missing: list[str] = []

    def walk(self, node: ast.expr) -> _Value:
        if isinstance(node, ast.Constant):
            constant = int(node.value)  # type: ignore[arg-type]  # parse_expression admits integers only
            return _Value({}, (constant, constant))
        if isinstance(node, ast.Name):
            limit = self.limits.get(node.id)
            if limit is not None:
                return _Value({node.id: 1}, (limit.low, limit.high))
            if node.id in self.fixed:
                value = self.fixed[node.id]
                return _Value({}, (value, value))
            self.missing.append(node.id)
            return _Value({}, None)
        if isinstance(node, ast.UnaryOp):
            inner = self.walk(node.operand)
            if isinstance(node.op, ast.UAdd):
                return inner
            flipped = None if inner.span is None else (-inner.span[1], -inner.span[0])
            return _Value({n: None if d is None else -d for n, d in inner.dirs.items()}, flipped)
        if isinstance(node, ast.BinOp):
            return self.binary(node.op, self.walk(node.left), self.walk(node.right))
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)  # parse_expression checked it
        args = [self.walk(a) for a in node.args]
        name = node.func.id
        if name in ("max", "min"):
            spans = [a.span for a in args]
            span: _Interval = None
            if all(s is not None for s in spans):
                pick = max if name == "max" else min
                span = (pick(s[0] for s in spans), pick(s[1] for s in spans))  # type: ignore[index]
            return _Value(_merge(*(a.dirs for a in args)), span)
        return self.divide(FUNCTIONS[name][0], args[0], args[1], rounds=name == "round_up")

    def binary(self, op: ast.operator, a: _Value, b: _Value) -> _Value:
        if isinstance(op, ast.Add):
            span = None if a.span is None or b.span is None else (a.span[0] + b.span[0], a.span[1] + b.span[1])
            return _Value(_merge(a.dirs, b.dirs), span)
        if isinstance(op, ast.Sub):
            flipped = None if b.span is None else (-b.span[1], -b.span[0])
            negated = _Value({n: None if d is None else -d for n, d in b.dirs.items()}, flipped)
            return self.binary(ast.Add(), a, negated)
        if isinstance(op, ast.Mult):
            # a2*b2 - a1*b1 = (a2 - a1)*b2 + a1*(b2 - b1): monotone where both terms share a sign.
            dirs = _merge(_scaled(a.dirs, b.sign()), _scaled(b.dirs, a.sign()))
            return _Value(dirs, _corners(lambda x, y: x * y, a.span, b.span))
        if isinstance(op, ast.FloorDiv):
            return self.divide(lambda x, y: x // y, a, b, rounds=False)
        # a % b: bounded by a positive divisor, monotone in nothing.
        span = (0, b.span[1] - 1) if b.span is not None and b.span[0] > 0 else None
        if a.constant and b.constant and a.span is not None and b.span is not None and b.span[0] > 0:
            value = a.span[0] % b.span[0]
            span = (value, value)
        return _Value({n: None for n in (*a.dirs, *b.dirs)}, span)

    def divide(self, op: object, a: _Value, b: _Value, *, rounds: bool) -> _Value:
        """``a // b``, ``ceil_div(a, b)`` or ``round_up(a, b)``: monotone only over a divisor positive on the box."""
        if b.span is None or b.span[0] <= 0:
            return _Value({n: None for n in (*a.dirs, *b.dirs)}, None)
        if rounds:
            # round_up(a, b) is non-decreasing in a, and monotone in no divisor that varies.
            dirs = _merge(a.dirs, {n: (0 if d == 0 else None) for n, d in b.dirs.items()})
            # a <= round_up(a, b) <= a + b - 1 for b > 0.
            span = None if a.span is None else (a.span[0], a.span[1] + b.span[1] - 1)
            if b.constant and a.span is not None:
                span = (round_up(a.span[0], b.span[0]), round_up(a.span[1], b.span[0]))
            return _Value(dirs, span)
        # a // b and ceil_div(a, b) over b > 0: non-decreasing in a; in b, non-increasing for a >= 0.
        sign = a.sign()
        dirs = _merge(a.dirs, _scaled(b.dirs, None if sign is None else -sign))
        return _Value(dirs, _corners(op, a.span, b.span))


def _refusal(rule: SizeRule, why: str) -> RuleError:
    return RuleError(f"cannot bound rule {rule_label(rule.setting, rule.source)}: {why}", path=rule.setting or None)


def _missing_hint(rule: SizeRule, name: str) -> str:
    where = f"--limit {name}=MAX"
    if len(rule.setting) == 4 and rule.setting[0] == "pools":
        where += f", or set a default fact {describe_setting(('pools', rule.setting[1], 'facts', name))}"
    return f"fact {name!r} has neither a limit nor a default: give it a limit ({where})"


def bound_rule(
    rule: SizeRule, limits: Mapping[str, FactLimit], defaults: Mapping[str, int] | None = None, *, name: str = ""
) -> RuleBound:
    """Return the largest size ``rule`` asks for over ``limits``, the facts in ``defaults`` without a limit fixed.

    A limit wins over a default of the same fact. Exact: the bound is the size
    at some point within the limits, and no point asks for more.

    Raises:
        RuleError: A fact the rule reads has neither a limit nor a default; or a
            fact is neither proven monotone nor small enough to search (both named);
            or the rule fails at every point it was evaluated at.
    """
    label = name or (rule.setting[-1] if rule.setting else rule.source)
    if isinstance(rule, LiteralRule):
        return RuleBound(label, rule.source, rule.setting, rule.nbytes, "literal")
    assert isinstance(rule, ExpressionRule)
    fixed = dict(defaults or {})
    analysis = _Analysis(limits, fixed)
    value = analysis.walk(parse_expression(rule.source, rule.setting))
    if analysis.missing:
        raise _refusal(rule, _missing_hint(rule, analysis.missing[0]))
    point = {n: fixed[n] for n in rule.names if n not in limits}
    unknown: list[str] = []
    for fact in rule.names:
        if fact not in limits:
            continue
        direction = value.dirs.get(fact, 0)
        if direction is None:
            unknown.append(fact)
        else:
            point[fact] = limits[fact].low if direction < 0 else limits[fact].high
    if not unknown:
        try:
            nbytes = rule.evaluate(point)
        except RuleError as exc:  # the largest point fails, and so does every other
            raise _refusal(rule, f"it fails where it is largest: {exc}") from None
        return RuleBound(label, rule.source, rule.setting, nbytes, "proven", MappingProxyType(point))
    return _search(rule, label, limits, point, unknown)


def _search(
    rule: ExpressionRule, label: str, limits: Mapping[str, FactLimit], point: dict[str, int], unknown: list[str]
) -> RuleBound:
    """Try every value of the facts not proven monotone, the others fixed at their proven corner."""
    axes: list[Iterable[int]] = []
    total = 1
    for fact in unknown:
        limit = limits[fact]
        if limit.values is None and limit.count() > MAX_RANGE_VALUES:
            raise _refusal(
                rule,
                f"the size is not proven monotone in fact {fact!r}, and its range {limit.describe()} "
                f"({limit.source}) has more than {MAX_RANGE_VALUES} values to search: give it a set of values "
                f"(--limit {fact}=A,B,C) or a smaller range",
            )
        axes.append(limit.values if limit.values is not None else range(limit.low, limit.high + 1))
        total *= limit.count()
    if total > MAX_SEARCH_POINTS:
        raise _refusal(
            rule,
            f"the size is not proven monotone in facts {', '.join(unknown)}, whose {total} combinations exceed "
            f"{MAX_SEARCH_POINTS}: give fact {unknown[0]!r} fewer values",
        )
    best: tuple[int, dict[str, int]] | None = None
    failure: RuleError | None = None
    for values in itertools.product(*axes):
        point.update(zip(unknown, values, strict=True))
        try:
            nbytes = rule.evaluate(point)
        except RuleError as exc:  # a call that would fail asks for nothing
            failure = exc
            continue
        if best is None or nbytes > best[0]:
            best = (nbytes, dict(point))
    if best is None:
        assert failure is not None
        raise _refusal(rule, f"it fails at every point within the limits: {failure}")
    return RuleBound(
        label, rule.source, rule.setting, best[0], "searched", MappingProxyType(best[1]), total, tuple(unknown)
    )


def facts_beyond(
    names: Iterable[str], facts: Mapping[str, object], limits: Mapping[str, FactLimit]
) -> list[tuple[str, object, FactLimit]]:
    """Return ``(fact, value, limit)`` for each fact of ``names`` whose value in ``facts`` lies outside its limit."""
    out: list[tuple[str, object, FactLimit]] = []
    for fact in names:
        limit = limits.get(fact)
        value = facts.get(fact)
        if limit is not None and isinstance(value, int) and not limit.allows(value):
            out.append((fact, value, limit))
    return out


# -- a registry's reservation over limits ---------------------------------------------------


class _Registry(Protocol):
    """What a reservation reads of a registry (:class:`wspool.registry.PoolRegistry`)."""

    def pool_names(self) -> list[str]: ...

    def pool(self, name: str, device: DeviceLike = None, *, lane: str | None = None) -> WorkspacePool: ...


@dataclass(frozen=True)
class PlannedRule:
    """One rule of one pool on one device and lane: its bound, or why it has none (``refusal``)."""

    pool: str
    rule: str
    buffer: str
    device: str
    lane: str
    bound: RuleBound | None
    refusal: str | None = None


@dataclass(frozen=True)
class Reservation:
    """What :func:`plan_reservation` found: a row per rule, and the bytes each buffer is reserved at.

    ``buffers`` maps ``(buffer pool, device, lane)`` to the largest bound over its
    planned rules (a shared buffer holds the largest of its pools' rules).
    """

    limits: Mapping[str, FactLimit]
    rows: tuple[PlannedRule, ...]
    buffers: Mapping[tuple[str, str, str], int]

    @property
    def refusals(self) -> list[PlannedRule]:
        """The rows whose rule could not be bounded."""
        return [row for row in self.rows if row.refusal is not None]

    @property
    def total_bytes(self) -> int:
        """The bytes of every reserved buffer together."""
        return sum(self.buffers.values())

    def summary(self) -> str:
        """Return one line: each buffer and its bytes, the total, and how many rules were refused."""
        parts = [f"{name} {format_size(n)} ({device}, lane {lane})" for (name, device, lane), n in self.buffers.items()]
        refused = f"; {len(self.refusals)} rule(s) not bounded" if self.refusals else ""
        held = ", ".join(parts) or "none"
        return f"{format_size(self.total_bytes)} in {len(self.buffers)} buffer(s): {held}{refused}"

    def as_dict(self) -> dict[str, Any]:
        """Return the plan as plain data (``wspool plan --json``)."""
        return {
            "limits": {name: limit.describe() for name, limit in self.limits.items()},
            "rules": [
                {
                    "pool": row.pool,
                    "rule": row.rule,
                    "buffer": row.buffer,
                    "device": row.device,
                    "lane": row.lane,
                    "bytes": row.bound.nbytes if row.bound else None,
                    "size": format_size(row.bound.nbytes) if row.bound else None,
                    "method": row.bound.method if row.bound else "refused",
                    "facts": dict(row.bound.facts) if row.bound else {},
                    "points": row.bound.points if row.bound else 0,
                    "source": row.bound.source if row.bound else None,
                    "refusal": row.refusal,
                }
                for row in self.rows
            ],
            "buffers": [
                {"buffer": name, "device": device, "lane": lane, "bytes": n, "size": format_size(n)}
                for (name, device, lane), n in self.buffers.items()
            ],
            "total_bytes": self.total_bytes,
        }


def plan_reservation(
    registry: _Registry,
    limits: Mapping[str, object],
    *,
    pools: Iterable[str] | None = None,
    devices: Iterable[DeviceLike] = (None,),
    lanes: Iterable[str] = (DEFAULT_LANE,),
    facts: Mapping[str, int] | None = None,
    rules: Mapping[str, Iterable[str]] | None = None,
) -> Reservation:
    """Bound every rule of ``pools`` (``None``: all) on each of ``devices`` and ``lanes``; allocates nothing.

    Pool instances are created (without buffers) to read each device's profile
    and facts; ``facts`` fix further facts over those defaults. ``rules`` names,
    for a pool in it, the only rules to bound (those an engine's calls use). A
    rule that cannot be bounded is a row with its ``refusal``.
    """
    chosen = {pool: set(names) for pool, names in (rules or {}).items()}
    checked = to_limits(limits)
    rows: list[PlannedRule] = []
    buffers: dict[tuple[str, str, str], int] = {}
    names = list(registry.pool_names() if pools is None else pools)
    for device in devices:
        for lane in lanes:
            for name in names:
                instance = registry.pool(name, device, lane=lane)
                spec = instance.spec
                key = (spec.name, str(instance.device), lane)
                for rule, compiled in spec.rules.items():
                    if spec.rule_pools.get(rule, spec.name) != name or rule not in chosen.get(name, (rule,)):
                        continue
                    try:
                        defaults = {**instance.default_facts(rule), **(facts or {})}
                        found = bound_rule(compiled, checked, defaults, name=rule)
                    except RuleError as exc:
                        rows.append(PlannedRule(name, rule, spec.name, key[1], lane, None, str(exc)))
                        continue
                    rows.append(PlannedRule(name, rule, spec.name, key[1], lane, found))
                    buffers[key] = max(buffers.get(key, 0), found.nbytes)
    return Reservation(MappingProxyType(checked), tuple(rows), MappingProxyType(buffers))


def apply_reservation(registry: _Registry, plan: Reservation) -> None:
    """Grow each planned buffer to its bytes, and have its pool name the limits when a frozen growth is refused.

    Raises:
        WorkspaceLimitError: A buffer cannot be allocated (the device's memory, ``max_bytes``).
        WorkspaceFrozenError: The registry is frozen and a buffer would have to grow.
    """
    refusal = partial(_beyond_limits, plan.limits)
    for (name, device, lane), nbytes in plan.buffers.items():
        instance = registry.pool(name, device, lane=lane)
        instance.request(nbytes, "reservation for the limits")
        instance.limits_refusal = refusal
    logger.info("wspool: reserved %s", plan.summary())


def _beyond_limits(
    limits: Mapping[str, FactLimit],
    pool: WorkspacePool,
    reason: str,
    names: tuple[str, ...],
    facts: Mapping[str, object],
    error: WorkspaceFrozenError,
) -> WorkspaceFrozenError:
    """The error for a frozen, reserved pool asked to grow: it names each fact of ``names`` beyond its limit, if any."""
    beyond = facts_beyond(names, facts, limits)
    if not beyond:
        return error
    named = "; ".join(
        f"fact {fact}={value} is beyond its limit {limit.describe()} (raise it: {limit.source})"
        for fact, value, limit in beyond
    )
    return WorkspaceFrozenError(
        f"pool {pool.spec.name!r} on {pool.device} (lane {pool.lane}) was reserved for its limits and is frozen: "
        f"{reason} asks for more for this call: {named}. Nothing grows after the reservation; the call is refused "
        f"and the buffer is kept"
    )
