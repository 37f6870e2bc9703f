"""Sizing rules: a literal size, or a safe arithmetic expression over call facts.

A rule such as ``"8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB"``
is parsed once, checked against a whitelist (integers, size literals,
``+ - * // %``, unary minus, parentheses, names, and the functions ``max``,
``min``, ``round_up`` and ``ceil_div``) and compiled into a tree of closures.
Nothing reaches ``eval``/``exec``; expressions are bounded in length, depth
and the magnitude of every intermediate result, so no input hangs or builds
giant integers.

Resolution is cached per distinct tuple of the facts a rule reads, so in the
steady state a call costs one C-level ``itemgetter`` and one dict lookup.
Rules are immutable and safe to share across threads and devices.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence

from wspool.errors import RuleError, SizeError, describe_setting
from wspool.rule_compiler import FUNCTIONS as FUNCTIONS
from wspool.rule_compiler import MAX_EXPRESSION_DEPTH as MAX_EXPRESSION_DEPTH
from wspool.rule_compiler import MAX_EXPRESSION_LENGTH as MAX_EXPRESSION_LENGTH
from wspool.rule_compiler import MAX_MAGNITUDE, compile_expression, rule_label
from wspool.units import MAX_SIZE_BYTES, format_size, parse_size

__all__ = [
    "FUNCTIONS",
    "MAX_EXPRESSION_DEPTH",
    "MAX_EXPRESSION_LENGTH",
    "ExpressionRule",
    "LiteralRule",
    "SizeRule",
    "compile_rule",
]

#: Distinct fact tuples remembered per rule before the cache starts over.
RESOLVE_CACHE_SIZE = 4096

_Facts = Mapping[str, object]
_Eval = Callable[[_Facts], int]


class SizeRule:
    """A compiled sizing rule; see :func:`compile_rule`.

    Attributes:
        source: The rule as written.
        setting: The key path of the rule (``pools.<pool>.rules.<name>``).
        names: The facts the rule reads, sorted.
    """

    __slots__ = ("names", "setting", "source")

    source: str
    setting: tuple[str, ...]
    names: tuple[str, ...]

    def resolve(self, facts: _Facts, defaults: _Facts | None = None) -> int:
        """Return the rule's size in bytes for a call's facts.

        Args:
            facts: The call's facts.
            defaults: Facts read where ``facts`` lacks a name the rule reads
                (a pool's default and device facts); ``facts`` wins.

        Raises:
            RuleError: A fact the rule reads is missing or not an integer, or
                the result is not a positive size.
        """
        raise NotImplementedError

    def _where(self) -> str:
        return rule_label(self.setting, self.source)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source!r})"


class LiteralRule(SizeRule):
    """A rule that is a fixed size, whatever the call."""

    __slots__ = ("nbytes",)

    def __init__(self, source: str, nbytes: int, setting: tuple[str, ...]) -> None:
        self.source = source
        self.setting = setting
        self.names = ()
        self.nbytes = nbytes

    def resolve(self, facts: _Facts, defaults: _Facts | None = None) -> int:
        return self.nbytes


class ExpressionRule(SizeRule):
    """A rule computed from the call's facts, cached per distinct fact tuple."""

    __slots__ = ("_cache", "_evaluate", "_key_of")

    def __init__(self, source: str, evaluate: _Eval, names: tuple[str, ...], setting: tuple[str, ...]) -> None:
        self.source = source
        self.setting = setting
        self.names = names
        self._evaluate = evaluate
        self._cache: dict[object, int] = {}
        self._key_of: Callable[[_Facts], object] = operator.itemgetter(*names) if names else (lambda facts: ())

    def resolve(self, facts: _Facts, defaults: _Facts | None = None) -> int:
        try:
            key = self._key_of(facts)
            nbytes = self._cache.get(key)
        except KeyError:
            return self._with_defaults(facts, defaults)
        except TypeError:  # an unhashable fact: _resolve_miss names it
            nbytes = None
        if nbytes is not None:
            # Only exact ints hit the cache: True, 1.0, Decimal(1) and 1+0j hash and compare
            # equal to 1, so a hit with them must not skip the type check. The subclasses
            # below unroll this loop for one to three facts; __class__ reads faster than type().
            for value in key:  # type: ignore[attr-defined]
                if type(value) is not int:
                    break
            else:
                return nbytes
        return self._resolve_miss(facts)

    def _with_defaults(self, facts: _Facts, defaults: _Facts | None) -> int:
        """Resolve a call that leaves facts to the defaults: it pays one merge, then the cached path."""
        if not defaults:
            raise self._missing(facts) from None
        return self.resolve({**defaults, **facts})

    def _resolve_miss(self, facts: _Facts) -> int:
        """Check the facts' types, then look up or compute the size under a key of plain ints."""
        checked = self._checked(facts)
        key = self._key_of(checked)
        nbytes = self._cache.get(key)
        if nbytes is None:
            nbytes = self._compute(checked)
            if len(self._cache) >= RESOLVE_CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = nbytes  # plain ints only: a tensor fact is never kept alive here
        return nbytes

    def evaluate(self, facts: _Facts) -> int:
        """Resolve without touching the cache (for tools and tests)."""
        try:
            self._key_of(facts)
        except KeyError:
            raise self._missing(facts) from None
        return self._compute(self._checked(facts))

    def _missing(self, facts: _Facts) -> RuleError:
        missing = [n for n in self.names if n not in facts]
        supplied = ", ".join(sorted(facts)) or "none"
        hint = ""
        if len(self.setting) == 4 and self.setting[0] == "pools":
            # Call sites that cannot pass a fact (an engine's fixed call) take it from the configuration.
            keys = " or ".join(describe_setting(("pools", self.setting[1], "facts", name)) for name in missing)
            hint = f"; pass it in the call or set it as a default fact: {keys}"
        return RuleError(
            f"rule {self._where()} needs fact(s) {', '.join(missing)} "
            f"that the call did not supply (supplied: {supplied}){hint}",
            path=self.setting or None,
        )

    def _checked(self, facts: _Facts) -> _Facts:
        """Return the facts the rule reads as plain ints, or raise naming the first one that is not an integer.

        Integers of other types (numpy integers, one-element integer tensors) are converted with
        ``operator.index``; bool, float, Decimal, complex and anything unhashable are refused.
        """
        plain: dict[str, object] = dict(facts)
        for name in self.names:
            value = facts[name]
            if type(value) is not int:
                try:
                    if isinstance(value, bool):
                        raise TypeError
                    value = operator.index(value)  # type: ignore[arg-type]
                except (TypeError, ValueError, RuntimeError):
                    raise RuleError(
                        f"rule {self._where()}: fact {name!r} must be an integer, got "
                        f"{type(value).__name__} {_short(value)}",
                        path=self.setting or None,
                    ) from None
                plain[name] = int(value)
            if abs(plain[name]) > MAX_MAGNITUDE:  # type: ignore[arg-type]
                raise RuleError(
                    f"rule {self._where()}: fact {name!r} = {_short(plain[name])} is out of range",
                    path=self.setting or None,
                )
        return plain

    def _compute(self, facts: _Facts) -> int:
        """Evaluate for facts :meth:`_checked` returned."""
        try:
            nbytes = self._evaluate(facts)
        except (ZeroDivisionError, OverflowError) as exc:
            raise RuleError(
                f"rule {self._where()} failed for facts {_show_facts(facts, self.names)}: {exc}",
                path=self.setting or None,
            ) from None
        if nbytes <= 0 or nbytes > MAX_SIZE_BYTES:
            bound = "is not positive" if nbytes <= 0 else f"exceeds {format_size(MAX_SIZE_BYTES)}"
            raise RuleError(
                f"rule {self._where()} resolved to {nbytes} bytes for facts "
                f"{_show_facts(facts, self.names)}, which {bound}",
                path=self.setting or None,
            )
        return nbytes


class _OneFactRule(ExpressionRule):
    """An expression of one fact: itemgetter returns the value itself."""

    __slots__ = ()

    def resolve(self, facts: _Facts, defaults: _Facts | None = None) -> int:
        try:
            key = self._key_of(facts)
            nbytes = self._cache.get(key)
        except KeyError:
            return self._with_defaults(facts, defaults)
        except TypeError:
            nbytes = None
        if nbytes is not None and key.__class__ is int:
            return nbytes
        return self._resolve_miss(facts)


class _TwoFactRule(ExpressionRule):
    """An expression of two facts (the type check unrolled)."""

    __slots__ = ()

    def resolve(self, facts: _Facts, defaults: _Facts | None = None) -> int:
        try:
            key = self._key_of(facts)
            nbytes = self._cache.get(key)
        except KeyError:
            return self._with_defaults(facts, defaults)
        except TypeError:
            nbytes = None
        if nbytes is not None:
            a, b = key  # type: ignore[misc,has-type]
            if a.__class__ is int and b.__class__ is int:  # type: ignore[has-type]
                return nbytes
        return self._resolve_miss(facts)


class _ThreeFactRule(ExpressionRule):
    """An expression of three facts (the type check unrolled)."""

    __slots__ = ()

    def resolve(self, facts: _Facts, defaults: _Facts | None = None) -> int:
        try:
            key = self._key_of(facts)
            nbytes = self._cache.get(key)
        except KeyError:
            return self._with_defaults(facts, defaults)
        except TypeError:
            nbytes = None
        if nbytes is not None:
            a, b, c = key  # type: ignore[misc,has-type]
            if a.__class__ is int and b.__class__ is int and c.__class__ is int:  # type: ignore[has-type]
                return nbytes
        return self._resolve_miss(facts)


_BY_ARITY: dict[int, type[ExpressionRule]] = {1: _OneFactRule, 2: _TwoFactRule, 3: _ThreeFactRule}


def _short(value: object) -> str:
    """A fact's repr, shortened and with control characters escaped."""
    text = repr(value)
    return text if len(text) <= 80 else text[:38] + "..." + text[-38:]


def _show_facts(facts: _Facts, names: Sequence[str]) -> str:
    return "{" + ", ".join(f"{n}={facts[n]!r}" for n in names) + "}"


def compile_rule(source: object, setting: Sequence[str] = ()) -> SizeRule:
    """Compile a rule from its configured value.

    Args:
        source: A size (``268435456``, ``"256MiB"``) or an expression string.
        setting: The key path of the rule, named in errors.

    Returns:
        A :class:`LiteralRule` when the value is a plain size, else an
        :class:`ExpressionRule`. Expressions without names are folded to
        literals.

    Raises:
        RuleError: The value is not a size and not a valid expression, or a
            literal size is not positive.
    """
    path = tuple(setting)
    if isinstance(source, bool) or not isinstance(source, (int, str)):
        raise RuleError(
            f"rule {rule_label(path, str(source))} must be a size or an expression string, "
            f"got {type(source).__name__} {source!r}",
            path=path or None,
        )
    text = str(source)
    try:
        nbytes: int | None = parse_size(source, setting=path or None)
    except SizeError:
        if isinstance(source, int):
            raise
        nbytes = None
    if nbytes is None:
        evaluate, names = compile_expression(text, path)
        if names:
            return _BY_ARITY.get(len(names), ExpressionRule)(text, evaluate, names, path)
        rule = ExpressionRule(text, evaluate, (), path)
        nbytes = rule.evaluate({})
    if nbytes <= 0:
        raise RuleError(f"rule {rule_label(path, text)} must be a positive size, got {nbytes} bytes", path=path or None)
    return LiteralRule(text, nbytes, path)
