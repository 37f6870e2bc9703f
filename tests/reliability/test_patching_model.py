"""A model of the patching core, checked over random operation sequences (hypothesis stateful).

A :class:`~wspool.targets.PatchSet` patches stand-in modules (``types.ModuleType``
objects put in ``sys.modules``): a source module with a function and a method,
modules that copy the function by name (``from source import f``), imported
before or after the patch and imported again, the source itself imported again,
and a target whose replacement fails. A plain model remembers what each name
held before any patch reached it. These invariants are checked after every step:

- P1: after ``undo()`` every name the patch reached holds its original: every
  module now imported, and every module the patch wrote to.
- P2: ``apply()`` is idempotent and nothing is ever wrapped twice.
- P3: a failing replacement leaves every name as it was before that ``apply()``.
- P4: while applied, each name located at ``apply()`` holds one replacement of its
  original.

The CI profile runs 200 sequences of up to 30 steps; ``WSPOOL_MODEL_PROFILE=long``
runs 3000 of up to 80 (docs/reliability.md).
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from wspool.targets import Patch, PatchPlan, PatchSet, Target, TargetGroup

PROFILES = {
    "ci": settings(
        max_examples=200,
        stateful_step_count=30,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    ),
    "long": settings(
        max_examples=3000, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ),
}
PROFILE = os.environ.get("WSPOOL_MODEL_PROFILE", "ci")

SOURCE = "wspool_model_source"
COPIES = tuple(f"wspool_model_copy{i}" for i in range(3))
#: Set by a rule: the next replacement of the failing target raises.
FAIL = [False]


def _f(a: int) -> int:
    return a


def _m(self: Any, a: int) -> int:
    return a


def _g(a: int) -> int:
    return -a


def _fresh(template: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object with ``template``'s code: what importing a module again defines."""
    assert isinstance(template, types.FunctionType)
    return types.FunctionType(template.__code__, template.__globals__, template.__name__)


def _new_source() -> types.ModuleType:
    module = types.ModuleType(SOURCE)
    module.f = _fresh(_f)  # type: ignore[attr-defined]
    module.g = _fresh(_g)  # type: ignore[attr-defined]
    module.C = type("C", (), {"m": _fresh(_m)})  # type: ignore[attr-defined]
    return module


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)  # the signature stays the original's, as an engine wrapper's does
    def replacement(*args: Any) -> Any:
        return original(*args)

    return replacement


def _explode_when_asked(original: Callable[..., Any]) -> Callable[..., Any]:
    if FAIL[0]:
        raise RuntimeError("the replacement cannot be made")
    return _wrap(original)


def _depth(value: Any) -> int:
    """How many replacements wrap ``value``."""
    depth = 0
    while hasattr(value, "__wrapped__"):
        value, depth = value.__wrapped__, depth + 1
    return depth


def _unwrapped(value: Any) -> Any:
    while hasattr(value, "__wrapped__"):
        value = value.__wrapped__
    return value


GROUPS = (
    TargetGroup(
        "source and its copies",
        (
            Target(SOURCE, "f", ("a",), _wrap, "f"),
            Target(SOURCE, "C.m", ("self", "a"), _wrap, "C.m"),
            *(Target(c, "f", ("a",), _wrap, "a copy of f", optional=True, imported_only=True) for c in COPIES),
        ),
    ),
    TargetGroup("the failing one", (Target(SOURCE, "g", ("a",), _explode_when_asked, "g"),)),
)


def _names(module: types.ModuleType) -> Iterator[tuple[str, Any, str]]:
    """Every (name, owner, attribute) a target of GROUPS may reach in ``module``."""
    if module.__name__ == SOURCE:
        yield f"{SOURCE}.f", module, "f"
        yield f"{SOURCE}.g", module, "g"
        yield f"{SOURCE}.C.m", module.C, "m"
    else:
        yield f"{module.__name__}.f", module, "f"


