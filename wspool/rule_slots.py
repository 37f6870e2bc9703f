"""A pool's per-rule slots: each rule's compiled form, default facts, label and request counter.

A :class:`~wspool.pool.WorkspacePool` keeps one :class:`RuleSlot` per rule
(and per explicit-request reason) and reads it on every call: the literal
size, the default facts and the counter are plain attributes, so the per-call
path makes no method call to get them. Slots are built once per pool and
device, with the default facts merged once. Thread semantics: a slot's
attributes are fixed after construction; its counter advances atomically
under the GIL.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping

from wspool.pool_spec import PoolSpec
from wspool.rules import LiteralRule, SizeRule

__all__ = ["RuleSlot", "rule_slots"]


class RuleSlot:
    """Per rule (or request reason): its compiled rule and an atomic request counter.

    Attributes:
        rule: The compiled rule; ``None`` for an explicit-request reason.
        nbytes: A literal rule's size; ``None`` for an expression (or no rule).
        defaults: The facts a call's missing facts are read from.
        default_nbytes: The size of a call that gives no facts, when the defaults resolve it.
        label: Says why the pool grew, e.g. ``"rule lse"``.
        setting: The key that sizes these requests, for error messages.
        counter: Counts requests (read with :attr:`count`).
    """

    __slots__ = ("counter", "default_nbytes", "defaults", "label", "nbytes", "rule", "setting")

    def __init__(
        self, rule: SizeRule | None, label: str, setting: str, defaults: Mapping[str, int] | None = None
    ) -> None:
        self.rule = rule
        # A literal rule's size, read without a method call on the hot path.
        self.nbytes = rule.nbytes if isinstance(rule, LiteralRule) else None
        # Configured default facts over the device's: what a call's missing facts are read from.
        self.defaults: Mapping[str, int] = defaults if defaults is not None else {}
        # The size of a call that gives no facts, resolved once (None: the defaults lack a fact,
        # and such a call raises the error that names it).
        self.default_nbytes: int | None = None
        if rule is not None and self.nbytes is None and set(rule.names) <= set(self.defaults):
            # A default fact the rule cannot use: each call raises the rule's own error.
            with contextlib.suppress(ValueError):
                self.default_nbytes = rule.resolve(self.defaults)
        self.label = label  # says why the pool grew, e.g. "rule lse"
        self.setting = setting  # the key that sizes these requests, for error messages
        # next() on itertools.count is atomic under the GIL: exact counts without a lock.
        self.counter = itertools.count()

    @property
    def count(self) -> int:
        """The requests counted so far."""
        # count's repr is "count(N)": the only way to read it without advancing it.
        return int(repr(self.counter)[6:-1])


def rule_slots(spec: PoolSpec, device_facts: Mapping[str, int] | None) -> dict[str, RuleSlot]:
    """Build a slot for each of ``spec``'s rules, its default facts over ``device_facts``.

    The rules of one pool share one merged mapping (merged once per pool and
    device); plain dicts, so merging one into a call's partial facts is a C-level copy.
    """
    merged: dict[int, dict[str, int]] = {}
    for own in spec.rule_facts.values():
        if id(own) not in merged:
            merged[id(own)] = {**(device_facts or {}), **own}
    return {
        name: RuleSlot(rule, f"rule {name}", spec.rule_setting(name), merged[id(spec.rule_facts[name])])
        for name, rule in spec.rules.items()
    }
