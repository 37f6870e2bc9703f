"""A model of the registry, checked against a real one over random operation sequences (hypothesis stateful).

A plain reference model (capacities, caps, counts, the freeze, which buffers a
graph may still use) runs beside real :class:`wspool.PoolRegistry` objects; every
operation's outcome is predicted by the model and compared, and these
invariants are checked after every step:

- I1: a buffer handed out during a capture, or current while frozen, stays alive
  and retired until ``release_retired()``; ``retired_bytes`` counts exactly those.
- I2: no pool, and no device's wrapper regions, exceed the cap in force.
- I3: a handle serves the very buffer ``workspace()`` serves for its arguments
  in the registry in force (the process-wide one, for a handle made from it).
- I4: request counters equal the calls served, and never move except on ``reset()``
  (a pool dropped by ``reset()`` keeps its counts).
- I5: growth while frozen succeeds only inside an open ``allowing_growth()`` of
  the calling thread or task (a task made inside and run after gets none).
- I6: ``stats()``, ``memory_stats()`` and ``memory_summary()`` report what is held.

CUDA is simulated as in tests/reliability/test_capture.py: ``cuda:0`` pools get
CPU buffers from the allocator and a capture probe that reads a flag; agree()
runs over a gloo world of one rank. The CI
profile runs 500 sequences of up to 50 steps; ``WSPOOL_MODEL_PROFILE=long``
runs 3000 of up to 100 (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import wspool
import wspool.devices
import wspool.pool
from tests.helpers.registry import make_registry
from wspool.distributed import AgreementFrozenError, AgreementLimitError, agree
from wspool.errors import ConfigError, WorkspaceFrozenError, WorkspaceLimitError
from wspool.flashinfer.wrapper_buffers import WrapperRegions, wrapper_regions

KiB = 1024
PROFILES = {
    "ci": settings(
        max_examples=500,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ),
    "long": settings(
        max_examples=3000,
        stateful_step_count=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ),
}
PROFILE = os.environ.get("WSPOOL_MODEL_PROFILE", "ci")

#: Pool -> rule -> the bytes it resolves to for fact n (the configuration below writes the same rules).
#: Pool g shares h's buffer (``shared_with``); d is declared in code.
RULES: dict[str, dict[str, Callable[[int], int]]] = {
    "a": {"small": lambda n: 1 * KiB, "n": lambda n: n * 256},
    "h": {"hn": lambda n: n * 512},
    "g": {"gn": lambda n: n * 128, "g1": lambda n: 3 * KiB},
    "d": {"dn": lambda n: n * 256},
}
HOST = {"a": "a", "h": "h", "g": "h", "d": "d"}
FIXED = {"small", "g1"}  # rules that read no fact
DEVICES: dict[str, Any] = {
    "cpu": "cpu",
    "torch cpu": torch.device("cpu"),
    "cuda:0": "cuda:0",
    "torch cuda:0": torch.device("cuda", 0),
    "cuda": "cuda",  # the current CUDA device
    "torch cuda": torch.device("cuda"),
    "index 0": 0,
    "current (None)": None,
}
CAPS = [None, 4 * KiB, 8 * KiB, 16 * KiB]
GROWTHS = ["exact", "power_of_two", "1KiB"]
CONTEXTS = [
    "main",
    "allowance",
    "thread",
    "thread with its own allowance",
    "thread started inside the allowance",
    "task awaited inside the allowance",
    "to_thread inside the allowance",
    "task made inside, run after the block",
]
ALLOWED = {
    "allowance",
    "thread with its own allowance",
    "task awaited inside the allowance",
    "to_thread inside the allowance",
}
CAPTURING = [False]  # the simulated stream's capture flag, read by every cuda:0 pool's probe


def _cpu_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Every device's buffers are made on the CPU (a simulated cuda:0 included)."""
    return torch.zeros(nbytes, dtype=torch.uint8)


def _device_key(spelling: str) -> str:
    if spelling == "current (None)":
        return str(wspool.devices.resolve_device(None))  # the CPU here; cuda:0 where CUDA is real
    return "cpu" if "cpu" in spelling else "cuda:0"


