"""Compiling a rule's expression: parse, check against the whitelist, build closures.

The whitelist: integers, size literals (``1MiB``), ``+ - * // %``, unary
minus, parentheses, fact names, and the functions in :data:`FUNCTIONS`.
Nothing reaches ``eval``/``exec``; an expression is bounded in length, depth
and number of parts, and every intermediate result in magnitude, so no input
hangs or builds giant integers. Compiling runs once per distinct rule (cached);
the closures it returns are pure and safe to share across threads.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping
from functools import lru_cache

from wspool.errors import RuleError, SizeError, describe_setting
from wspool.units import UNIT_BYTES, parse_size

__all__ = [
    "FUNCTIONS",
    "MAX_EXPRESSION_DEPTH",
    "MAX_EXPRESSION_LENGTH",
    "MAX_EXPRESSION_NODES",
    "MAX_MAGNITUDE",
    "Evaluator",
    "Facts",
    "compile_expression",
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


def _round_up(value: int, multiple: int) -> int:
    if multiple <= 0:
        raise ZeroDivisionError("round_up's multiple must be positive")
    return -(-value // multiple) * multiple


def _ceil_div(value: int, divisor: int) -> int:
    if divisor <= 0:
        raise ZeroDivisionError("ceil_div's divisor must be positive")
    return -(-value // divisor)


#: The functions an expression may call, with their arity (None: two or more).
FUNCTIONS: dict[str, tuple[Callable[..., int], int | None]] = {
    "max": (max, None),
    "min": (min, None),
    "round_up": (_round_up, 2),
    "ceil_div": (_ceil_div, 2),
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
        detail = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
        raise compiler.fail(f"not a valid expression ({detail})") from None
    evaluate = compiler.build(tree.body)
    return evaluate, tuple(sorted(compiler.names))
