"""Tests for wspool.pool's WorkspaceHandle: it serves without lookups, and binds again whenever anything changed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import wspool
from tests.helpers.registry import make_registry
from wspool.errors import RuleError, WorkspaceFrozenError
from wspool.pool import EPOCH, PoolSpec, WorkspaceHandle, WorkspacePool

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


def test_held_returns_the_buffer_only_while_the_epoch_stands() -> None:
    """``held()`` returns get()'s buffer, counted, while its epoch stands, and ``None`` after growth or reset."""
    reg = make_registry({"p": {"rules": {"small": "1MiB", "big": "2MiB", "rows": "rows * 1MiB"}}})
    handle = reg.handle("p", "small", device=CPU)
    assert handle.held() is None
    buffer = handle.get()  # grows, which moves the epoch: the next call serves again and holds it
    assert handle.get() is buffer
    before = reg.stats("p", CPU).requests_by_rule["small"]
    assert handle.held() is buffer
    assert reg.stats("p", CPU).requests_by_rule["small"] == before + 1
    reg.workspace("p", CPU, rule="big")
    assert handle.held() is None
    grown = handle.get()
    assert handle.held() is grown and handle.get() is grown
    reg.reset()
    assert handle.held() is None
    after = reg.stats("p", CPU).requests_by_rule
    reading = reg.handle("p", "rows", device=CPU, call_facts=("rows",))
    facts = {"rows": 1}
    reading.sized(facts)
    reading.sized(facts)
    assert reading.held() is None  # a rule that reads the call's facts has no fact-free steady state
    assert reg.stats("p", CPU).requests_by_rule.get("small", 0) == after.get("small", 0)  # a miss counts nothing


def test_steady_state_calls_of_get_fetch_and_sized_each_count_as_a_request() -> None:
    """Every call a handle serves counts once in requests_by_rule, through get(), fetch() and sized() alike."""
    reg = make_registry({"p": {"rules": {"default": "1MiB", "rows": "rows * 1KiB"}}})
    plain = reg.handle("p", device=CPU)
    asked: list[int] = []

    def facts_of() -> dict[str, object]:
        asked.append(1)
        return {}

    for _ in range(3):
        plain.get()
        plain.fetch(facts_of)
    reading = reg.handle("p", "rows", device=CPU, call_facts=("rows",))
    facts = {"rows": 4}
    for _ in range(4):
        reading.sized(facts)
    counts = reg.stats("p", CPU).requests_by_rule
    assert (counts["default"], counts["rows"], asked) == (6, 4, [])
    assert reg.stats("p", CPU).request_count == 10


def test_fetch_asks_for_the_facts_only_where_the_rule_reads_them() -> None:
    """fetch() sizes a fact-reading rule by what facts_of() returns, each call, and counts each call."""
    reg = make_registry({"p": {"rules": {"rows": "rows * 1MiB"}}})
    handle = reg.handle("p", "rows", device=CPU, call_facts=("rows",))
    assert handle.fetch(lambda: {"rows": 1}).numel() == MiB
    assert handle.fetch(lambda: {"rows": 3}).numel() == 3 * MiB
    assert handle.fetch(lambda: {"rows": 2}).numel() == 3 * MiB
    assert reg.stats("p", CPU).requests_by_rule["rows"] == 3


def test_every_call_path_serves_the_grown_buffer_after_another_rule_grew_the_pool() -> None:
    """After growth by another rule, get(), fetch() and sized() each return the pool's new buffer, never the old."""
    reg = make_registry({"p": {"rules": {"small": "1MiB", "big": "2MiB", "rows": "rows * 1KiB"}}})
    plain = reg.handle("p", "small", device=CPU)
    reading = reg.handle("p", "rows", device=CPU, call_facts=("rows",))
    facts = {"rows": 8}
    for _ in range(2):
        plain.get(), plain.fetch(dict), reading.sized(facts)
    grown = reg.workspace("p", CPU, rule="big")
    assert plain.fetch(dict) is grown and plain.get() is grown and reading.sized(facts) is grown
    assert reg.stats("p", CPU).capacity_bytes == 2 * MiB


