"""Tests for wspool.bounds: a rule's largest size over limits, proven, searched or refused."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.helpers.registry import make_registry
from wspool.bounds import MAX_RANGE_VALUES, FactLimit, bound_rule, facts_beyond, parse_limit, to_limits
from wspool.errors import RuleError, WorkspaceFrozenError
from wspool.rules import ExpressionRule, compile_rule

PATH = ("pools", "flashinfer_mla", "rules", "lse")
LSE = "8 * num_heads * cp_world * batch_size * round_up(q_len, 256) + 1MiB + 32MiB"


def bound(source: str, limits: dict[str, object], defaults: dict[str, int] | None = None):  # type: ignore[no-untyped-def]
    return bound_rule(compile_rule(source, PATH), to_limits(limits), defaults)


def test_lse_slab_is_proven_at_the_largest_corner() -> None:
    """The DCP LSE slab is proven non-decreasing: its bound is its size at every fact's largest value."""
    found = bound(LSE, {"batch_size": 256, "q_len": 4}, {"num_heads": 8, "cp_world": 8})
    assert found.method == "proven"
    assert dict(found.facts) == {"batch_size": 256, "q_len": 4, "num_heads": 8, "cp_world": 8}
    assert found.nbytes == 8 * 8 * 8 * 256 * 256 + 33 * 2**20


def test_limit_wins_over_default() -> None:
    """A fact with both a limit and a default is bounded by its limit."""
    found = bound("batch_size * 1KiB", {"batch_size": 16}, {"batch_size": 1024})
    assert found.nbytes == 16 * 1024


@pytest.mark.parametrize(
    ("source", "at"),
    [("64MiB - batch_size * 1KiB", 1), ("1GiB // batch_size", 1), ("ceil_div(1GiB, batch_size)", 1)],
)
def test_decreasing_rule_bounded_at_its_true_maximum(source: str, at: int) -> None:
    """A rule that shrinks as a fact grows is proven non-increasing and bounded at the fact's lowest value."""
    found = bound(source, {"batch_size": 60_000})
    assert found.method == "proven"
    assert found.facts["batch_size"] == at
    rule = compile_rule(source, PATH)
    assert found.nbytes == max(rule.evaluate({"batch_size": b}) for b in (1, 2, 3, 1000, 60_000))


def test_set_limit_bounds_at_its_largest_member() -> None:
    """A set of values is bounded at its largest member where the rule is proven non-decreasing."""
    found = bound("round_up(q_len, 3) * 1KiB", {"q_len": [1, 2, 4]})
    assert found.nbytes == 6 * 1024
    assert found.facts["q_len"] == 4


def test_non_monotone_rule_is_searched_exactly() -> None:
    """A rule neither increasing nor decreasing in a fact is searched over every value of a small range."""
    found = bound("batch_size * (300 - batch_size) * 1KiB", {"batch_size": 256})
    assert found.method == "searched"
    assert found.searched == ("batch_size",)
    assert found.facts["batch_size"] == 150
    assert found.nbytes == 150 * 150 * 1024


def test_non_monotone_rule_over_a_large_range_is_refused() -> None:
    """A rule not proven monotone in a fact whose range is too large to search is refused, naming both."""
    with pytest.raises(RuleError, match=r"cannot bound rule pools\.flashinfer_mla\.rules\.lse .*fact 'batch_size'"):
        bound("(batch_size % 7 + 1) * 1MiB", {"batch_size": MAX_RANGE_VALUES * 2})


def test_fact_without_limit_or_default_is_refused() -> None:
    """A fact the rule reads with neither a limit nor a default is refused, with its name and where to set it."""
    with pytest.raises(RuleError, match=r"fact 'q_len' has neither a limit nor a default.*q_len=MAX.*FACTS__Q_LEN"):
        bound(LSE, {"batch_size": 256}, {"num_heads": 8, "cp_world": 8})


