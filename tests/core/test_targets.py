"""Tests for wspool.targets: locating targets, groups all or none, undo, idempotence."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from wspool.targets import PartialUndoError, PatchSet, Target, TargetAbsent, TargetChanged, TargetGroup, locate

MODULE = "wspool_test_engine"


def _one(a: int) -> int:
    return a


def _two(a: int) -> int:
    return a * 2


def _three(a: int) -> int:
    return a * 3


class _Engine:
    def method(self, x: int) -> int:
        return x


@pytest.fixture
def engine() -> Iterator[types.ModuleType]:
    """A module that stands in for an engine: three functions, a class, and a global that is not called."""
    module = types.ModuleType(MODULE)
    module.one, module.two, module.three = _one, _two, _three  # type: ignore[attr-defined]
    module.Engine = type("Engine", (_Engine,), {"method": _Engine.method})  # type: ignore[attr-defined]
    module.buffer = None  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    yield module
    del sys.modules[MODULE]


def _wrap(tag: str) -> Any:
    def make(original: Any) -> Any:
        def replacement(*args: Any) -> Any:
            return (tag, original(*args))

        return replacement

    return make


def _target(path: str, parameters: tuple[str, ...] | None = ("a",), **kw: Any) -> Target:
    return Target(MODULE, path, parameters, kw.pop("make", _wrap(path)), f"wraps {path}", **kw)


def test_locate_finds_functions_methods_and_globals(engine: types.ModuleType) -> None:
    """A module function, a class's own method (unbound) and an uncalled global are each located where they live."""
    assert locate(_target("one")).current is _one
    where = locate(_target("Engine.method", ("self", "x")))
    assert where.owner is engine.Engine and where.current is _Engine.method
    assert locate(_target("buffer", None)).attr == "buffer"


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        (Target("wspool_no_such_module", "f", ("a",), _wrap("f"), "x"), TargetAbsent, "does not exist here"),
        (_target("missing"), TargetAbsent, "wspool_test_engine.missing is missing"),
        (_target("Nope.method", ("self",)), TargetAbsent, "has no class Nope"),
        (_target("one", ("a", "b")), TargetChanged, r"takes \(a\), not \(a, b\) as wspool knows"),
        (_target("one", requires=("absent_constant",)), TargetChanged, "has no absent_constant"),
    ],
)
def test_locate_says_what_differs(engine: types.ModuleType, target: Target, error: type, match: str) -> None:
    """An absent module, attribute or class, other parameters or a missing requirement: each named."""
    with pytest.raises(error, match=match):
        locate(target)


def test_a_group_is_patched_whole_and_undone(engine: types.ModuleType) -> None:
    """Every target of a group is replaced; undo puts each original back and returns their names."""
    patches = PatchSet()
    group = TargetGroup("three", (_target("one"), _target("two"), _target("three")))
    applied = patches.apply(patches.plan((group,)))
    assert [p.name for p in applied] == [f"{MODULE}.one", f"{MODULE}.two", f"{MODULE}.three"]
    assert engine.two(2) == ("two", 4)
    assert patches.undo() == [f"{MODULE}.one", f"{MODULE}.two", f"{MODULE}.three"]
    assert (engine.one, engine.two, engine.three) == (_one, _two, _three) and patches.names() == []


def test_the_third_of_three_failing_rolls_back_the_first_two(engine: types.ModuleType) -> None:
    """A replacement that raises while the third target is patched leaves all three as they were."""

    def explode(original: Any) -> Any:
        raise RuntimeError("cannot wrap three")

    patches = PatchSet()
    group = TargetGroup("three", (_target("one"), _target("two"), _target("three", make=explode)))
    with pytest.raises(RuntimeError, match="cannot wrap three"):
        patches.apply(patches.plan((group,)))
    assert (engine.one, engine.two, engine.three) == (_one, _two, _three) and not patches