def test_a_handle_serves_the_size_a_redeclared_pool_gives_after_a_reset() -> None:
    """A handle whose pool was reset and declared again with a larger rule serves the new size on every path."""
    reg = make_registry({})
    reg.declare_pool("q", {"default": "1MiB"})
    handle = reg.handle("q", device=CPU)
    assert handle.get().numel() == MiB and handle.fetch(dict).numel() == MiB
    reg.reset()
    reg.declare_pool("q", {"default": "2MiB"})
    assert handle.fetch(dict).numel() == 2 * MiB and handle.get().numel() == 2 * MiB
    assert reg.stats("q", CPU).requests_by_rule["default"] == 2


def test_a_handle_whose_rule_left_its_pool_is_refused_at_its_next_call() -> None:
    """A rule no longer the pool's own after a reset and a new declaration raises the error naming the setting."""
    reg = make_registry({})
    reg.declare_pool("q", {"gone": "1MiB"})
    handle = reg.handle("q", "gone", device=CPU)
    handle.get()
    reg.reset()
    reg.declare_pool("q", {"default": "2MiB"})
    with pytest.raises(RuleError, match=r"pools\.q\.rules"):
        handle.get()


class _StreamProbe:
    """A capture probe with CUDA's parts (raw stream per device index, capture check), driven by the test."""

    def __init__(self, index: int) -> None:
        self.streams: dict[int, int] = {}
        self.capturing = False
        self.cuda_parts = (self.raw_stream, index, self.is_capturing)

    def raw_stream(self, index: int) -> int:
        return self.streams.get(index, 0)

    def is_capturing(self) -> bool:
        return self.capturing

    def __call__(self) -> bool:
        return self.raw_stream(self.cuda_parts[1]) != 0 and self.capturing


@pytest.mark.parametrize("path", ["get", "fetch", "sized"])
def test_a_steady_state_call_on_a_capturing_stream_retires_the_buffer(path: str) -> None:
    """Through the probe's parts, a steady-state call on the device's capturing stream marks its buffer captured."""
    probe = _StreamProbe(index=3)
    spec = PoolSpec("p", {"small": "rows * 1KiB", "big": "2MiB"}, facts={"rows": 1024})
    pool = WorkspacePool(spec, CPU, capture_probe=probe)
    handle = WorkspaceHandle(lambda: pool, "small", call_facts=("rows",) if path == "sized" else ())
    facts = {"rows": 1024}

    def call() -> torch.Tensor:
        return {"get": handle.get, "fetch": lambda: handle.fetch(dict), "sized": lambda: handle.sized(facts)}[path]()

    call()
    call()  # the steady state
    probe.capturing = True
    call()  # on the legacy default stream: no capture
    probe.streams[2] = 5  # another device's stream
    call()
    assert pool.stats().retired_bytes == 0
    probe.capturing = False
    pool.workspace("big", {})
    assert pool.stats().retired_bytes == 0  # nothing captured the old buffer: dropped
    call(), call()
    probe.streams[3], probe.capturing = 9, True
    call()
    probe.capturing = False
    pool.request(4 * MiB)
    assert pool.stats().retired_bytes == 2 * MiB


def test_held_asks_the_probes_stream_function_with_the_devices_index() -> None:
    """``held()`` on a pool whose probe has CUDA's parts asks its stream function for the device's index only."""
    probe = _StreamProbe(index=5)
    asked: list[int] = []
    stream_of = probe.raw_stream

    def raw_stream(index: int) -> int:
        asked.append(index)
        return stream_of(index)

    probe.cuda_parts = (raw_stream, 5, probe.is_capturing)
    pool = WorkspacePool(PoolSpec("p", {"default": "1MiB"}), CPU, capture_probe=probe)
    handle = WorkspaceHandle(lambda: pool, "default")
    handle.get()
    buffer = handle.get()
    asked.clear()
    assert handle.held() is buffer and asked == [5]


