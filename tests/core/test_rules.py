"""Tests for wspool.rules: literal and expression rules, the whitelist and the bounds."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wspool.errors import RuleError, SizeError
from wspool.rules import ExpressionRule, LiteralRule, compile_rule

LSE = "8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB + 32MiB"
PATH = ("pools", "flashinfer_mla", "rules", "lse")


def test_literal_rule() -> None:
    """A size literal compiles to a LiteralRule with that many bytes."""
    rule = compile_rule("256MiB", PATH)
    assert isinstance(rule, LiteralRule)
    assert rule.resolve({}) == 268435456


def test_constant_expression_folds_to_literal() -> None:
    """An expression without names is folded once into a literal."""
    rule = compile_rule("max(1MiB, 3 * 512KiB)")
    assert isinstance(rule, LiteralRule)
    assert rule.resolve({}) == 3 * 512 * 1024


def test_expression_rule_resolves_seed_slab() -> None:
    """The trtllm-gen softmax slab formula resolves from the call's facts."""
    rule = compile_rule(LSE, PATH)
    assert isinstance(rule, ExpressionRule)
    assert rule.names == ("batch_size", "num_heads", "q_len")
    facts = {"num_heads": 128, "batch_size": 512, "q_len": 1, "unused": 7}
    assert rule.resolve(facts) == 8 * 128 * 512 * 256 + 2**20 + 32 * 2**20


def test_functions_and_operators() -> None:
    """max, min, round_up, ceil_div, //, % and unary minus behave as integers do."""
    rule = compile_rule("max(a, b) + min(a, b) + round_up(a, 8) + ceil_div(a, 4) + a // 2 + a % 3 + -(-b)")
    a, b = 13, 5
    assert rule.resolve({"a": a, "b": b}) == 13 + 5 + 16 + 4 + 6 + 1 + 5


def test_resolution_is_cached() -> None:
    """A second resolution with the same facts is served from the cache."""
    rule = compile_rule("x * 2")
    assert isinstance(rule, ExpressionRule)
    assert rule.resolve({"x": 4}) == 8
    assert rule._cache == {4: 8}
    assert rule.resolve({"x": 4}) == 8


def test_missing_fact_names_rule_and_fact() -> None:
    """A fact the call did not supply is an error naming the rule key and the fact."""
    rule = compile_rule(LSE, PATH)
    with pytest.raises(RuleError, match=r"pools\.flashinfer_mla\.rules\.lse / .* needs fact\(s\) batch_size, q_len"):
        rule.resolve({"num_heads": 16})


@pytest.mark.parametrize(
    ("facts", "match"),
    [
        ({"x": 1.5}, "fact 'x' must be an integer, got float"),
        ({"x": True}, "fact 'x' must be an integer, got bool"),
        ({"x": "3"}, "fact 'x' must be an integer, got str"),
        ({"x": 0}, "is not positive"),
        ({"x": 2**70}, "out of range"),
    ],
)
def test_bad_facts(facts: dict[str, object], match: str) -> None:
    """Non-integer facts, zero results and huge facts are RuleErrors."""
    with pytest.raises(RuleError, match=match):
        compile_rule("x * 4096").resolve(facts)