class PatchingModel(RuleBasedStateMachine):
    """The patch set of one integration over stand-in modules, beside what each name held first."""

    #: The patch set under test (a test swaps in a planted defect to show the model catches it).
    patch_set: Callable[[], PatchSet] = PatchSet

    def __init__(self) -> None:
        super().__init__()
        FAIL[0] = False
        self.patches = self.patch_set()
        self.applied = False
        # id(module) -> the module, for every module object the sequence made (kept alive, so ids stay unique).
        self.modules: dict[int, types.ModuleType] = {}
        # (id(module), attribute name) -> the original it holds when no patch is applied.
        self.originals: dict[tuple[int, str], Any] = {}
        # Modules the patch set wrote to (their originals must come back even once they are imported again).
        self.written: dict[int, types.ModuleType] = {}
        self._install(_new_source())

    def _install(self, module: types.ModuleType) -> None:
        sys.modules[module.__name__] = module
        self.modules[id(module)] = module
        for name, owner, attr in _names(module):
            self.originals[(id(module), name)] = _unwrapped(owner.__dict__[attr])

    def _current(self) -> list[types.ModuleType]:
        return [sys.modules[name] for name in (SOURCE, *COPIES) if name in sys.modules]

    def _values(self, modules: list[types.ModuleType]) -> dict[tuple[int, str], Any]:
        return {(id(m), name): owner.__dict__[attr] for m in modules for name, owner, attr in _names(m)}

    def teardown(self) -> None:
        for name in (SOURCE, *COPIES):
            sys.modules.pop(name, None)
        FAIL[0] = False

    # -- operations ---------------------------------------------------------------------------------------------

    @rule(fail=st.booleans())
    def apply(self, fail: bool) -> None:
        """Plan and apply every group; the failing target's replacement raises when ``fail``."""
        FAIL[0] = fail
        plan = self.patches.plan(GROUPS)
        reached = self._current()
        before = self._values(reached)
        modules = {t.name: sys.modules[t.module] for t, _ in plan.located}
        try:
            applied = self.patches.apply(plan)
        except RuntimeError as exc:
            assert fail and not self.applied and "cannot be made" in str(exc)
            assert self._values(reached) == before, "P3: a failed apply left a name changed"
            assert not self.patches and self.patches.names() == []
            return
        finally:
            FAIL[0] = False
        if self.applied:
            assert applied == [] and self._values(reached) == before, "P2: a second apply changed something"
            return
        # P4: each located name holds one replacement of what it held.
        assert applied and [p.name for p in applied] == list(modules)
        for patch in applied:
            self.written[id(modules[patch.name])] = modules[patch.name]
            assert patch.current() is patch.replacement and patch.replacement.__wrapped__ is patch.original
            assert _depth(patch.original) == 0, f"P2: {patch.name} was wrapped over a replacement"
        self.applied = True

    @rule()
    def undo(self) -> None:
        """Undo: names restored, hooks run once."""
        ran: list[int] = []
        self.patches.on_undo(lambda: ran.append(1))
        self.patches.undo()
        assert ran == [1] and not self.patches
        self.applied = False

    @rule(copy=st.sampled_from(COPIES))
    def import_copy(self, copy: str) -> None:
        """Import (or import again) a module that does ``from source import f``: it binds what the source holds."""
        module = types.ModuleType(copy)
        module.f = sys.modules[SOURCE].f  # type: ignore[attr-defined]
        self._install(module)

    @rule(copy=st.sampled_from(COPIES))
    def forget_copy(self, copy: str) -> None:
        """A copying module leaves ``sys.modules`` (a test's cleanup, an unloaded plugin)."""
        sys.modules.pop(copy, None)

    @rule()
    def reimport_source(self) -> None:
        """Import the source again: a new module object with new functions, unpatched, replaces it."""
        self._install(_new_source())

    # -- invariants ---------------------------------------------------------------------------------------------

    @invariant()
    def nothing_is_wrapped_twice(self) -> None:
        """P2: every name reached (now imported, or written by the patch) holds at most one replacement."""
        for module in [*self._current(), *self.written.values()]:
            for name, owner, attr in _names(module):
                assert _depth(owner.__dict__[attr]) <= 1, f"P2: {name} is wrapped twice"

    @invariant()
    def undone_means_originals(self) -> None:
        """P1: with no patch applied, every name reached holds its original."""
        if self.applied:
            return
        for module in [*self._current(), *self.written.values()]:
            for name, owner, attr in _names(module):
                held = owner.__dict__[attr]
                what = f"a replacement ({_depth(held)} deep)" if _depth(held) else "another object"
                assert held is self.originals[(id(module), name)], f"P1: {name} holds {what} after undo"

    @invariant()
    def the_patch_set_says_what_it_holds(self) -> None:
        """The patch set is applied exactly when the model says so."""
        assert bool(self.patches) is self.applied


def _run(machine: type[PatchingModel], profile: settings) -> None:
    try:
        run_state_machine_as_test(machine, settings=profile)
    finally:
        for name in (SOURCE, *COPIES):
            sys.modules.pop(name, None)


def test_the_patching_core_keeps_its_invariants_over_random_sequences() -> None:
    """Apply, undo, re-apply, copies imported before and after, the source imported again and a failing target:
    undo restores every name, apply is idempotent and never wraps twice, a failure changes nothing."""
    _run(PatchingModel, PROFILES[PROFILE])


class _ForgetsLaterCopies(PatchSet):
    """A planted defect: the patch set forgets the names it reached but did not locate (copies imported later)."""

    def apply(self, plan: PatchPlan) -> list[Patch]:
        located = {t.name for t, _ in plan.located}
        plan.reach[:] = [t for t in plan.reach if t.name in located]
        return super().apply(plan)


class _PlantedModel(PatchingModel):
    patch_set = _ForgetsLaterCopies


def test_the_model_catches_a_copy_imported_after_apply_left_patched() -> None:
    """With undo not reaching copies imported after apply, the model fails (so it can fail)."""
    planted = settings(PROFILES["ci"], max_examples=200, print_blob=False)
    with pytest.raises(AssertionError, match=r"P1: wspool_model_copy\d\.f holds|P2: .* wrapped"):
        _run(_PlantedModel, planted)


@pytest.fixture(autouse=True)
def _no_stand_ins_left() -> Iterator[None]:
    """The stand-in modules never outlive a test."""
    yield
    assert not [name for name in (SOURCE, *COPIES) if name in sys.modules]