def test_rule_failing_everywhere_is_refused() -> None:
    """A rule that is not positive anywhere within the limits is refused, with the rule's own error."""
    with pytest.raises(RuleError, match=r"cannot bound rule .*fails where it is largest"):
        bound("1KiB - batch_size * 1MiB", {"batch_size": 8})


def test_literal_rule_bound_is_its_size() -> None:
    """A literal rule is bounded at its size, whatever the limits."""
    found = bound_rule(compile_rule("256MiB", PATH), {})
    assert (found.nbytes, found.method) == (256 << 20, "literal")


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        ("batch_size=256", FactLimit(1, 256, None, "--limit batch_size")),
        ("q_len=1,2,4", FactLimit(1, 4, (1, 2, 4), "--limit q_len")),
        ("q_len=4,1,4", FactLimit(1, 4, (1, 4), "--limit q_len")),
        ("cp_world=2..8", FactLimit(2, 8, None, "--limit cp_world")),
    ],
)
def test_parse_limit_forms(text: str, limit: FactLimit) -> None:
    """--limit takes NAME=MAX, NAME=A,B,C and NAME=LO..HI."""
    assert parse_limit(text)[1] == limit


@pytest.mark.parametrize("text", ["batch_size", "=4", "batch_size=", "batch_size=x", "q_len=8..2", "b=0", "b=-1"])
def test_parse_limit_refuses_bad_text(text: str) -> None:
    """A malformed --limit is refused with the forms it accepts."""
    with pytest.raises(RuleError, match=r"--limit"):
        parse_limit(text)


def test_facts_beyond_names_each_fact_outside_its_limit() -> None:
    """facts_beyond returns the facts whose values lie outside their limits (a set's gaps included)."""
    limits = to_limits({"batch_size": 256, "q_len": [1, 2, 4]})
    facts = {"batch_size": 300, "q_len": 3, "num_heads": 8}
    found = facts_beyond(("batch_size", "num_heads", "q_len"), facts, limits)
    assert [(f, v) for f, v, _ in found] == [("batch_size", 300), ("q_len", 3)]


# -- properties: random expressions over random limits --------------------------------------

FACTS = ("a", "b", "c")
_leaf = st.one_of(st.sampled_from(FACTS), st.integers(0, 40).map(str))


def _extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    operators = st.sampled_from(["+", "-", "*", "//", "%"])
    binary = st.tuples(inner, operators, inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})")
    call = st.tuples(st.sampled_from(["max", "min", "round_up", "ceil_div"]), inner, inner).map(
        lambda t: f"{t[0]}({t[1]}, {t[2]})"
    )
    return st.one_of(binary, call, inner.map(lambda e: f"-{e}"))


def _compiled(source: str) -> ExpressionRule:
    """The rule of ``source``; examples that fold to a constant (or a non-positive one) are not about bounds."""
    try:
        rule = compile_rule(source, PATH)
    except RuleError:
        rule = None
    assume(isinstance(rule, ExpressionRule))
    return rule  # type: ignore[return-value]


EXPRESSIONS = st.recursive(_leaf, _extend, max_leaves=8)
LIMITS = st.fixed_dictionaries(
    {},
    optional={
        name: st.one_of(
            st.integers(1, 9),
            st.tuples(st.integers(0, 5), st.integers(0, 6)).map(lambda t: range(t[0], t[0] + t[1] + 1)),
            st.lists(st.integers(0, 12), min_size=1, max_size=4),
        )
        for name in FACTS
    },
)


