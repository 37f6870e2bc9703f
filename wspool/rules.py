"""Sizing rules: a literal size, or a safe arithmetic expression over call facts.

An expression is parsed once against a whitelist (integers, sizes, facts,
``+ - * // %``, parentheses, ``max``, ``min``, ``round_up``, ``ceil_div``),
bounded in length, depth and magnitude, and compiled into closures; nothing
reaches ``eval``. Resolution is cached per tuple of the facts a rule reads.
Rules are immutable and safe to share across threads and devices.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

from wspool.errors import RuleError, SizeError, describe_setting, readable_int
from wspool.units import MAX_SIZE_BYTES, UNIT_BYTES, ceil_div, format_size, parse_size, round_up, size_spelling_hint

__all__ = [
    "FUNCTIONS",
    "MAX_EXPRESSION_DEPTH",
    "MAX_EXPRESSION_LENGTH",
    "MAX_EXPRESSION_NODES",
    "MAX_MAGNITUDE",
    "Evaluator",
    "ExpressionRule",
    "Facts",
    "LiteralRule",
    "SizeRule",
    "compile_expression",
    "compile_rule",
    "parse_expression",
    "rule_label",
]


MAX_EXPRESSION_LENGTH = 1000
MAX_EXPRESSION_DEPTH = 32
MAX_EXPRESSION_NODES = 256
#: Bound on every constant, fact and intermediate result.
MAX_MAGNITUDE = 1 << 64
Facts = Mapping[str, object]
#: A compiled expression: facts in, bytes out.
Evaluator = Callable[[Facts], int]

_SIZE_LITERAL_RE = re.compile(
    r"(?<![\w.])(\d+(?:\.\d+)?)\s*(" + "|".join(u for u in UNIT_BYTES if u) + r")(?!\w)",
    re.IGNORECASE | re.ASCII,
)


#: The functions an expression may call, with their arity (None: two or more).
FUNCTIONS: dict[str, tuple[Callable[..., int], int | None]] = {
    "max": (max, None),
    "min": (min, None),
    "round_up": (round_up, 2),
    "ceil_div": (ceil_div, 2),
}

_BINARY_OPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_OP_HINTS: dict[type[ast.operator], str] = {
    ast.Div: "'/' is not allowed: use '//' (integer division) or ceil_div(a, b)",
    ast.Pow: "'**' is not allowed: write the product out, or use a literal size",
}


def _bounded(value: int) -> int:
    if -MAX_MAGNITUDE <= value <= MAX_MAGNITUDE:
        return value
    raise OverflowError(f"an intermediate result exceeds {MAX_MAGNITUDE}")


def rule_label(setting: tuple[str, ...], source: str) -> str:
    """Return ``"key / ENV = 'source'"``, or just ``"'source'"`` for a rule outside any config."""
    return f"{describe_setting(setting)} = {source!r}" if setting else repr(source)


class _Compiler:
    """Checks an AST against the whitelist and turns it into closures."""

    def __init__(self, source: str, setting: tuple[str, ...]) -> None:
        self.source = source
        self.setting = setting
        self.names: set[str] = set()
        self.nodes = 0

    def fail(self, why: str) -> RuleError:
        return RuleError(f"invalid rule {rule_label(self.setting, self.source)}: {why}", path=self.setting or None)

    def build(self, node: ast.AST, depth: int = 0) -> Evaluator:
        self.nodes += 1
        if depth > MAX_EXPRESSION_DEPTH:
            raise self.fail(f"expression nests deeper than {MAX_EXPRESSION_DEPTH} levels")
        if self.nodes > MAX_EXPRESSION_NODES:
            raise self.fail(f"expression has more than {MAX_EXPRESSION_NODES} parts")
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.fail(f"only integer constants and sizes are allowed, not {value!r}")
            if value > MAX_MAGNITUDE:
                raise self.fail(f"constant {value} is too large")
            return lambda facts: value
        if isinstance(node, ast.Name):
            name = node.id
            if name.startswith("_"):
                raise self.fail(f"name {name!r} is not allowed")
            self.names.add(name)
            return lambda facts: facts[name]  # type: ignore[return-value]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = self.build(node.operand, depth + 1)
            if isinstance(node.op, ast.USub):
                return lambda facts: -inner(facts)
            return inner
        if isinstance(node, ast.BinOp):
            op = _BINARY_OPS.get(type(node.op))
            if op is None:
                raise self.fail(_OP_HINTS.get(type(node.op), f"operator {type(node.op).__name__} is not allowed"))
            left = self.build(node.left, depth + 1)
            right = self.build(node.right, depth + 1)
            return lambda facts: _bounded(op(left(facts), right(facts)))
        if isinstance(node, ast.Call):
            return self.build_call(node, depth)
        kind = type(node).__name__
        raise self.fail(
            f"{kind} is not allowed (only integers, sizes, fact names, + - * // %, "
            f"parentheses and {', '.join(FUNCTIONS)})"
        )

    def build_call(self, node: ast.Call, depth: int) -> Evaluator:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            shown = repr(node.func.id) if isinstance(node.func, ast.Name) else "an attribute or expression"
            raise self.fail(f"calling {shown} is not allowed (functions: {', '.join(FUNCTIONS)})")
        name = node.func.id
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise self.fail(f"{name}() takes positional arguments only")
        func, arity = FUNCTIONS[name]
        if (arity is None and len(node.args) < 2) or (arity is not None and len(node.args) != arity):
            wanted = "at least 2" if arity is None else str(arity)
            raise self.fail(f"{name}() takes {wanted} argument(s), got {len(node.args)}")
        args = tuple(self.build(a, depth + 1) for a in node.args)
        if len(args) == 2:
            a, b = args
            return lambda facts: _bounded(func(a(facts), b(facts)))
        return lambda facts: _bounded(func(*[arg(facts) for arg in args]))


def _substitute_size_literals(source: str, setting: tuple[str, ...]) -> str:
    def to_bytes(match: re.Match[str]) -> str:
        return str(parse_size(match.group(0), setting=setting or None))

    return _SIZE_LITERAL_RE.sub(to_bytes, source)


@lru_cache(maxsize=1024)
def compile_expression(source: str, setting: tuple[str, ...]) -> tuple[Evaluator, tuple[str, ...]]:
    compiler = _Compiler(source, setting)
    if len(source) > MAX_EXPRESSION_LENGTH:
        raise compiler.fail(f"expression is longer than {MAX_EXPRESSION_LENGTH} characters")
    if not source.strip():
        raise compiler.fail("rule is empty")
    try:
        text = _substitute_size_literals(source, setting)
        tree = ast.parse(text.strip(), mode="eval")
    except SizeError as exc:
        raise compiler.fail(str(exc)) from None
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        hint = size_spelling_hint(source)  # 512M, 1Gi: a size spelled as Kubernetes or Docker spell one
        if hint is not None:
            raise compiler.fail(hint) from None
        detail = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
        raise compiler.fail(f"not a valid expression ({detail})") from None
    evaluate = compiler.build(tree.body)
    return evaluate, tuple(sorted(compiler.names))


def parse_expression(source: str, setting: tuple[str, ...] = ()) -> ast.expr:
    """Return the checked syntax tree of an expression, its sizes as byte integers (for :mod:`wspool.bounds`).

    Raises:
        RuleError: The expression is not one :func:`compile_expression` accepts; names ``setting``.
    """
    compile_expression(source, setting)
    return ast.parse(_substitute_size_literals(source, setting).strip(), mode="eval").body


#: Distinct fact tuples remembered per rule before the cache starts over.
RESOLVE_CACHE_SIZE = 4096

_Facts = Mapping[str, object]
_Eval = Callable[[_Facts], int]


class SizeRule:
    """A compiled sizing rule (:func:`compile_rule`); ``names`` are the facts it reads, sorted."""

    __slots__ = ("names", "setting", "source")

    source: str
    setting: tuple[str, ...]
    names: tuple[str, ...]

    def resolve(self, facts: _Facts, defaults: _Facts | None = None) -> int:
        """Return the rule's size in bytes for a call's ``facts``, over ``defaults``.

        ``RuleError``: a fact is missing or not an integer, or the result is not a positive size.
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
        """Return the facts the rule reads as plain ints (``operator.index``; bool refused), or raise naming one."""
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
    """A fact's repr, shortened (an integer of any size included)."""
    text = readable_int(value) if type(value) is int else repr(value)
    return text if len(text) <= 80 else text[:38] + "..." + text[-38:]