# -- counts stay with the pool that served them; process-wide handles follow the process-wide registry --------


def test_a_dead_handle_leaves_its_steady_state_calls_counted() -> None:
    """Calls a handle served stay in the pool's counts after the handle is garbage-collected."""
    reg = make_registry({"p": {"rules": {"default": "1KiB"}}})
    handle = reg.handle("p", device=CPU)
    for _ in range(12):
        handle.get()
    assert reg.stats("p", CPU).requests_by_rule["default"] == 12
    del handle
    gc.collect()
    assert reg.stats("p", CPU).requests_by_rule["default"] == 12


def test_a_handle_that_rebinds_before_any_hit_leaves_its_old_pool() -> None:
    """After reset() a handle's calls count in the new pool only; the old pool keeps what it served."""
    reg = make_registry({"p": {"rules": {"default": "1KiB"}}})
    handle = reg.handle("p", device=CPU)
    handle.get()
    old = reg.pool("p", CPU)
    assert old.stats().request_count == 1
    reg.reset()
    for _ in range(3):
        handle.get()
    assert reg.pool("p", CPU).stats().request_count == 3
    assert old.stats().request_count == 1


def test_a_handle_that_rebinds_after_hits_leaves_them_with_its_old_pool() -> None:
    """Steady-state calls made before reset() stay counted in the old pool; later ones count in the new pool."""
    reg = make_registry({"p": {"rules": {"default": "1KiB"}}})
    handle = reg.handle("p", device=CPU)
    for _ in range(4):
        handle.get()
    old = reg.pool("p", CPU)
    reg.reset()
    for _ in range(5):
        handle.get()
    assert (old.stats().request_count, reg.pool("p", CPU).stats().request_count) == (4, 5)


def test_a_process_wide_handle_follows_set_registry() -> None:
    """A handle made from get_registry() serves the registry set later: its sizes and its freeze."""
    first = make_registry({"p": {"rules": {"default": "1KiB"}}})
    wspool.set_registry(first)
    handle = wspool.get_registry().handle("p", device=CPU)
    assert handle.get().numel() == 1024
    second = make_registry({"p": {"rules": {"default": "2KiB"}}})
    wspool.set_registry(second)
    assert handle.get().numel() == 2048 and handle.pool is second.pool("p", CPU)
    third = make_registry({"p": {"rules": {"default": "4KiB"}}})
    third.freeze()
    wspool.set_registry(third)
    with pytest.raises(WorkspaceFrozenError, match=r"pool 'p' on cpu"):
        handle.get()


def test_a_handle_of_a_registry_held_by_reference_stays_with_it() -> None:
    """A handle made from a registry that is not the process-wide one keeps serving that registry."""
    mine = make_registry({"p": {"rules": {"default": "1KiB"}}})
    handle = mine.handle("p", device=CPU)
    wspool.set_registry(make_registry({"p": {"rules": {"default": "2KiB"}}}))
    assert handle.get().numel() == 1024 and handle.pool is mine.pool("p", CPU)