@given(EXPRESSIONS, LIMITS, st.integers(0, 9))
def test_bound_is_the_exact_maximum_over_small_limits(source: str, raw: dict[str, object], fixed: int) -> None:
    """Over small limits the bound equals the largest size any point asks for, or is refused when none resolves."""
    rule = _compiled(source)
    limits = to_limits(raw)
    defaults = {name: fixed for name in FACTS if name not in limits}
    axes = [
        (limits[n].values or range(limits[n].low, limits[n].high + 1)) if n in limits else (defaults[n],)
        for n in rule.names
    ]
    sizes = []
    for values in itertools.product(*axes):
        with contextlib.suppress(RuleError):  # a call that fails asks for nothing
            sizes.append(rule.evaluate(dict(zip(rule.names, values, strict=True))))
    if not sizes:
        with pytest.raises(RuleError, match="cannot bound rule"):
            bound_rule(rule, limits, defaults)
        return
    found = bound_rule(rule, limits, defaults)
    assert found.nbytes == max(sizes)
    assert rule.evaluate(dict(found.facts)) == found.nbytes
    assert all(limits[n].allows(v) for n, v in found.facts.items() if n in limits)


@given(
    EXPRESSIONS,
    st.dictionaries(st.sampled_from(FACTS), st.integers(1, 1 << 20), min_size=3),
    st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=20),
)
def test_bound_never_below_a_call_within_large_limits(
    source: str, highs: dict[str, int], points: list[tuple[float, float, float]]
) -> None:
    """Over large ranges a bound, where given, is at least the size at random points within the limits."""
    rule = _compiled(source)
    limits = to_limits(highs)
    try:
        found = bound_rule(rule, limits)
    except RuleError as exc:
        assert "cannot bound rule" in str(exc)
        return
    for point in points:
        facts = {n: max(1, round(f * highs[n])) for n, f in zip(FACTS, point, strict=True)}
        try:
            asked = rule.evaluate(facts)
        except RuleError:
            continue
        assert asked <= found.nbytes


# -- reserve_for: a registry reserved for its limits, then frozen ----------------------------

POOLS = {
    "mla": {"rules": {"lse": LSE, "default": "1MiB"}, "facts": {"num_heads": 8, "cp_world": 2}},
    "paged": {"shared_with": "mla", "rules": {"decode": "batch_size * 4KiB + 1MiB"}},
    "other": {"rules": {"default": "sm_count * 1KiB"}},
}
LIMITS = {"batch_size": 64, "q_len": [1, 2, 4]}


def test_reserve_for_reserves_a_shared_buffer_at_its_largest_rule() -> None:
    """reserve_for grows a shared buffer once, to the largest bound over the rules of the pools that share it."""
    registry = make_registry(POOLS)
    plan = registry.reserve_for(LIMITS, pools=["mla", "paged"], devices=["cpu"])
    lse = 8 * 8 * 2 * 64 * 256 + 33 * 2**20
    assert dict(plan.buffers) == {("mla", "cpu", "main"): lse}
    assert {(row.pool, row.rule): row.bound.nbytes for row in plan.rows if row.bound} == {
        ("mla", "lse"): lse,
        ("mla", "default"): 2**20,
        ("paged", "decode"): 64 * 4096 + 2**20,
    }
    stats = registry.stats("mla", "cpu")
    assert (stats.capacity_bytes, stats.grow_count) == (lse, 1)


def test_reserve_for_refuses_an_unbounded_rule_and_allocates_nothing() -> None:
    """A rule that cannot be bounded (sm_count has no limit or default on the CPU) is named; nothing is allocated."""
    registry = make_registry(POOLS)
    with pytest.raises(RuleError, match=r"other\.rules\.default .*fact 'sm_count' has neither a limit nor a default"):
        registry.reserve_for(LIMITS, pools=["mla", "paged", "other"], devices=["cpu"])
    assert all(s.capacity_bytes == 0 for s in registry.all_stats())


def test_reserve_for_not_strict_reserves_what_it_can() -> None:
    """Without strict, reserve_for reserves the rules it bounds and reports the others as refusals."""
    registry = make_registry(POOLS)
    plan = registry.reserve_for(LIMITS, pools=["mla", "paged", "other"], devices=["cpu"], strict=False)
    assert [(r.pool, r.rule) for r in plan.refusals] == [("other", "default")]
    assert registry.stats("mla", "cpu").capacity_bytes == plan.buffers[("mla", "cpu", "main")]
    assert "1 rule(s) not bounded" in plan.summary()