def test_an_original_that_cannot_be_put_back_is_reported(engine: types.ModuleType) -> None:
    """When undoing the rollback fails too, the error names what stays patched, and names() lists it."""

    class Stubborn(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "one" and value is _one:
                raise AttributeError("cannot restore")
            if name == "two":
                raise AttributeError("read-only")
            super().__setattr__(name, value)

    stubborn = Stubborn(MODULE)
    stubborn.__dict__.update(engine.__dict__)
    sys.modules[MODULE] = stubborn
    patches = PatchSet()
    with pytest.raises(PartialUndoError, match=r"read-only; undoing its patches failed for .*\.one \(Attr"):
        patches.apply(patches.plan((TargetGroup("g", (_target("one"), _target("two"))),)))
    assert patches.names() == [f"{MODULE}.one"]


def test_applying_twice_patches_once(engine: types.ModuleType) -> None:
    """A second apply of the same plan changes nothing: the replacement is not wrapped again."""
    patches = PatchSet()
    plan = patches.plan((TargetGroup("one", (_target("one"),)),))
    patches.apply(plan)
    first = engine.one
    assert patches.apply(plan) == [] and engine.one is first and engine.one(1) == ("one", 1)


def test_a_group_with_a_changed_target_is_left_and_named(engine: types.ModuleType) -> None:
    """Group by group: the changed group is named with every reason, the others are patched."""
    patches = PatchSet()
    groups = (
        TargetGroup("good", (_target("one"),)),
        TargetGroup("bad", (_target("two", ("x",)), _target("gone"), _target("three"))),
    )
    plan = patches.plan(groups)
    assert [t.name for t, _ in plan.located] == [f"{MODULE}.one"]
    (why,) = plan.not_patched
    assert why.startswith("bad (") and "takes (a), not (x)" in why and "gone is missing" in why


def test_all_or_nothing_leaves_every_group_when_one_fails(engine: types.ModuleType) -> None:
    """With all_or_nothing, one failing group means nothing is located for patching."""
    patches = PatchSet(all_or_nothing=True)
    plan = patches.plan((TargetGroup("good", (_target("one"),)), TargetGroup("bad", (_target("gone"),))))
    assert plan.located == [] and len(plan.not_patched) == 1


def test_an_absent_optional_target_is_skipped(engine: types.ModuleType) -> None:
    """An optional target the version lacks is listed as absent; its group is patched without it."""
    patches = PatchSet()
    plan = patches.plan((TargetGroup("g", (_target("one"), _target("gone", optional=True))),))
    assert [t.name for t, _ in plan.located] == [f"{MODULE}.one"] and plan.absent == [f"{MODULE}.gone"]


def test_undo_leaves_what_someone_else_replaced_since(engine: types.ModuleType) -> None:
    """An attribute replaced after wspool patched it is not wspool's to restore."""
    patches = PatchSet()
    patches.apply(patches.plan((TargetGroup("g", (_target("one"), _target("two"))),)))
    engine.two = _three  # type: ignore[attr-defined]
    hooks: list[str] = []
    patches.on_undo(lambda: hooks.append("ran"))
    assert patches.undo() == [f"{MODULE}.one"] and engine.two is _three and hooks == ["ran"]


def test_an_imported_only_target_is_absent_until_its_module_is_imported(engine: types.ModuleType) -> None:
    """A by-name copy is located only in a module already imported; locating it never imports one."""
    assert locate(_target("one", imported_only=True)).current is _one
    missing = Target("wspool_test_module_never_imported", "one", ("a",), _wrap("one"), "a copy", imported_only=True)
    with pytest.raises(TargetAbsent, match="not imported yet"):
        locate(missing)
    assert "wspool_test_module_never_imported" not in sys.modules


def test_a_by_name_copy_imported_after_apply_gets_its_original_back_at_undo(engine: types.ModuleType) -> None:
    """A module imported after apply binds the replacement by name; undo restores it there, and a re-apply wraps
    the original once."""
    copy_name = "wspool_test_engine_copy"
    group = TargetGroup("g", (_target("one"), Target(copy_name, "one", ("a",), _wrap("one"), "a copy",
                                                      optional=True, imported_only=True)))  # fmt: skip
    patches = PatchSet()
    try:
        patches.apply(patches.plan((group,)))
        copy = types.ModuleType(copy_name)
        copy.one = engine.one  # type: ignore[attr-defined]  # `from engine import one`, after the patch
        sys.modules[copy_name] = copy
        assert patches.undo() == [f"{MODULE}.one", f"{copy_name}.one"]
        assert engine.one is _one and copy.one is _one
        patches.apply(patches.plan((group,)))
        assert engine.one(1) == ("one", 1) and copy.one(1) == ("one", 1)
    finally:
        sys.modules.pop(copy_name, None)


@pytest.fixture
def importable(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Write modules named ``wspool_test_mod_*`` to a folder on the import path; forget them afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        return name

    yield write
    for name in [n for n in sys.modules if n.startswith("wspool_test_mod_")]:
        del sys.modules[name]


def test_a_module_whose_own_import_fails_is_changed_not_absent(importable: Any) -> None:
    """A module lacking a dependency, or raising at import, is TargetChanged naming the error; a missing
    submodule of a missing package is TargetAbsent."""
    lacking = importable("wspool_test_mod_lacking", "import wspool_test_no_such_dependency\n")
    raising = importable("wspool_test_mod_raising", "raise RuntimeError('needs a GPU')\n")
    with pytest.raises(TargetChanged, match=r"does not import \(ModuleNotFoundError: .*wspool_test_no_such_dependency"):
        locate(Target(lacking, "f", ("a",), _wrap("f"), "x"))
    with pytest.raises(TargetChanged, match=r"does not import \(RuntimeError: needs a GPU\)"):
        locate(Target(raising, "f", ("a",), _wrap("f"), "x"))
    with pytest.raises(TargetAbsent, match=r"module wspool_test_no_such_package\.sub does not exist here"):
        locate(Target("wspool_test_no_such_package.sub", "f", ("a",), _wrap("f"), "x"))


def test_a_global_or_an_uncallable_target_is_checked_as_such(engine: types.ModuleType) -> None:
    """A missing global is absent; a called target whose value has no signature is changed."""
    with pytest.raises(TargetAbsent, match=f"{MODULE}.nothing_here is missing"):
        locate(_target("nothing_here", None))
    engine.constant = 5  # type: ignore[attr-defined]
    with pytest.raises(TargetChanged, match=f"{MODULE}.constant has no signature to check"):
        locate(_target("constant"))


def test_applied_lists_each_patch_with_its_original_and_replacement(engine: types.ModuleType) -> None:
    """applied() returns the patches in place, in order, each naming what it replaced and with what."""
    patches = PatchSet()
    patches.apply(patches.plan((TargetGroup("g", (_target("one"), _target("two"))),)))
    applied = patches.applied()
    assert [(p.name, p.original, p.current()) for p in applied] == [
        (f"{MODULE}.one", _one, engine.one),
        (f"{MODULE}.two", _two, engine.two),
    ]
    assert all(p.replacement is p.current() for p in applied)
    patches.undo()
    assert patches.applied() == [] and not patches


def test_a_plan_reaches_only_the_groups_it_would_patch(engine: types.ModuleType) -> None:
    """plan.reach lists every target of the groups to patch; a refused group's, or all under all_or_nothing, none."""
    groups = (TargetGroup("good", (_target("one"), _target("two"))), TargetGroup("bad", (_target("gone"),)))
    assert [t.path for t in PatchSet().plan(groups).reach] == ["one", "two"]
    assert PatchSet(all_or_nothing=True).plan(groups).reach == []
