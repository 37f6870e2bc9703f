"""Tests for wspool.handles: bound handles serve without lookups, and bind again whenever anything changed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.helpers.registry import make_registry
from wspool.errors import RuleError, WorkspaceFrozenError
from wspool.handles import EPOCH, WorkspaceHandle
from wspool.pool import PoolSpec, WorkspacePool

MiB = 1 << 20
CPU = torch.device("cpu")


def test_a_handle_returns_the_pools_buffer_and_counts_requests() -> None:
    """Steady-state calls return the very buffer of the pool and count as requests of the rule."""
    reg = make_registry({"p": {"rules": {"default": "1MiB"}}})
    handle = reg.handle("p", device=CPU)
    first = handle.get()
    assert first is reg.pool("p", CPU).buffer and first.numel() == MiB
    assert handle.get() is first and handle() is first
    assert reg.stats("p", CPU).requests_by_rule["default"] == 3


def test_growth_reset_and_declarations_make_handles_bind_again() -> None:
    """Another rule's growth, a reset and set_registry each move the epoch: the next call gets the current buffer."""
    reg = make_registry({"p": {"rules": {"small": "1MiB", "big": "2MiB"}}})
    handle = reg.handle("p", "small", device=CPU)
    small = handle.get()
    grown = reg.workspace("p", CPU, rule="big")
    assert handle.get() is grown and grown is not small
    reg.reset()
    assert handle.get() is reg.pool("p", CPU).buffer and reg.stats("p", CPU).capacity_bytes == MiB


def test_a_handle_lets_go_of_a_replaced_buffer() -> None:
    """A handle does not keep a buffer its pool replaced alive: growth frees it (nothing captured it)."""
    reg = make_registry({"p": {"rules": {"small": "1MiB", "big": "2MiB"}}})
    handle = reg.handle("p", "small", device=CPU)
    old = weakref.ref(handle.get())
    reg.workspace("p", CPU, rule="big")
    gc.collect()
    assert old() is None


def test_a_frozen_registry_refuses_a_handle_that_must_grow() -> None:
    """The freeze check holds on a handle's first call: growth while frozen raises and nothing is allocated."""
    reg = make_registry({"p": {"rules": {"default": "1MiB"}}})
    handle = reg.handle("p", device=CPU)
    reg.freeze()
    with pytest.raises(WorkspaceFrozenError, match=r"pools\.p"):
        handle.get()
    assert reg.stats("p", CPU).capacity_bytes == 0


def test_a_capture_seen_by_a_steady_state_call_retires_the_buffer() -> None:
    """A steady-state call still asks the capture probe, so a captured buffer is retired, not freed, on growth."""
    capturing = [False]
    pool = WorkspacePool(PoolSpec("p", {"small": "1MiB", "big": "2MiB"}), CPU, capture_probe=lambda: capturing[0])
    handle = WorkspaceHandle(lambda: pool, "small")
    handle.get()
    handle.get()  # the steady state
    capturing[0] = True
    handle.get()
    capturing[0] = False
    pool.workspace("big", {})
    assert pool.stats().retired_bytes == MiB


def test_a_rule_that_reads_no_call_fact_is_resolved_once() -> None:
    """Whether the rule reads the call's facts is decided at binding: a literal or default-only rule does not."""
    reg = make_registry({"p": {"rules": {"fixed": "1MiB", "expr": "n * 1KiB"}, "facts": {"n": 4}}})
    assert not reg.handle("p", "fixed", device=CPU, call_facts=("n",)).reads_call_facts
    assert not reg.handle("p", "expr", device=CPU, call_facts=("m",)).reads_call_facts
    reading = reg.handle("p", "expr", device=CPU, call_facts=("n",))
    assert reading.reads_call_facts
    facts = {"n": 2048}
    assert reading.sized(facts).numel() == 2 * MiB and reading.sized(facts).numel() == 2 * MiB
    assert reading.sized({"n": 8}).numel() == 2 * MiB  # smaller fits the buffer the pool has


def test_a_handle_names_an_unknown_rule_and_a_missing_fact() -> None:
    """An unknown rule is refused when binding; a fact no default gives is the rule's error at the call."""
    reg = make_registry({"p": {"rules": {"expr": "n * 1KiB"}}})
    with pytest.raises(RuleError, match=r"pools\.p\.rules"):
        reg.handle("p", "nope", device=CPU)
    with pytest.raises(RuleError, match="needs fact"):
        reg.handle("p", "expr", device=CPU).get()


def test_bound_facts_size_a_call_that_passes_none() -> None:
    """Facts bound to the handle (an engine's fixed size) size a call that passes none, in the steady state too."""
    reg = make_registry({"p": {"rules": {"counters": "min_bytes"}}})
    handle = WorkspaceHandle(
        lambda: reg.serving_pool("p", "counters", CPU, "main"), "counters", call_facts=("min_bytes",),
        facts={"min_bytes": 4096},
    )  # fmt: skip
    assert not handle.reads_call_facts
    assert handle.get().numel() == 4096 and handle.get() is handle.get()


def test_a_dtype_view_is_shared_by_every_handle_of_the_pool() -> None:
    """Two rules' handles asking for int8 get the same view of the one buffer."""
    reg = make_registry({"p": {"rules": {"small": "1MiB", "big": "2MiB"}}})
    big = reg.handle("p", "big", device=CPU, dtype=torch.int8).get()
    small = reg.handle("p", "small", device=CPU, dtype=torch.int8).get()
    assert small is big and big.dtype == torch.int8


def test_the_steady_tuple_holds_the_buffer_only_while_the_epoch_stands() -> None:
    """``steady`` is what get() returns while its epoch is current; growth, reset and a fact-reading rule clear it."""
    reg = make_registry({"p": {"rules": {"small": "1MiB", "big": "2MiB", "rows": "rows * 1MiB"}}})
    handle = reg.handle("p", "small", device=CPU)
    assert handle.steady[1] is None
    buffer = handle.get()  # grows, which moves the epoch: the next call serves again and holds it
    assert handle.get() is buffer
    epoch, held, raw_stream, _ = handle.steady
    assert held is buffer and epoch == EPOCH[0] and raw_stream is None  # on the CPU: no stream to ask
    reg.workspace("p", CPU, rule="big")
    assert handle.steady[0] != EPOCH[0] or handle.steady[1] is None
    grown = handle.get()
    assert handle.steady[1] is grown and handle.get() is grown and handle.steady[0] == EPOCH[0]
    reg.reset()
    assert handle.steady[0] != EPOCH[0] or handle.steady[1] is None
    reading = reg.handle("p", "rows", device=CPU, call_facts=("rows",))
    facts = {"rows": 1}
    reading.sized(facts)
    reading.sized(facts)
    assert reading.steady[1] is None  # a rule that reads the call's facts has no fact-free steady state
