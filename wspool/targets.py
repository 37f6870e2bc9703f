"""Replacing attributes of other libraries: targets, all-or-nothing groups, undo.

wspool changes another library (an engine, FlashInfer) only through this module:
a :class:`Target` names an attribute and the parameters wspool knows it by; a
:class:`TargetGroup` is patched whole or not at all; a :class:`PatchSet` applies
and undoes groups, idempotently, under its own lock (locating, which imports the
target's module, runs before it). Nothing is imported until a target is located.
Patch before serving: a patch does not race with calls of what it replaces.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "PartialUndoError",
    "Patch",
    "PatchPlan",
    "PatchSet",
    "Target",
    "TargetAbsent",
    "TargetChanged",
    "TargetGroup",
    "locate",
]


@dataclass(frozen=True)
class Target:
    """One attribute (``"f"`` or ``"Class.attr"`` of ``module``) of another library that wspool replaces.

    Another signature than ``parameters`` is not patched (``None``: not called, a
    module global). An ``optional`` target absent from the version in use is skipped.
    An ``imported_only`` target (a by-name copy) is located only where its module is
    already imported: a later import binds the patched original, which
    :meth:`PatchSet.undo` puts back there too.
    """

    module: str
    path: str
    parameters: tuple[str, ...] | None
    make: Callable[[Any], Any]
    what: str
    optional: bool = False
    requires: tuple[str, ...] = ()
    imported_only: bool = False

    @property
    def name(self) -> str:
        """The dotted name: the module, then the path in it."""
        return f"{self.module}.{self.path}"


@dataclass(frozen=True)
class TargetGroup:
    """Targets patched all or none, in order: each needs the others to be safe."""

    name: str
    targets: tuple[Target, ...]


class TargetAbsent(LookupError):
    """The target's module or attribute does not exist in the version in use."""


class TargetChanged(LookupError):
    """The target exists, but not as wspool knows it (or its module fails to import)."""


class PartialUndoError(RuntimeError):
    """Patching failed and some patches could not be undone; they stay in the :class:`PatchSet`."""