def _capacity_for(growth: str, cap: int | None, nbytes: int) -> int:
    """The capacity a pool allocates for a request, by the growth policy and cap (the model's own arithmetic)."""
    if growth == "power_of_two":
        capacity = 1 << max(nbytes - 1, 0).bit_length()
    elif growth == "1KiB":
        capacity = -(-nbytes // KiB) * KiB
    else:
        capacity = nbytes
    if cap is not None and capacity > cap >= nbytes:
        capacity = cap
    return capacity


@dataclass
class Buffer:
    """A buffer the model knows of: a weak reference, its size, and whether a graph may still use it."""

    ref: weakref.ref[torch.Tensor]
    nbytes: int
    protected: bool = False


@dataclass
class PoolModel:
    """The model of one pool instance (buffer, device, lane)."""

    capacity: int = 0
    current: Buffer | None = None
    old: list[Buffer] = field(default_factory=list)  # replaced buffers a graph may use (retired)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class RegistryModel:
    """The model of one registry: its caps and growth, its freeze, its pools."""

    real: wspool.PoolRegistry
    caps: dict[str, int | None]
    growth: dict[str, str]
    held: bool = False
    blocks: list[Any] = field(default_factory=list)  # open frozen() blocks
    pools: dict[tuple[str, str, str], PoolModel] = field(default_factory=dict)
    declared: dict[str, tuple[int | None, str]] = field(default_factory=dict)  # pool d: its cap and growth
    guest: int | None = None  # the size of the fixed rule declared for pool g, if any
    dropped: list[tuple[wspool.WorkspacePool, dict[str, int]]] = field(default_factory=list)

    @property
    def frozen(self) -> bool:
        return self.held or bool(self.blocks)


@dataclass
class HandleModel:
    """A handle, the registry it serves (None: the process-wide one) and its arguments."""

    handle: wspool.WorkspaceHandle
    registry: RegistryModel | None
    pool: str
    rule: str
    device: str
    lane: str
    facts: dict[int, dict[str, int]] = field(default_factory=dict)  # one mapping per n, passed again as is


class RegistryMachine(RuleBasedStateMachine):
    """Drives registries, handles, freezes, captures, regions and agreement; the model predicts every outcome."""

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        CAPTURING[0] = False
        self.registries: list[RegistryModel] = []
        self.default: RegistryModel | None = None
        self.private: RegistryModel | None = None
        self.live_wrappers: list[tuple[_Wrapper, WrapperRegions]] = []

    # -- building registries -------------------------------------------------------

    def _build(self, cap_a: int | None, cap_h: int | None, growth_a: str) -> RegistryModel:
        pools: dict[str, Any] = {
            "a": {"rules": {"small": "1KiB", "n": "n * 256"}, "growth": growth_a},
            "h": {"rules": {"hn": "n * 512"}},
            "g": {"shared_with": "h", "rules": {"gn": "n * 128", "g1": "3KiB"}},
            "ints": {"rules": {"default": "1KiB"}, "max_bytes": "4KiB"},
        }
        if cap_a is not None:
            pools["a"]["max_bytes"] = cap_a
        if cap_h is not None:
            pools["h"]["max_bytes"] = max(cap_h, 3 * KiB)  # g1 (3KiB) must fit: else the configuration is refused
        model = RegistryModel(
            make_registry(pools, allocator=_cpu_buffer),
            caps={"a": cap_a, "h": pools["h"].get("max_bytes")},
            growth={"a": growth_a, "h": "exact"},
        )
        self.registries.append(model)
        return model

    @initialize(cap_a=st.sampled_from(CAPS), cap_h=st.sampled_from(CAPS), growth_a=st.sampled_from(GROWTHS))
    def start(self, cap_a: int | None, cap_h: int | None, growth_a: str) -> None:
        self.private = self._build(cap_a, cap_h, growth_a)
        self.default = self._build(cap_a, cap_h, growth_a)
        wspool.set_registry(self.default.real)

    @rule(cap_a=st.sampled_from(CAPS), cap_h=st.sampled_from(CAPS), growth_a=st.sampled_from(GROWTHS))
    def reconfigure(self, cap_a: int | None, cap_h: int | None, growth_a: str) -> None:
        """A new process-wide registry (set_registry): handles made from the process-wide one follow it."""
        self.default = self._build(cap_a, cap_h, growth_a)
        wspool.set_registry(self.default.real)

    def _target(self, private: bool) -> RegistryModel:
        found = self.private if private else self.default
        assert found is not None
        return found

    # -- the model's predictions -------------------------------------------------------

    def _pool_model(self, reg: RegistryModel, pool: str, device: str, lane: str) -> PoolModel:
        return reg.pools.setdefault((HOST[pool], device, lane), PoolModel())

    def _cap(self, reg: RegistryModel, pool: str) -> int | None:
        host = HOST[pool]
        return reg.declared[host][0] if host == "d" else reg.caps[host]

    def _growth(self, reg: RegistryModel, pool: str) -> str:
        host = HOST[pool]
        return reg.declared[host][1] if host == "d" else reg.growth[host]

    def _expect(
        self, reg: RegistryModel, pool: str, device: str, lane: str, nbytes: int, allowed: bool
    ) -> tuple[str, PoolModel]:
        """Return the outcome the model predicts for a request of ``nbytes``: ok, same, limit or frozen."""
        model = self._pool_model(reg, pool, device, lane)
        capturing = CAPTURING[0] and device == "cuda:0"
        if capturing and model.current is not None:
            model.current.protected = True  # the probe marks the buffer before the size is looked at
        cap = self._cap(reg, pool)
        if nbytes <= model.capacity:
            return "same", model
        if cap is not None and nbytes > cap:
            return "limit", model
        if (reg.frozen and not allowed) or capturing:
            return "frozen", model
        return "ok", model

    def _install(self, reg: RegistryModel, pool: str, model: PoolModel, nbytes: int, served: torch.Tensor) -> None:
        """Record the buffer a growth installed (the previous one is retired if a graph may use it)."""
        capacity = _capacity_for(self._growth(reg, pool), self._cap(reg, pool), nbytes)
        assert served.numel() == capacity, f"grew to {served.numel()} bytes, the model says {capacity}"
        if model.current is not None and model.current.protected:
            model.old.append(model.current)
        model.current = Buffer(weakref.ref(served), capacity, protected=reg.frozen)
        model.capacity = capacity

    def _check_outcome(
        self,
        reg: RegistryModel,
        pool: str,
        rule_name: str,
        device: str,
        lane: str,
        nbytes: int,
        allowed: bool,
        call: Callable[[], torch.Tensor],
    ) -> None:
        expected, model = self._expect(reg, pool, device, lane, nbytes, allowed)
        try:
            served = call()
        except WorkspaceLimitError:
            assert expected == "limit", f"refused over max_bytes; the model expected {expected}"
            return
        except WorkspaceFrozenError:
            assert expected == "frozen", f"refused as frozen; the model expected {expected}"
            return
        assert expected in ("same", "ok"), f"served {served.numel()} bytes; the model expected {expected}"
        if expected == "same":
            held = model.current.ref() if model.current is not None else None
            assert served is held, "served another buffer than the one workspace() serves (I3)"
        else:
            self._install(reg, pool, model, nbytes, served)
        assert served is reg.real.pool(pool, device, lane=lane).buffer, "served a buffer its pool does not hold"
        model.counts[rule_name] = model.counts.get(rule_name, 0) + 1

    def _run_in(self, reg: RegistryModel, context: str, call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Wrap ``call`` to run in ``context`` (a thread, a task, inside or after an allowance block)."""
        real = reg.real

        def in_thread(target: Callable[[], torch.Tensor], allowance: bool) -> torch.Tensor:
            box: list[Any] = []

            def run() -> None:
                try:
                    if allowance:
                        with real.allowing_growth():
                            box.append(target())
                    else:
                        box.append(target())
                except BaseException as exc:  # re-raised in the calling thread
                    box.append(exc)

            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
            if isinstance(box[0], BaseException):
                raise box[0]
            return box[0]  # type: ignore[no-any-return]

        def run() -> torch.Tensor:
            if context == "main":
                return call()
            if context == "allowance":
                with real.allowing_growth():
                    return call()
            if context == "thread":
                return in_thread(call, False)
            if context == "thread with its own allowance":
                return in_thread(call, True)
            if context == "thread started inside the allowance":
                with real.allowing_growth():
                    return in_thread(call, False)

            async def in_task() -> torch.Tensor:
                return call()

            async def main() -> torch.Tensor:
                if context == "task awaited inside the allowance":
                    with real.allowing_growth():
                        return await asyncio.get_running_loop().create_task(in_task())
                if context == "to_thread inside the allowance":
                    with real.allowing_growth():
                        return await asyncio.to_thread(call)
                with real.allowing_growth():
                    task = asyncio.get_running_loop().create_task(in_task())
                return await task

            return asyncio.run(main())

        return run

    # -- requests ---------------------------------------------------------------------

    @rule(
        private=st.booleans(),
        pool_rule=st.sampled_from([(p, r) for p in ("a", "h", "g") for r in RULES[p]]),
        n=st.integers(1, 80),
        spelling=st.sampled_from(sorted(DEVICES)),
        lane=st.sampled_from(["main", "ubatch1"]),
        context=st.sampled_from(CONTEXTS),
    )
    def request(
        self, private: bool, pool_rule: tuple[str, str], n: int, spelling: str, lane: str, context: str
    ) -> None:
        """registry.workspace() with every device spelling, in a thread, a task or an allowance."""
        reg = self._target(private)
        pool, rule_name = pool_rule
        facts = {} if rule_name in FIXED else {"n": n}

        def call() -> torch.Tensor:
            return reg.real.workspace(pool, DEVICES[spelling], rule=rule_name, lane=lane, **facts)

        nbytes = RULES[pool][rule_name](n)
        device = _device_key(spelling)
        self._check_outcome(
            reg, pool, rule_name, device, lane, nbytes, context in ALLOWED, self._run_in(reg, context, call)
        )

    @rule(
        private=st.booleans(),
        pool_rule=st.sampled_from([("a", "n"), ("h", "hn"), ("g", "gn")]),
        steps=st.integers(1, 4),
        device=st.sampled_from(["cpu", "cuda:0"]),
        lane=st.sampled_from(["main", "ubatch1"]),
        context=st.sampled_from(["main", "allowance", "to_thread inside the allowance", "thread"]),
    )
    def grow(self, private: bool, pool_rule: tuple[str, str], steps: int, device: str, lane: str, context: str) -> None:
        """A request just above the capacity held: the pool must grow (or refuse), replacing its buffer."""
        reg = self._target(private)
        pool, rule_name = pool_rule
        per_n = RULES[pool][rule_name](1)
        n = self._pool_model(reg, pool, device, lane).capacity // per_n + steps

        def call() -> torch.Tensor:
            return reg.real.workspace(pool, device, rule=rule_name, lane=lane, n=n)

        run = self._run_in(reg, context, call)
        self._check_outcome(reg, pool, rule_name, device, lane, n * per_n, context in ALLOWED, run)

    @rule(
        h=handles,
        n=st.integers(1, 80),
        same_mapping=st.booleans(),
        context=st.sampled_from(CONTEXTS),
        calls=st.integers(1, 4),
    )
    def call_handle(self, h: HandleModel, n: int, same_mapping: bool, context: str, calls: int) -> None:
        """A handle's calls (the later ones in its steady state): what workspace() serves in the registry it follows."""
        reg = h.registry or self.default
        assert reg is not None
        call = self._handle_call(h, n, same_mapping)
        nbytes = RULES[h.pool][h.rule](n)
        for _ in range(calls):
            run = self._run_in(reg, context, call)
            self._check_outcome(reg, h.pool, h.rule, h.device, h.lane, nbytes, context in ALLOWED, run)

    @staticmethod
    def _handle_call(h: HandleModel, n: int, same_mapping: bool) -> Callable[[], torch.Tensor]:
        handle = h.handle
        if h.rule in FIXED:
            return handle.get
        facts = h.facts.setdefault(n, {"n": n}) if same_mapping else {"n": n}
        return lambda: handle.sized(facts)

    @rule(h=handles, n=st.integers(1, 80))
    def handle_and_workspace_agree(self, h: HandleModel, n: int) -> None:
        """A handle's call, then workspace() with its arguments: the same buffer, or the same refusal (I3)."""
        reg = h.registry or self.default
        assert reg is not None
        facts = {} if h.rule in FIXED else {"n": n}
        nbytes = RULES[h.pool][h.rule](n)
        self._check_outcome(reg, h.pool, h.rule, h.device, h.lane, nbytes, False, self._handle_call(h, n, False))

        def by_registry() -> torch.Tensor:
            return reg.real.workspace(h.pool, h.device, rule=h.rule, lane=h.lane, **facts)

        self._check_outcome(reg, h.pool, h.rule, h.device, h.lane, nbytes, False, by_registry)

    @rule(
        target=handles,
        private=st.booleans(),
        pool_rule=st.sampled_from([(p, r) for p in ("a", "h", "g") for r in RULES[p]]),
        spelling=st.sampled_from(sorted(DEVICES)),
        lane=st.sampled_from(["main", "ubatch1"]),
    )
    def make_handle(self, private: bool, pool_rule: tuple[str, str], spelling: str, lane: str) -> HandleModel:
        """A handle from the process-wide registry (get_registry()) or from a registry held by reference."""
        pool, rule_name = pool_rule
        source = self._target(True).real if private else wspool.get_registry()
        handle = source.handle(pool, rule_name, device=DEVICES[spelling], lane=lane, call_facts=("n",))
        return HandleModel(handle, self.private if private else None, pool, rule_name, _device_key(spelling), lane)

    @rule(h=consumes(handles))
    def drop_handle(self, h: HandleModel) -> None:
        """A handle garbage-collected: the calls it made stay counted (I4)."""
        del h.handle

    # -- declarations -----------------------------------------------------------------

    @rule(
        private=st.booleans(),
        cap=st.sampled_from([None, 2 * KiB, 8 * KiB]),
        growth=st.sampled_from(["exact", "power_of_two"]),
    )
    def declare_own_pool(self, private: bool, cap: int | None, growth: str) -> None:
        """declare_pool, again and again: a pool in use keeps its cap in force, or the declaration is refused."""
        reg = self._target(private)
        in_use = any(p.spec.name == "d" for p in reg.real.pools())
        try:
            reg.real.declare_pool("d", {"dn": "n * 256"}, growth=growth, max_bytes=cap)
        except ConfigError:
            assert in_use and reg.declared["d"] != (cap, growth), "a declaration refused for no reason"
            return
        assert not in_use or reg.declared.get("d") == (cap, growth), "a pool in use took another cap or growth"
        reg.declared["d"] = (cap, growth)

    @rule(private=st.booleans(), nbytes=st.sampled_from([2 * KiB, 6 * KiB, 12 * KiB, 40 * KiB]))
    def declare_guest_rule(self, private: bool, nbytes: int) -> None:
        """A guest's declared fixed rule that can never fit its shared buffer's cap is refused as YAML refuses it."""
        reg = self._target(private)
        in_use = any(p.spec.name == "h" for p in reg.real.pools())
        cap = reg.caps["h"]
        try:
            reg.real.declare_pool("g", {"gfix": nbytes})
        except ConfigError:
            too_big = cap is not None and nbytes > cap
            assert too_big or (in_use and reg.guest != nbytes), "a guest's rule refused for no reason"
            return
        assert cap is None or nbytes <= cap, f"a rule of {nbytes} bytes was accepted on a buffer capped at {cap}"
        assert not in_use or reg.guest == nbytes, "a pool in use took other rules"
        reg.guest = nbytes

    @precondition(lambda self: any("d" in r.declared for r in (self.private, self.default) if r is not None))
    @rule(private=st.booleans(), n=st.integers(1, 80), lane=st.sampled_from(["main", "ubatch1"]))
    def request_declared(self, private: bool, n: int, lane: str) -> None:
        """A request of the declared pool: served within the cap the model holds in force (I2)."""
        reg = self._target(private)
        if "d" not in reg.declared:
            return
        self._check_outcome(
            reg,
            "d",
            "dn",
            "cpu",
            lane,
            n * 256,
            False,
            lambda: reg.real.workspace("d", "cpu", rule="dn", lane=lane, n=n),
        )

    # -- freeze, capture, reset, release ---------------------------------------------------------

    def _protect_all(self, reg: RegistryModel) -> None:
        for model in reg.pools.values():
            if model.current is not None:
                model.current.protected = True

    @rule(private=st.booleans())
    def freeze(self, private: bool) -> None:
        reg = self._target(private)
        if not reg.frozen:
            self._protect_all(reg)
        reg.real.freeze()
        reg.held = True

    @rule(private=st.booleans())
    def unfreeze(self, private: bool) -> None:
        reg = self._target(private)
        reg.real.unfreeze()
        reg.held = False

    @rule(private=st.booleans())
    def open_frozen_block(self, private: bool) -> None:
        reg = self._target(private)
        if not reg.frozen:
            self._protect_all(reg)
        block = reg.real.frozen()
        block.__enter__()
        reg.blocks.append(block)

    @precondition(lambda self: any(r.blocks for r in (self.private, self.default) if r is not None))
    @rule(private=st.booleans())
    def close_frozen_block(self, private: bool) -> None:
        reg = self._target(private)
        if reg.blocks:
            reg.blocks.pop().__exit__(None, None, None)

    @rule(capturing=st.booleans())
    def capture(self, capturing: bool) -> None:
        """Begin or end a simulated CUDA-graph capture on the current stream (cuda:0 pools)."""
        CAPTURING[0] = capturing

    @rule(private=st.booleans())
    def release_retired(self, private: bool) -> None:
        reg = self._target(private)
        expected = sum(b.nbytes for m in reg.pools.values() for b in m.old)
        assert reg.real.release_retired() == expected
        for model in reg.pools.values():
            model.old.clear()

    @rule(private=st.booleans())
    def reset(self, private: bool) -> None:
        """reset(): pools dropped (they keep their counts), unfrozen; handles bind again."""
        reg = self._target(private)
        for pool in reg.real.pools():
            model = reg.pools.get((pool.spec.name, str(pool.device), pool.lane))
            reg.dropped.append((pool, dict(model.counts) if model is not None else {}))
        reg.real.reset()
        reg.pools.clear()
        reg.held = False
        for block in reg.blocks:
            block.__exit__(None, None, None)
        reg.blocks.clear()

    # -- agreement, regions, reads -------------------------------------------------------------

    @rule(
        pool=st.sampled_from(["a", "h", "g"]),
        nbytes=st.integers(1, 20).map(lambda k: k * KiB),
        lane=st.sampled_from(["main", "ubatch1"]),
    )
    def agree_on_one_rank(self, pool: str, nbytes: int, lane: str) -> None:
        """agree() on one rank with a reservation (a guest reserves its host): grows as modelled, or refuses."""
        reg = self._target(False)
        model = self._pool_model(reg, pool, "cpu", lane)
        cap = self._cap(reg, pool)
        try:
            agree(reg.real, device="cpu", reserve={(pool, lane): nbytes})
        except AgreementLimitError:
            assert nbytes > model.capacity and cap is not None and nbytes > cap
            return
        except AgreementFrozenError:
            assert nbytes > model.capacity and reg.frozen
            return
        if nbytes <= model.capacity:
            return
        assert not reg.frozen and (cap is None or nbytes <= cap)
        served = reg.real.pool(pool, "cpu", lane=lane).buffer
        assert served is not None
        self._install(reg, pool, model, nbytes, served)

    @rule(
        private=st.booleans(),
        pool=st.sampled_from(["a", "h", "g"]),
        nbytes=st.integers(1, 20).map(lambda k: k * KiB),
        spelling=st.sampled_from(sorted(DEVICES)),
        lane=st.sampled_from(["main", "ubatch1"]),
        context=st.sampled_from(["main", "allowance", "task made inside, run after the block"]),
    )
    def reserve(self, private: bool, pool: str, nbytes: int, spelling: str, lane: str, context: str) -> None:
        """reserve(nbytes=): growth ahead of time, refused as a request is, counted as a "reserve" request."""
        reg = self._target(private)

        def call() -> torch.Tensor:
            return reg.real.reserve(pool, DEVICES[spelling], nbytes=nbytes, lane=lane)

        device = _device_key(spelling)
        run = self._run_in(reg, context, call)
        self._check_outcome(reg, pool, "reserve", device, lane, nbytes, context in ALLOWED, run)

    @rule(nbytes=st.sampled_from([16, 500, 1500, 3000]), group=st.sampled_from([None, "g1", "g2"]))
    def bind_wrapper(self, nbytes: int, group: str | None) -> None:
        """A kernel wrapper given an int region, capped by pools.ints.max_bytes (I2)."""
        regions = wrapper_regions(self._target(False).real, pool="ints")
        wrapper = _Wrapper(regions)
        try:
            regions.bind(wrapper, device=torch.device("cpu"), nbytes=nbytes, kind="model", lane="main", group=group)
        except WorkspaceLimitError:
            return
        self.live_wrappers.append((wrapper, regions))

    @precondition(lambda self: bool(self.live_wrappers))
    @rule(index=st.integers(0, 8))
    def release_wrapper(self, index: int) -> None:
        """A wrapper freed: its region goes with it unless another wrapper of its group holds it."""
        if self.live_wrappers:
            del self.live_wrappers[index % len(self.live_wrappers)]

    @rule(private=st.booleans())
    def read_summary(self, private: bool) -> None:
        """memory_summary() names every pool that holds a buffer, with its capacity."""
        reg = self._target(private)
        summary = reg.real.memory_summary()
        for pool in reg.real.pools():
            if pool.capacity_bytes:
                assert pool.spec.name in summary

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def protected_buffers_live_and_are_counted_retired(self) -> None:
        """I1 and I6: every buffer a graph may use is alive; retired_bytes counts the replaced ones."""
        for reg in self.registries:
            for key, model in reg.pools.items():
                for buffer in (*model.old, model.current):
                    if buffer is not None and buffer.protected:
                        assert buffer.ref() is not None, f"{key}: a buffer a graph may use was freed before release"
                pool = reg.real.pool(key[0], key[1], lane=key[2])
                stats = pool.stats()
                assert stats.retired_bytes == sum(b.nbytes for b in model.old), f"{key}: retired bytes"
                assert stats.capacity_bytes == model.capacity, f"{key}: capacity {stats.capacity_bytes}"
                held = pool.buffer
                assert (0 if held is None else held.numel()) == model.capacity

    @invariant()
    def caps_hold(self) -> None:
        """I2: no pool, and no device's wrapper regions, hold more than the cap in force."""
        for reg in self.registries:
            for pool in reg.real.pools():
                cap = self._cap(reg, pool.spec.name) if pool.spec.name in HOST else None
                assert cap is None or pool.capacity_bytes <= cap, f"{pool} above its cap {cap}"
        for reg in self.registries:
            regions = reg.real.peek_state(WrapperRegions)
            for entry in regions.stats() if regions is not None else []:
                assert entry["region_bytes"] <= 4 * KiB, f"wrapper regions hold {entry['region_bytes']} bytes"

    @invariant()
    def counts_are_the_calls_served(self) -> None:
        """I4: each pool counts exactly the calls it served; a dropped pool keeps its counts."""
        for reg in self.registries:
            for key, model in reg.pools.items():
                counted = dict(reg.real.pool(key[0], key[1], lane=key[2]).stats().requests_by_rule)
                assert counted == {r: c for r, c in model.counts.items() if c}, f"{key}: counts"
            for pool, counts in reg.dropped:
                kept = dict(pool.stats().requests_by_rule)
                assert kept == {r: c for r, c in counts.items() if c}, f"dropped {pool}: counts moved"

    @invariant()
    def memory_stats_report_what_is_held(self) -> None:
        """I6: memory_stats() holds the capacities and retired bytes of every pool, and the live regions."""
        for reg in {id(r): r for r in (self.private, self.default) if r is not None}.values():
            data = reg.real.memory_stats()
            expected = sum(m.capacity + sum(b.nbytes for b in m.old) for m in reg.pools.values())
            assert data["held_bytes"] == expected
            regions = reg.real.peek_state(WrapperRegions)
            if regions is not None:
                live = {
                    id(b.region): b.region.nbytes
                    for w, r in self.live_wrappers
                    if r is regions and (b := r.binding(w)) is not None
                }
                assert sum(e["region_bytes"] for e in data["int_regions"]) == sum(live.values())

    def teardown(self) -> None:
        CAPTURING[0] = False
        for reg in self.registries:
            for block in reg.blocks:
                block.__exit__(None, None, None)


class _Wrapper:
    """A stand-in kernel wrapper (regions hold wrappers weakly)."""

    def __init__(self, regions: Any) -> None:
        self.regions = regions


@pytest.fixture
def simulated_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """cuda:0 pools made on the CPU with a capture flag, and a torch.distributed world of one rank (gloo)."""
    wspool.devices.resolve_device(None)  # decided once per process: keep the real answer for later tests
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # Every cuda:0 pool's probe reads the flag, on a CPU build of torch and on a CUDA one alike.
    monkeypatch.setattr(wspool.pool, "cuda_capture_probe", lambda device: lambda: CAPTURING[0])
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


def test_the_registry_keeps_its_guarantees_over_random_sequences(simulated_cuda: None) -> None:
    """I1-I6 hold after every step of random sequences of registry operations (profile: WSPOOL_MODEL_PROFILE)."""
    run_state_machine_as_test(RegistryMachine, settings=PROFILES[PROFILE])