def _show_facts(facts: _Facts, names: Sequence[str]) -> str:
    return "{" + ", ".join(f"{n}={facts[n]!r}" for n in names) + "}"


def compile_rule(source: object, setting: Sequence[str] = ()) -> SizeRule:
    """Compile a configured size or expression; expressions without names fold to a :class:`LiteralRule`.

    ``RuleError`` names ``setting`` for an invalid expression or a size that is not positive.
    """
    path = tuple(setting)
    if isinstance(source, bool) or not isinstance(source, (int, str)):
        raise RuleError(
            f"rule {rule_label(path, str(source))} must be a size or an expression string, "
            f"got {type(source).__name__} {source!r}",
            path=path or None,
        )
    try:
        nbytes: int | None = parse_size(source, setting=path or None)
    except SizeError:
        if isinstance(source, int):
            raise  # names the size readably, however many digits it has
        nbytes = None
    text = str(source)
    if nbytes is None:
        evaluate, names = compile_expression(text, path)
        if names:
            return _BY_ARITY.get(len(names), ExpressionRule)(text, evaluate, names, path)
        rule = ExpressionRule(text, evaluate, (), path)
        nbytes = rule.evaluate({})
    if nbytes <= 0:
        raise RuleError(f"rule {rule_label(path, text)} must be a positive size, got {nbytes} bytes", path=path or None)
    return LiteralRule(text, nbytes, path)