class Located(NamedTuple):
    """Where a target lives now: its owner (module or class), attribute name and current value."""

    owner: Any
    attr: str
    current: Any


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            raise TargetAbsent(f"module {module} does not exist here") from None
        raise TargetChanged(f"module {module} does not import ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # the library's own import error (a missing dependency, a device check)
        raise TargetChanged(f"module {module} does not import ({type(exc).__name__}: {exc})") from None


def locate(target: Target) -> Located:
    """Return where ``target`` is and its current value, checked against what wspool knows.

    Imports its module; an ``imported_only`` target's only where it is already imported.

    Raises:
        TargetAbsent: Its module, class or attribute does not exist.
        TargetChanged: Its signature or a required attribute differs, or its module fails to import.
    """
    if target.imported_only and target.module not in sys.modules:
        raise TargetAbsent(f"module {target.module} is not imported yet (an import binds the patched original)")
    module = _import(target.module)
    for attr in target.requires:
        if not hasattr(module, attr):
            raise TargetChanged(f"{target.module} has no {attr}")
    owner: Any = module
    *classes, attr = target.path.split(".")
    for part in classes:
        owner = getattr(owner, part, None)
        if not isinstance(owner, type):
            raise TargetAbsent(f"{target.module} has no class {part}")
    # A class attribute as stored (not bound), so a wrapper sees the plain function.
    current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if target.parameters is None:
        if not hasattr(owner, attr):
            raise TargetAbsent(f"{target.name} is missing")
        return Located(owner, attr, current)
    if current is None:
        raise TargetAbsent(f"{target.name} is missing")
    try:
        parameters = tuple(inspect.signature(current).parameters)
    except (TypeError, ValueError):
        raise TargetChanged(f"{target.name} has no signature to check") from None
    if parameters != target.parameters:
        raise TargetChanged(
            f"{target.name} takes ({', '.join(parameters)}), not ({', '.join(target.parameters)}) as wspool knows"
        )
    return Located(owner, attr, current)


@dataclass
class PatchPlan:
    """What :meth:`PatchSet.plan` found: the targets to patch, and what it leaves alone and why.

    ``reach`` is every target of the groups to patch, located or not: the names
    where a replacement may be found later (a by-name copy imported after the
    patch binds it), which an undo checks.
    """

    located: list[tuple[Target, Located]] = field(default_factory=list)
    not_patched: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    reach: list[Target] = field(default_factory=list)


@dataclass(frozen=True)
class Patch:
    """One applied replacement: where, the original value and the replacement."""

    name: str
    owner: Any
    attr: str
    original: Any
    replacement: Any

    def current(self) -> Any:
        """Return the attribute's value now (a class's own, not an inherited one)."""
        owner = self.owner
        return owner.__dict__.get(self.attr) if isinstance(owner, type) else getattr(owner, self.attr, None)


class PatchSet:
    """The patches one integration applied in this process; applies groups all or none, and undoes them.

    With ``all_or_nothing``, one group that cannot be patched leaves every group unpatched.
    """

    def __init__(self, *, all_or_nothing: bool = False) -> None:
        self.all_or_nothing = all_or_nothing
        self._lock = threading.Lock()
        self._patches: dict[str, Patch] = {}
        self._reach: list[Target] = []
        self._undo_hooks: list[Callable[[], None]] = []

    def plan(self, groups: Iterable[TargetGroup]) -> PatchPlan:
        """Locate every group's targets (importing their modules); change nothing."""
        plan = PatchPlan()
        for group in groups:
            located: list[tuple[Target, Located]] = []
            skipped: list[str] = []
            failures: list[str] = []  # every target the group lacks, so one warning names them all
            for target in group.targets:
                try:
                    located.append((target, locate(target)))
                except TargetAbsent as exc:
                    if not target.optional:
                        failures.append(str(exc))
                    else:
                        skipped.append(target.name)
                except TargetChanged as exc:
                    failures.append(str(exc))
            if failures:
                plan.not_patched.append(f"{group.name} ({'; '.join(failures)})")
            else:
                plan.located.extend(located)
                plan.absent.extend(skipped)
                plan.reach.extend(group.targets)
        if self.all_or_nothing and plan.not_patched:
            plan.located.clear()
            plan.reach.clear()
        return plan

    def apply(self, plan: PatchPlan) -> list[Patch]:
        """Apply every located target of ``plan``, all or none; return the patches (``[]`` if already applied).

        A failing replacement undoes this call's patches and re-raises;
        :class:`PartialUndoError` if undoing fails too (:meth:`names` lists those left).
        """
        with self._lock:
            if self._patches:
                return []
            applied: list[Patch] = []
            try:
                for target, where in plan.located:
                    replacement = target.make(where.current)
                    setattr(where.owner, where.attr, replacement)
                    applied.append(Patch(target.name, where.owner, where.attr, where.current, replacement))
            except Exception as exc:
                stuck = self._restore(applied, keep_stuck=True)
                if stuck:
                    raise PartialUndoError(
                        f"{type(exc).__name__}: {exc}; undoing its patches failed for {'; '.join(stuck)}, which stay "
                        "wspool's (patched() lists them); every other patch was undone"
                    ) from exc
                raise
            self._patches = {patch.name: patch for patch in applied}
            self._reach = list(plan.reach) if applied else []
            return applied

    def on_undo(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at the next :meth:`undo` (for changes that are not attribute patches)."""
        with self._lock:
            self._undo_hooks.append(hook)

    def undo(self) -> list[str]:
        """Put every original back, newest first, except where something replaced wspool's; return the names.

        A replacement found under a name the patch reached but did not patch (a
        by-name copy imported, or a module imported again, after the patch) gets
        its original back too, so a later :meth:`apply` wraps each original once.
        """
        with self._lock:
            patches = list(self._patches.values())
            reach, self._reach = self._reach, []
            self._patches = {}
            hooks, self._undo_hooks = self._undo_hooks, []
            ours = [p for p in patches if p.current() is p.replacement]
            restored = [p.name for p in ours]
            self._restore(ours, keep_stuck=False)
            restored.extend(name for name in _restore_copies(reach, patches) if name not in restored)
        for hook in reversed(hooks):
            hook()
        return restored

    def _restore(self, patches: list[Patch], *, keep_stuck: bool) -> list[str]:
        stuck = []
        for patch in reversed(patches):
            try:
                setattr(patch.owner, patch.attr, patch.original)
            except Exception as exc:
                stuck.append(f"{patch.name} ({type(exc).__name__}: {exc})")
                if keep_stuck:
                    self._patches[patch.name] = patch
        return stuck

    def applied(self) -> list[Patch]:
        """Return the patches in place now, in the order they were applied."""
        with self._lock:
            return list(self._patches.values())

    def names(self) -> list[str]:
        """Return the names of the attributes patched now, in the order they were patched."""
        with self._lock:
            return list(self._patches)

    def __bool__(self) -> bool:
        return bool(self._patches)


def _holder(target: Target) -> Any:
    """The module or class that holds ``target`` now, where its module is imported; never imports, else ``None``."""
    owner = sys.modules.get(target.module)
    for part in target.path.split(".")[:-1]:
        owner = getattr(owner, part, None)
        if not isinstance(owner, type):
            return None
    return owner


def _restore_copies(reach: list[Target], patches: list[Patch]) -> list[str]:
    """Put each patch's original back wherever a target of ``reach`` holds its replacement now; return the names."""
    originals = {id(p.replacement): p.original for p in patches if p.replacement is not p.original}
    restored = []
    for target in reach:
        owner = _holder(target)
        if owner is None:
            continue
        attr = target.path.rsplit(".", 1)[-1]
        current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if current is None or id(current) not in originals:
            continue
        try:
            setattr(owner, attr, originals[id(current)])
        except Exception:  # an owner that refuses the write keeps wspool's replacement; nothing else is lost
            continue
        restored.append(target.name)
    return restored