def test_division_by_zero_is_a_rule_error() -> None:
    """x // 0 and round_up(x, 0) are reported, not raised as ZeroDivisionError."""
    with pytest.raises(RuleError, match="failed for facts"):
        compile_rule("x // y + 1").resolve({"x": 1, "y": 0})
    with pytest.raises(RuleError, match="multiple must be positive"):
        compile_rule("round_up(x, y)").resolve({"x": 1, "y": 0})


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("__import__('os').system('touch wspool-pwned')", "calling an attribute or expression is not allowed"),
        ("open('x')", "calling 'open' is not allowed"),
        ("x.real", "Attribute is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("[x for x in range(3)]", "ListComp is not allowed"),
        ("{x: 1}", "Dict is not allowed"),
        ("x if x else 1", "IfExp is not allowed"),
        ("x[0]", "Subscript is not allowed"),
        ("'abc'", "only integer constants"),
        ("1.5 * x", "only integer constants"),
        ("10 ** 10 ** 10", r"'\*\*' is not allowed"),
        ("x / 2", "use '//'"),
        ("x << 40", "LShift is not allowed"),
        ("x == 1", "Compare is not allowed"),
        ("__builtins__", "name '__builtins__' is not allowed"),
        ("max()", "takes at least 2 argument"),
        ("round_up(x)", "takes 2 argument"),
        ("max(x, key=y)", "positional arguments only"),
        ("max(*x)", "positional arguments only"),
        ("(x", "not a valid expression"),
        ("", "rule is empty"),
        ("x" + " + x" * 600, "longer than 1000 characters"),
        ("-" * 40 + "x", "deeper than 32"),
        ("99999999999999999999999 * x", "too large"),
        ("0", "must be a positive size"),
        ("1MiB - 2MiB", "is not positive"),
    ],
)
def test_whitelist_rejects_at_compile_time(
    source: str, match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anything outside the whitelist is rejected when the rule is compiled, and runs nothing."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuleError, match=match):
        compile_rule(source, ("pools", "p", "rules", "r"))
    assert not (tmp_path / "wspool-pwned").exists()


def test_size_bomb_is_rejected_quickly() -> None:
    """An exponent tower and a doubling chain are refused in well under a second."""
    start = time.perf_counter()
    with pytest.raises(RuleError):
        compile_rule("10 ** 10 ** 10")
    chain = "x" + " * x" * 20
    rule = compile_rule(chain)
    with pytest.raises(RuleError, match="exceeds"):
        rule.resolve({"x": 2**40})
    assert time.perf_counter() - start < 1.0


def test_non_string_rule_is_rejected() -> None:
    """A rule given as a list, float or bool is a RuleError naming the key."""
    for bad in ([1], 1.5, True, None):
        with pytest.raises(RuleError, match=r"must be a size or an expression string"):
            compile_rule(bad, PATH)


_NAMES = st.sampled_from(["batch_size", "num_heads", "q_len", "x"])
_LEAVES = st.one_of(st.integers(min_value=-(2**70), max_value=2**70).map(str), _NAMES, st.sampled_from(["1MiB", "4KB"]))


def _expressions() -> st.SearchStrategy[str]:
    ops = st.sampled_from([" + ", " - ", " * ", " // ", " % ", " / ", " ** ", " << ", ", "])
    return st.recursive(
        _LEAVES,
        lambda inner: st.one_of(
            st.tuples(inner, ops, inner).map("".join),
            inner.map(lambda e: f"({e})"),
            st.tuples(st.sampled_from(["max", "min", "round_up", "ceil_div", "abs", "x."]), inner, inner).map(
                lambda t: f"{t[0]}({t[1]}, {t[2]})"
            ),
            inner.map(lambda e: f"-{e}"),
        ),
        max_leaves=12,
    )


@given(_expressions(), st.dictionaries(_NAMES, st.integers(min_value=-(2**64), max_value=2**64)))
def test_random_expressions_only_raise_rule_errors(source: str, facts: dict[str, int]) -> None:
    """Generated expressions and facts either resolve to a bounded positive size or raise RuleError."""
    try:
        nbytes = compile_rule(source).resolve(facts)
    except RuleError:
        return
    assert 0 < nbytes <= 2**50


@given(st.text(max_size=60))
def test_random_text_only_raises_rule_errors(source: str) -> None:
    """Arbitrary text never escapes the whitelist: compile either succeeds or raises RuleError."""
    with contextlib.suppress(RuleError):
        compile_rule(source)


# -- facts are checked whatever the cache holds --------------------------------------------


@pytest.mark.parametrize("bad", [True, 1.0, __import__("decimal").Decimal(1), 1 + 0j])
def test_a_non_integer_fact_is_refused_even_after_its_integer_is_cached(bad: object) -> None:
    """x=1 cached, then x=True (or 1.0, Decimal(1), 1+0j) is still refused."""
    rule = compile_rule("x * 1KiB")
    assert rule.resolve({"x": 1}) == 1024
    with pytest.raises(RuleError, match=f"fact 'x' must be an integer, got {type(bad).__name__}"):
        rule.resolve({"x": bad})
    two = compile_rule("x * y")
    assert two.resolve({"x": 1, "y": 3}) == 3
    with pytest.raises(RuleError, match="fact 'x' must be an integer"):
        two.resolve({"x": bad, "y": 3})


@pytest.mark.parametrize("bad", [[1], {"a": 1}, {1}])
def test_an_unhashable_fact_is_a_rule_error(bad: object) -> None:
    """A list, dict or set fact is a RuleError naming it, not TypeError: unhashable."""
    with pytest.raises(RuleError, match=f"fact 'x' must be an integer, got {type(bad).__name__}"):
        compile_rule("x * 2").resolve({"x": bad})


def test_a_tensor_fact_is_not_kept_alive_by_the_cache() -> None:
    """An integer tensor fact resolves, and the rule's cache holds only plain ints."""
    import gc
    import weakref

    import torch

    rule = compile_rule("x * 2")
    fact = torch.tensor(21)
    ref = weakref.ref(fact)
    assert rule.resolve({"x": fact}) == 42
    del fact
    gc.collect()
    assert ref() is None
    assert rule.resolve({"x": 21}) == 42


def test_max_of_one_argument_fails_at_compile_time() -> None:
    """max(5) and min(x) are refused when compiled, not with a TypeError at call time."""
    for source in ("max(5)", "min(x)"):
        with pytest.raises(RuleError, match=r"takes at least 2 argument\(s\), got 1"):
            compile_rule(source)


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_cached_sizes_are_served_only_to_integer_facts_for_any_fact_count(count: int) -> None:
    """With 1 to 4 facts, a cached size is reused for ints and refused for True in any position."""
    names = [f"f{i}" for i in range(count)]
    rule = compile_rule(" + ".join(names) + " + 1")
    ints = dict.fromkeys(names, 1)
    assert rule.resolve(ints) == count + 1
    assert rule.resolve(dict(ints)) == count + 1
    for name in names:
        with pytest.raises(RuleError, match=f"fact '{name}' must be an integer, got bool"):
            rule.resolve({**ints, name: True})


def test_a_huge_integer_rule_is_a_size_error() -> None:
    """A literal rule of 5,000 digits is wspool's SizeError naming its magnitude and the setting."""
    with pytest.raises(SizeError, match=r"size 1e\+5000 exceeds the limit of 1024TiB \(setting pools\.p\.rules\.r / "):
        compile_rule(10**5000, ("pools", "p", "rules", "r"))


def test_a_huge_fact_is_a_rule_error_naming_its_magnitude() -> None:
    """A fact of 5,000 digits is refused as out of range, quoted readably, not a ValueError from repr()."""
    rule = compile_rule("x * 2", ("pools", "p", "rules", "r"))
    with pytest.raises(RuleError, match=r"fact 'x' = 1e\+5000 is out of range"):
        rule.resolve({"x": 10**5000})


@pytest.mark.parametrize("source", ["512M", "1G", "512Mi", "2 * 512M + 1MiB"])
def test_a_rule_with_a_kubernetes_size_lists_the_units(source: str) -> None:
    """A rule written with 512M or 1G is refused with wspool's spelling and units, not 'invalid decimal literal'."""
    with pytest.raises(RuleError, match=r"is not a size wspool reads: write \d+[MG]iB.*the units are B, KB") as info:
        compile_rule(source, ("pools", "p", "rules", "r"))
    assert "invalid decimal literal" not in str(info.value) and "pools.p.rules.r" in str(info.value)