def test_call_beyond_limit_after_reservation_is_refused_naming_the_limit() -> None:
    """After reserve_for and freeze, a call beyond a limit is refused naming the fact, its limit, where to raise it."""
    registry = make_registry(POOLS)
    registry.reserve_for(LIMITS, pools=["mla", "paged"], devices=["cpu"])
    registry.freeze()
    buffer = registry.workspace("mla", "cpu", rule="lse", batch_size=64, q_len=4)
    with pytest.raises(
        WorkspaceFrozenError,
        match=r"pool 'mla' on cpu \(lane main\) was reserved for its limits and is frozen: rule lse .*"
        r"fact batch_size=65 is beyond its limit 64 \(raise it: the limits given to reserve_for\)",
    ):
        registry.workspace("mla", "cpu", rule="lse", batch_size=65, q_len=4)
    assert registry.workspace("mla", "cpu", rule="lse", batch_size=1, q_len=1) is buffer
    assert registry.stats("mla", "cpu").grow_count == 1


def test_call_beyond_limit_that_fits_is_served() -> None:
    """A call beyond a limit whose size still fits the reserved buffer is served: the check runs only on growth."""
    registry = make_registry(POOLS)
    registry.reserve_for(LIMITS, pools=["mla", "paged"], devices=["cpu"])
    registry.freeze()
    registry.workspace("mla", "cpu", rule="lse", batch_size=1, q_len=3)  # 3 is not in {1, 2, 4}
    assert registry.stats("mla", "cpu").grow_count == 1


class ReservedRegistry(RuleBasedStateMachine):
    """A registry reserved for its limits and frozen: calls within the limits never grow; those beyond are named."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = make_registry(POOLS)
        self.plan = self.registry.reserve_for(LIMITS, pools=["mla", "paged"], devices=["cpu"])
        self.registry.freeze()
        self.buffer = self.registry.workspace("mla", "cpu", rule="default")

    @rule(batch=st.integers(1, 64), q_len=st.sampled_from([1, 2, 4]), which=st.sampled_from(["lse", "default"]))
    def call_within(self, batch: int, q_len: int, which: str) -> None:
        assert self.registry.workspace("mla", "cpu", rule=which, batch_size=batch, q_len=q_len) is self.buffer

    @rule(batch=st.integers(1, 64))
    def paged_within(self, batch: int) -> None:
        assert self.registry.workspace("paged", "cpu", rule="decode", batch_size=batch) is self.buffer

    @rule(batch=st.integers(65, 1 << 16), q_len=st.sampled_from([1, 2, 4, 8, 300]))
    def call_beyond(self, batch: int, q_len: int) -> None:
        try:
            got = self.registry.workspace("mla", "cpu", rule="lse", batch_size=batch, q_len=q_len)
        except WorkspaceFrozenError as exc:
            assert f"fact batch_size={batch} is beyond its limit 64" in str(exc)
        else:
            assert got is self.buffer

    @invariant()
    def nothing_grew(self) -> None:
        stats = self.registry.stats("mla", "cpu")
        assert stats.grow_count == 1
        assert stats.capacity_bytes == self.plan.buffers[("mla", "cpu", "main")]


TestReservedRegistry = ReservedRegistry.TestCase
TestReservedRegistry.settings = settings(max_examples=50, stateful_step_count=20, deadline=None)


def test_reserve_for_rules_bounds_only_the_named_rules() -> None:
    """rules= limits a pool to the rules its engine calls: the others neither size nor refuse the reservation."""
    registry = make_registry(POOLS)
    plan = registry.reserve_for(
        LIMITS, pools=["mla", "other"], devices=["cpu"], rules={"mla": ["default"], "other": []}
    )
    assert [(row.pool, row.rule) for row in plan.rows] == [("mla", "default")]
    assert dict(plan.buffers) == {("mla", "cpu", "main"): 2**20}