@pytest.mark.parametrize("path", ["get", "fetch", "sized", "int8"])
def test_steady_state_calls_return_the_held_buffer_without_the_pools_full_path(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a call was served in the epoch, later calls return the held buffer and never call pool.workspace()."""
    pool = WorkspacePool(PoolSpec("p", {"rows": "rows * 1KiB"}, facts={"rows": 1024}), CPU)
    handle = WorkspaceHandle(
        lambda: pool,
        "rows",
        call_facts=("rows",) if path == "sized" else (),
        dtype=torch.int8 if path == "int8" else None,
    )
    facts = {"rows": 1024}
    call = {
        "get": handle.get,
        "int8": handle.get,
        "fetch": lambda: handle.fetch(dict),
        "sized": lambda: handle.sized(facts),
    }[path]
    first = call()  # grows, which moves the epoch
    second = call()  # served again, now held
    full_path: list[str] = []
    served = pool.workspace
    monkeypatch.setattr(pool, "workspace", lambda rule, f: full_path.append(rule) or served(rule, f))
    held = [call() for _ in range(3)]
    assert full_path == [] and all(b is second for b in held)
    assert second.data_ptr() == first.data_ptr() and second.dtype == (torch.int8 if path == "int8" else torch.uint8)
    assert pool.stats().requests_by_rule["rows"] == 5


def test_every_call_path_of_a_process_wide_handle_follows_set_registry() -> None:
    """fetch() and sized() in their steady state serve the registry set later, with its rules and their facts."""
    wspool.set_registry(make_registry({"p": {"rules": {"default": "1KiB", "rows": "rows * 1KiB"}}}))
    plain = wspool.get_registry().handle("p", device=CPU, call_facts=("rows",))
    reading = wspool.get_registry().handle("p", "rows", device=CPU, call_facts=("rows",))
    facts = {"rows": 2}
    for _ in range(3):
        assert reading.sized(facts).numel() == 2048
        assert plain.fetch(lambda: {"rows": 2}).numel() == 2048  # the pool's one buffer, grown by the other rule
    second = make_registry({"p": {"rules": {"default": "rows * 4KiB", "rows": "rows * 8KiB"}}})
    wspool.set_registry(second)
    assert plain.fetch(lambda: {"rows": 1}).numel() == 4096  # the rule reads a call fact now: asked for
    assert reading.sized(facts).numel() == 16384 and reading.pool is second.pool("p", CPU)


def test_sized_serves_a_rule_that_reads_no_call_fact_as_get_does() -> None:
    """sized() on a handle whose rule reads none of the call's facts returns the buffer get() returns."""
    reg = make_registry({"p": {"rules": {"default": "1MiB"}}})
    handle = reg.handle("p", device=CPU)
    buffer = handle.sized({"rows": 3})
    assert buffer is handle.get() and buffer is handle.sized({"rows": 5}) and buffer.numel() == MiB


@pytest.mark.parametrize("path", ["get", "fetch", "sized"])
@pytest.mark.parametrize("captures", [False, True])
def test_a_steady_state_call_asks_a_plain_probe_and_retires_only_what_it_saw(path: str, captures: bool) -> None:
    """With a probe lacking CUDA parts (or none), steady-state calls retire the buffer only when it says so."""
    capturing = [False]
    probe = (lambda: capturing[0]) if captures else None
    pool = WorkspacePool(PoolSpec("p", {"small": "1MiB", "big": "2MiB"}), CPU, capture_probe=probe)
    handle = WorkspaceHandle(lambda: pool, "small")
    call = {"get": handle.get, "fetch": lambda: handle.fetch(dict), "sized": lambda: handle.sized({"x": 1})}[path]
    call()
    call()
    capturing[0] = captures
    call()
    capturing[0] = False
    pool.workspace("big", {})
    assert pool.stats().retired_bytes == (MiB if captures else 0)


def test_a_handle_binds_once_per_epoch() -> None:
    """A handle asks its bind callable once when made and once after each epoch move, not per call."""
    pool = WorkspacePool(PoolSpec("p", {"small": "1MiB", "big": "2MiB"}), CPU)
    binds: list[int] = []

    def bind() -> WorkspacePool:
        binds.append(EPOCH[0])
        return pool

    handle = WorkspaceHandle(bind, "small")
    for _ in range(4):
        handle.get()  # the first grows, which moves the epoch once
    assert len(binds) == 2
    pool.workspace("big", {})
    for _ in range(4):
        handle.get()
    assert len(binds) == 3 and handle.get().numel() == 2 * MiB
