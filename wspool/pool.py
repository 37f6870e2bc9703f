"""One workspace pool on one device and lane, and the handles bound to it.

A pool's ``uint8`` buffer is allocated at the first request, zero-filled (kernels keep semaphores
in it), replaced when a request resolves larger (rounded by the growth policy, capped by
``max_bytes``), never shrunk. Frozen or capturing a CUDA graph, a pool never grows
(:class:`~wspool.errors.WorkspaceFrozenError`); a replaced buffer a graph may use is retired until
:meth:`WorkspacePool.release_retired`. A :class:`WorkspaceHandle` serves one rule with no lookup
while the workspace epoch stands. Thread-safe, with no lock held while allocating or logging; two
streams on one buffer race: give each a lane. docs/reliability.md states the guarantees.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NoReturn, Protocol, TypeVar

import torch

from wspool.devices import DeviceLike, StreamOrderWatch
from wspool.errors import (
    SizeError,
    WorkspaceFrozenError,
    WspoolError,
    describe_setting,
    growth_above_limit,
    growth_failed,
    growth_while_frozen,
    readable_int,
    unknown_rule,
)
from wspool.freeze import FreezeState, cuda_capture_probe
from wspool.rules import LiteralRule, SizeRule, compile_rule
from wspool.units import MAX_SIZE_BYTES, format_size, parse_size, positive_int

__all__ = [
    "EPOCH", "Allocator", "HitCount", "LimitsRefusal", "PoolSource", "PoolSpec", "PoolStats", "RegionsView",
    "WorkspaceHandle", "WorkspacePool", "bump_epoch", "zeros_allocator",
]  # fmt: skip


_T = TypeVar("_T")

#: Builds a reserved pool's refused-growth error: (pool, why it grows, facts to check, the call's, the refusal).
LimitsRefusal = Callable[["WorkspacePool", str, tuple[str, ...], Mapping[str, object], WorkspaceFrozenError], Exception]
#: Makes a zero-filled ``uint8`` tensor of ``nbytes`` on ``device``.
Allocator = Callable[[int, torch.device], torch.Tensor]


#: The process's workspace epoch, read by every handle per call: a call site may cache what it derived
#: from handles while ``EPOCH[0]`` is unchanged. Only :func:`bump_epoch` writes it.
EPOCH = [0]
_EPOCH = EPOCH
_epoch_lock = threading.Lock()


def bump_epoch() -> None:
    """Invalidate every :class:`WorkspaceHandle`: pools call it when they replace a buffer, registries when reset."""
    with _epoch_lock:
        _EPOCH[0] += 1


class HitCount:
    """The steady-state calls of one handle on one pool, from where its binding there began.

    The pool gives one at each binding and keeps it when the handle dies or binds elsewhere (then the
    count is final). Counted without a lock; a call made as the handle binds again counts in either pool.
    """

    __slots__ = ("base", "count", "handle", "read", "rule")

    def __init__(self, rule: str, handle: WorkspaceHandle) -> None:
        self.count = 0  # final once the handle bound elsewhere
        self.base = 0
        self.read: Callable[[], int] | None = None  # the running count, while bound here
        self.rule = rule
        self.handle = weakref.ref(handle)  # dead: the count is final

    def total(self) -> int:
        """Return the steady-state calls counted here so far."""
        read = self.read
        return self.count if read is None else read() - self.base


def zeros_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    """Allocate a zero-filled ``uint8`` buffer (the default allocator)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of one pool's state (pool, device and lane as strings).

    ``grow_count`` includes the first allocation; ``refused_count`` counts requests refused (frozen,
    capturing, over the limit, out of memory); ``retired_bytes`` are old buffers kept for captured graphs.
    """

    pool: str
    device: str
    lane: str
    capacity_bytes: int
    peak_request_bytes: int
    request_count: int
    grow_count: int
    last_grow_reason: str | None
    refused_count: int = 0
    retired_bytes: int = 0
    requests_by_rule: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


class PoolSpec:
    """A pool's configuration, shared by its instances on every device and lane.

    ``rule_pools`` and ``rule_facts`` map each rule to the pool whose ``pools.<pool>.rules.<rule>``
    key sets it and to that pool's default facts: this pool's, but for rules a ``shared_with`` pool
    brought to this buffer. ``facts`` are the pool's own default facts.
    """

    def __init__(
        self,
        name: str,
        rules: Mapping[str, str | int],
        growth: str = "exact",
        max_bytes: int | None = None,
        rule_pools: Mapping[str, str] | None = None,
        facts: Mapping[str, int] | None = None,
        rule_facts: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        self.name = name
        self.rule_pools: dict[str, str] = {rule: (rule_pools or {}).get(rule, name) for rule in rules}
        self.rules: dict[str, SizeRule] = {
            rule: compile_rule(source, ("pools", self.rule_pools[rule], "rules", rule))
            for rule, source in rules.items()
        }
        self.facts: dict[str, int] = dict(facts or {})
        self.rule_facts: dict[str, Mapping[str, int]] = {
            rule: (rule_facts or {}).get(rule, self.facts) for rule in rules
        }
        self.growth = growth
        self.granularity = 0 if growth in ("exact", "power_of_two") else parse_size(growth)
        self.max_bytes = max_bytes

    def setting(self, *parts: str) -> str:
        """Name a setting of this pool as ``"key / ENV_VAR"``."""
        return describe_setting(("pools", self.name, *parts))

    def rule_setting(self, rule: str) -> str:
        """Name the key that sets ``rule`` (in the pool that brought it, for shared buffers)."""
        return describe_setting(("pools", self.rule_pools.get(rule, self.name), "rules", rule))

    def capacity_for(self, nbytes: int) -> int:
        """Return the capacity to allocate for a request of ``nbytes``."""
        if self.growth == "power_of_two":
            capacity = 1 << max(nbytes - 1, 0).bit_length()
        elif self.granularity:
            capacity = -(-nbytes // self.granularity) * self.granularity
        else:
            capacity = nbytes
        if self.max_bytes is not None and capacity > self.max_bytes >= nbytes:
            capacity = self.max_bytes  # rounding may not push a fitting request over the cap
        return capacity


#: A refused growth: the error to raise, and the log line (format and arguments) to write first.
_GrowthRefusal = tuple[Exception, str, tuple[object, ...]]


def _growth_refusal(
    spec: PoolSpec,
    device: torch.device,
    lane: str,
    nbytes: int,
    old: int,
    reason: str,
    setting: str,
    frozen: bool,
    capturing: bool,
) -> _GrowthRefusal | None:
    """Return the error and log line refusing a growth to ``nbytes`` (over a limit, frozen, capturing), or ``None``."""
    limit = spec.max_bytes
    where = f"pool {spec.name!r} on {device} (lane {lane})"
    if (limit is not None and nbytes > limit) or nbytes > MAX_SIZE_BYTES:
        shown = limit if limit is not None and nbytes > limit else MAX_SIZE_BYTES
        what = "max_bytes" if shown == limit else "wspool's size limit"
        hint = f"raise {spec.setting('max_bytes')}" if shown == limit else f"lower {setting}"
        return (
            growth_above_limit(where, nbytes, format_size(nbytes), reason, what, shown, format_size(shown), hint),
            "wspool: refused %s on %s lane %s: %s (%s) needs %s bytes, above %s %d",
            (spec.name, device, lane, reason, format_size(nbytes), readable_int(nbytes), what, shown),
        )
    if frozen or capturing:
        why = "during CUDA-graph capture" if capturing else "while the registry is frozen"
        return (
            growth_while_frozen(where, why, reason, nbytes, format_size(nbytes), old, setting),
            "wspool: refused growth of %s on %s lane %s %s: %s needs %s bytes, %d available",
            (spec.name, device, lane, why, reason, readable_int(nbytes), old),
        )
    return None


class _RuleSlot:
    """Per rule (or request reason): its compiled rule, default facts, label, setting and request counter."""

    __slots__ = ("_reads", "counter", "default_nbytes", "defaults", "label", "nbytes", "rule", "setting")

    def __init__(
        self, rule: SizeRule | None, label: str, setting: str, defaults: Mapping[str, int] | None = None
    ) -> None:
        self.rule = rule
        self.nbytes = rule.nbytes if isinstance(rule, LiteralRule) else None  # a literal rule's, read with no call
        # Configured default facts over the device's: what a call's missing facts are read from.
        self.defaults: Mapping[str, int] = defaults if defaults is not None else {}
        # The size of a call that gives no facts, resolved once; None where the defaults lack a fact
        # or hold one the rule cannot use: such a call resolves, and raises the error naming it.
        self.default_nbytes: int | None = None
        if rule is not None and self.nbytes is None and set(rule.names) <= set(self.defaults):
            with contextlib.suppress(ValueError):
                self.default_nbytes = rule.resolve(self.defaults)
        self.label = label  # says why the pool grew, e.g. "rule lse"
        self.setting = setting  # the key that sizes these requests, for error messages
        self.counter = itertools.count()  # next() is atomic under the GIL: exact counts without a lock
        self._reads = 0

    def read_count(self) -> int:
        """Return the requests counted so far; callers hold the pool's lock, so reads never overlap."""
        count = next(self.counter) - self._reads  # next() counted this slot's earlier reads too
        self._reads += 1
        return count


def _rule_slots(spec: PoolSpec, device_facts: Mapping[str, int] | None) -> dict[str, _RuleSlot]:
    """Build a slot for each of ``spec``'s rules, its default facts over ``device_facts`` (plain dicts, merged once)."""
    merged: dict[int, dict[str, int]] = {}
    for own in spec.rule_facts.values():
        if id(own) not in merged:
            merged[id(own)] = {**(device_facts or {}), **own}
    return {
        name: _RuleSlot(rule, f"rule {name}", spec.rule_setting(name), merged[id(spec.rule_facts[name])])
        for name, rule in spec.rules.items()
    }


logger = logging.getLogger(__name__)


class WorkspacePool:
    """A workspace buffer for one (pool, device with an index, lane); create through a registry.

    ``capture_probe`` defaults to :func:`cuda_capture_probe` on CUDA devices;
    ``debug_streams`` watches for unordered streams there (:class:`wspool.devices.StreamOrderWatch`).
    """

    def __init__(
        self,
        spec: PoolSpec,
        device: torch.device,
        lane: str = "main",
        *,
        freeze: FreezeState | None = None,
        allocator: Allocator | None = None,
        capture_probe: Callable[[], bool] | None = None,
        debug_streams: bool = False,
        device_facts: Mapping[str, int] | None = None,
    ) -> None:
        self.spec = spec
        self.device = device
        self.lane = lane
        self._where = f"{spec.name} on {device} lane {lane}"  # how log lines name this pool
        self._freeze = freeze if freeze is not None else FreezeState()
        self._allocate: Allocator = allocator or zeros_allocator
        if capture_probe is None and device.type == "cuda":
            capture_probe = cuda_capture_probe(device)
        # None off CUDA: the per-call path then pays one attribute test for capture and streams.
        self._capture_probe = capture_probe
        self._watch: StreamOrderWatch | None = None
        if debug_streams and device.type == "cuda":
            self._watch = StreamOrderWatch(f"pool {spec.name!r} on {device} (lane {lane})", device)
        self._lock = threading.Lock()
        # The one thread allocating a new buffer, if any; the others wait on _grown, so
        # concurrent first requests allocate once while the allocator runs without the lock.
        self._grower: int | None = None
        self._grown = threading.Condition(self._lock)
        # (buffer, capacity) replaced as one object: unlocked readers never see a new capacity with the old buffer.
        self._state: tuple[torch.Tensor | None, int] = (None, 0)
        self._peak = self._grows = self._refused = 0
        self._last_reason: str | None = None
        self._captured = False
        self._buffer_epoch = 0  # FreezeState.stamp() when the current buffer was installed
        self._retired: list[torch.Tensor] = []
        self._slots: dict[str, _RuleSlot] = _rule_slots(spec, device_facts)
        self.generation = 0  # increments each time the buffer is replaced
        # Objects built on the current buffer (kernel wrappers), emptied whenever the buffer is replaced.
        self.buffer_cache: dict[Hashable, Any] = {}
        # Bound handles (they let go of a replaced buffer), the count cells this pool gave them
        # (counted in stats() whatever became of the handle), and the counts of dead handles' cells.
        self._handles: weakref.WeakSet[WorkspaceHandle] = weakref.WeakSet()
        self._cells: list[HitCount] = []
        self._taken: dict[str, int] = {}
        # Set by a reservation (wspool.bounds): a refused growth names the limit the call's facts exceed.
        self.limits_refusal: LimitsRefusal | None = None

    # -- the per-call path -------------------------------------------------

    def workspace(self, rule: str, facts: Mapping[str, object]) -> torch.Tensor:
        """Return the whole ``uint8`` buffer, grown first if ``rule`` resolves larger than it for ``facts``.

        Raises:
            RuleError: The rule is unknown or cannot be resolved for these facts.
            WorkspaceFrozenError: Growth was needed while frozen or capturing.
            WorkspaceLimitError: Growth was needed beyond ``max_bytes`` or memory.
        """
        slot = self._slots.get(rule)
        if slot is None or slot.rule is None:
            raise self._unknown_rule(rule)
        nbytes = slot.nbytes
        if nbytes is None:
            if facts:
                nbytes = slot.rule.resolve(facts, slot.defaults)
            else:
                nbytes = slot.default_nbytes or slot.rule.resolve(slot.defaults)
        if self._capture_probe is not None:
            if self._capture_probe():
                self._captured = True
            elif self._watch is not None:
                self._watch.observe()
        buffer, capacity = self._state
        if nbytes <= capacity:
            next(slot.counter)
            if nbytes > self._peak:
                self._note_peak(nbytes)
            return buffer  # type: ignore[return-value]
        return self._serve_growing(slot, nbytes, facts)

    def ensure(self, rule: str, facts: Mapping[str, object]) -> torch.Tensor:
        """Grow to what ``rule`` resolves to, without counting a request; raises as :meth:`workspace`."""
        slot, compiled = self._rule_slot(rule)
        nbytes = compiled.resolve(facts, slot.defaults)
        return self.grow_to(nbytes, slot.label, slot.setting, {**slot.defaults, **facts}, compiled.names)

    def resolve(self, rule: str, facts: Mapping[str, object]) -> int:
        """Return the bytes ``rule`` resolves to for ``facts`` (missing ones from the defaults); allocates nothing."""
        slot, compiled = self._rule_slot(rule)
        return compiled.resolve(facts, slot.defaults)

    def default_facts(self, rule: str) -> Mapping[str, int]:
        """Return the facts ``rule`` reads where a call gives none: the pool's defaults over the device's."""
        return MappingProxyType(self._rule_slot(rule)[0].defaults)

    def request(self, nbytes: int, reason: str = "request") -> torch.Tensor:
        """Return the buffer for an explicit size in bytes, grown first if needed; raises as :meth:`workspace`.

        A ``nbytes`` that is not a positive ``int`` (bool is not one) raises :class:`SizeError` and counts nothing.
        """
        if (type(nbytes) is not int or nbytes <= 0) and positive_int(nbytes) is None:
            raise SizeError(
                f"pool {self.spec.name!r}: a request needs a positive integer number of bytes, got {nbytes!r}"
            )
        # The steps below repeat workspace()'s: a helper shared with it would add a call to the per-call path.
        slot = self._slots.get(reason)
        if slot is None:
            with self._lock:
                slot = self._slots.setdefault(reason, _RuleSlot(None, reason, self.spec.setting("rules", "<rule>")))
        if self._capture_probe is not None:
            if self._capture_probe():
                self._captured = True
            elif self._watch is not None:
                self._watch.observe()
        buffer, capacity = self._state
        if nbytes <= capacity:
            next(slot.counter)
            if nbytes > self._peak:
                self._note_peak(nbytes)
            return buffer  # type: ignore[return-value]
        return self._serve_growing(slot, nbytes)

    def _note_peak(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self._peak:
                self._peak = nbytes

    def _serve_growing(self, slot: _RuleSlot, nbytes: int, facts: Mapping[str, object] | None = None) -> torch.Tensor:
        if slot.rule is None or facts is None:
            buffer = self._grow(nbytes, slot.label, slot.setting)
        else:
            buffer = self.grow_to(nbytes, slot.label, slot.setting, {**slot.defaults, **facts}, slot.rule.names)
        next(slot.counter)
        if nbytes > self._peak:
            self._note_peak(nbytes)
        return buffer

    # -- growth ------------------------------------------------------------

    def grow_to(
        self,
        nbytes: int,
        reason: str,
        setting: str | None = None,
        facts: Mapping[str, object] | None = None,
        names: tuple[str, ...] | None = None,
    ) -> torch.Tensor:
        """Grow to hold at least ``nbytes`` for ``reason``; ``setting`` is the key errors name (overflow recovery).

        A reserved pool's refusal names any of the call's ``facts`` (those of ``names``, default all) beyond its limit.
        """
        if facts is None or self.limits_refusal is None:
            return self._grow(nbytes, reason, setting)
        try:
            return self._grow(nbytes, reason, setting)
        except WorkspaceFrozenError as exc:
            raise self.limits_refusal(self, reason, tuple(facts) if names is None else names, facts, exc) from exc

    def _grow(self, nbytes: int, reason: str, setting: str | None) -> torch.Tensor:
        """Grow to ``nbytes`` unless it fits; one thread allocates (outside the lock), the others wait for it."""
        setting = setting or self.spec.setting("rules", "<rule>")
        # Asked before taking the lock: an engine's probe is its own code.
        capturing = self._capture_probe is not None and bool(self._capture_probe())
        while True:
            with self._lock:
                buffer, capacity = self._state
                if nbytes <= capacity:
                    return buffer  # type: ignore[return-value]
                refusal = self._refusal_locked(nbytes, reason, setting, capturing)
                if refusal is None:
                    if self._grower is not None:
                        if self._grower == threading.get_ident():
                            raise RuntimeError(f"pool {self.spec.name!r}: its allocator asked the same pool for memory")
                        self._grown.wait()  # another thread allocates: wait, then look again
                        continue
                    self._grower = threading.get_ident()
                    old = capacity
                    new_capacity = self.spec.capacity_for(nbytes)
            if refusal is not None:
                self._report_refusal(*refusal)
            try:
                return self._allocate_and_install(nbytes, new_capacity, old, reason, setting)
            finally:
                with self._lock:
                    self._grower = None
                    self._grown.notify_all()

    def _refusal_locked(self, nbytes: int, reason: str, setting: str, capturing: bool) -> _GrowthRefusal | None:
        """Return the error and log line for a refused growth (counted), or ``None`` to grow."""
        frozen, old = self._freeze.refuses_growth(), self._state[1]
        refusal = _growth_refusal(self.spec, self.device, self.lane, nbytes, old, reason, setting, frozen, capturing)
        if refusal is not None:
            self._refused += 1
        return refusal

    @staticmethod
    def _report_refusal(error: Exception, message: str, args: tuple[object, ...]) -> NoReturn:
        logger.warning(message, *args)
        raise error

    def _allocate_and_install(self, nbytes: int, capacity: int, old: int, reason: str, setting: str) -> torch.Tensor:
        """Allocate outside the lock (this thread is the pool's one grower), then install under it."""
        try:
            # Never an inference tensor, even when the first request comes under torch.inference_mode:
            # the buffer outlives that context, and kernels may write to it in place outside it.
            with torch.inference_mode(False):
                buffer = self._allocate(capacity, self.device)
        except WspoolError:
            raise
        except (RuntimeError, MemoryError, OverflowError) as exc:  # torch's OutOfMemoryError is a RuntimeError
            with self._lock:
                self._refused += 1
            logger.warning(
                "wspool: out of memory growing %s from %d to %d bytes for %s", self._where, old, capacity, reason
            )
            if isinstance(exc, torch.OutOfMemoryError):
                cause = "the device is out of memory"
            else:
                first = (str(exc).splitlines() or [""])[0][:120]
                cause = f"the allocation failed ({type(exc).__name__}: {first})"
            kept = format_size(old) if old else "empty"
            where = f"pool {self.spec.name!r} on {self.device} (lane {self.lane})"
            raise growth_failed(where, old, kept, capacity, format_size(capacity), reason, cause, setting) from exc
        with self._lock:
            refusal = self._refusal_locked(nbytes, reason, setting, False) if self._freeze.refuses_growth() else None
            if refusal is None:
                previous = self._state[0]
                if previous is not None and (self._captured or self._buffer_epoch != self._freeze.epoch):
                    self._retired.append(previous)  # a graph may replay into it: keep it until release_retired()
                self.buffer_cache = {}  # before the new state: a reader that sees the new buffer sees the new cache
                self._state = (buffer, capacity)
                self._captured = False
                self._buffer_epoch = self._freeze.stamp()  # -1 while frozen: retired when replaced
                self._grows += 1
                self.generation += 1
                bump_epoch()
                self._forget_in_handles()
                self._last_reason = f"{reason}: {format_size(nbytes)}"
        if refusal is not None:  # frozen while allocating: the new buffer is dropped
            self._report_refusal(*refusal)
        grown = (self._where, format_size(old), format_size(capacity), reason, nbytes)
        logger.info("wspool: pool %s grew %s -> %s for %s (requested %d bytes)", *grown)
        return buffer

    # -- what a bound handle reads ---------------------------------------------

    @property
    def capture_probe(self) -> Callable[[], bool] | None:
        """Whether the calling thread's stream captures a CUDA graph; ``None`` where it never can (off CUDA)."""
        return self._capture_probe

    @property
    def watches_streams(self) -> bool:
        """Whether every call is checked for unordered streams (``debug_streams``), so none may skip the pool."""
        return self._watch is not None

    def note_captured(self) -> None:
        """Record that a graph captured the current buffer, so it is retired, not freed, when replaced."""
        self._captured = True

    def attach(self, handle: WorkspaceHandle) -> HitCount:
        """Bind ``handle`` here: return a new :class:`HitCount` for its steady calls, each a request of its rule."""
        cell = HitCount(handle.rule, handle)
        with self._lock:
            live = []
            for held in self._cells:  # a dead handle's cell is final: fold it into the totals
                if held.handle() is None:
                    self._taken[held.rule] = self._taken.get(held.rule, 0) + held.total()
                else:
                    live.append(held)
            live.append(cell)
            self._cells = live
            self._handles.add(handle)
        return cell

    def detach(self, handle: WorkspaceHandle) -> None:
        """Stop telling ``handle`` of buffer replacements (it binds elsewhere); its counts here stay."""
        with self._lock:
            self._handles.discard(handle)

    def _forget_in_handles(self) -> None:
        """Make every attached handle let go of the buffer it holds (called with the lock held)."""
        for handle in list(self._handles):
            handle.forget_buffer()

    def drop_handles(self) -> None:
        """Make every attached handle let go of this pool's buffer (the registry drops the pool)."""
        with self._lock:
            self._forget_in_handles()

    # -- inspection and maintenance -----------------------------------------

    @property
    def buffer(self) -> torch.Tensor | None:
        """The current buffer, or ``None`` before the first request."""
        return self._state[0]

    @property
    def capacity_bytes(self) -> int:
        """The current buffer's size in bytes (0 before the first request)."""
        return self._state[1]

    def stats(self) -> PoolStats:
        """Return a consistent snapshot of this pool's statistics."""
        with self._lock:
            counts = {name: slot.read_count() for name, slot in self._slots.items()}
            for rule, taken in self._taken.items():
                counts[rule] = counts.get(rule, 0) + taken
            for cell in self._cells:
                counts[cell.rule] = counts.get(cell.rule, 0) + cell.total()
            by_rule = {name: count for name, count in counts.items() if count}
            return PoolStats(
                pool=self.spec.name, device=str(self.device), lane=self.lane, capacity_bytes=self._state[1],
                peak_request_bytes=self._peak, request_count=sum(by_rule.values()), grow_count=self._grows,
                last_grow_reason=self._last_reason, refused_count=self._refused,
                retired_bytes=sum(t.numel() for t in self._retired), requests_by_rule=MappingProxyType(by_rule),
            )  # fmt: skip

    def release_retired(self) -> int:
        """Drop retired buffers once no captured graph can replay them; return the bytes released."""
        with self._lock:
            released = sum(t.numel() for t in self._retired)
            self._retired.clear()
            return released

    def _rule_slot(self, rule: str) -> tuple[_RuleSlot, SizeRule]:
        """Return ``rule``'s slot and compiled rule (off the per-call path), or raise the error naming its setting."""
        slot = self._slots.get(rule)
        if slot is None or slot.rule is None:
            raise self._unknown_rule(rule)
        return slot, slot.rule

    def _unknown_rule(self, rule: str) -> Exception:
        return unknown_rule(self.spec.name, rule, (n for n, s in self._slots.items() if s.rule is not None))

    def __repr__(self) -> str:
        return (
            f"WorkspacePool({self.spec.name!r}, device={self.device}, lane={self.lane!r}, "
            f"capacity={format_size(self._state[1])})"
        )


#: How a steady call asks about capture: ``(raw_stream, stream_index, on_stream)`` (see :func:`_steady_state`).
_StreamCheck = tuple[Callable[[int], int] | None, int, Callable[[], None] | None]
_Hold = Callable[[int, torch.Tensor, HitCount, _StreamCheck], None]


def _steady_state() -> tuple[Callable[[], torch.Tensor | None], _Hold, Callable[[], None]]:
    """Make a handle's steady call (docs/performance.md), and what holds a served buffer in it and lets go of it.

    ``on_stream()`` asks about capture where ``raw_stream(index)`` is not CUDA's legacy default stream,
    which cannot capture. Writers clear the epoch first and set it last: a call racing them misses.
    """
    epoch = -1
    buffer: torch.Tensor | None = None
    hits: HitCount | None = None
    raw_stream: Callable[[int], int] | None = None
    index = 0
    on_stream: Callable[[], None] | None = None
    calls = 0  # every steady call of the handle's life: a cell is cheaper to add to than an attribute

    def steady() -> torch.Tensor | None:
        nonlocal calls
        if epoch == _EPOCH[0]:
            if raw_stream is not None and raw_stream(index):
                on_stream()  # type: ignore[misc]
            calls += 1
            return buffer
        return None

    def read() -> int:
        return calls

    def hold(held_epoch: int, held: torch.Tensor, cell: HitCount, stream_check: _StreamCheck) -> None:
        nonlocal epoch, buffer, hits, raw_stream, index, on_stream
        epoch = -1
        if cell is not hits:  # the calls from now on count in the pool that gave ``cell``
            now = calls
            if hits is not None:
                hits.count, hits.read = now - hits.base, None
            cell.base, cell.read = now, read
        buffer, hits, (raw_stream, index, on_stream) = held, cell, stream_check
        epoch = held_epoch

    def drop() -> None:
        nonlocal epoch, buffer
        epoch = -1
        buffer = None

    return steady, hold, drop


def _capture_check(probe: Callable[[], bool] | None, pool: WorkspacePool) -> _StreamCheck:
    """Return ``(raw_stream, stream_index, on_stream)`` for ``pool``: a probe without CUDA's parts is asked per call."""
    if probe is None:
        return None, 0, None
    parts = getattr(probe, "cuda_parts", None)
    capturing = probe if parts is None else parts[2]

    def on_stream() -> None:
        if capturing():
            pool.note_captured()

    return (_any_stream, 0, on_stream) if parts is None else (parts[0], parts[1], on_stream)


def _any_stream(_index: int) -> int:
    return 1  # a probe without CUDA's parts: any stream may capture


def _view(pool: WorkspacePool, buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return the one ``dtype`` view of ``buffer`` that every handle of the pool shares while it is current."""
    key = ("view", dtype)
    found = pool.buffer_cache.get(key)
    if found is None or found.data_ptr() != buffer.data_ptr() or found.numel() != buffer.numel():
        found = buffer.view(dtype)
        if pool.buffer is buffer:  # the cache belongs to the buffer installed now
            pool.buffer_cache[key] = found
    return found  # type: ignore[no-any-return]


class WorkspaceHandle:
    """One pool rule bound on one device and lane; create through :meth:`wspool.PoolRegistry.handle`.

    The buffer is held while the workspace epoch stands (a pool replacing its buffer, or a registry
    reset, reconfigured or replaced, moves it); the next call then binds again through the full path.
    Steady calls count as the pool's requests (:class:`HitCount`) and still ask the capture probe, so
    a buffer a graph captured is retired, not freed, on growth. Thread-safe; device and lane are fixed.

    Args:
        bind: Returns the pool instance that serves the rule now (the registry's).
        rule: The pool's rule that sizes every call.
        call_facts: The facts the call site may pass to :meth:`sized`; a rule reading none resolves once per binding.
        dtype: The dtype of the view returned (``None``: the pool's ``uint8``).
        facts: Facts fixed for the call site, read where a call gives none.
    """

    __slots__ = (
        "__weakref__", "_bind", "_bound", "_bound_facts", "_buffer", "_call_facts", "_cell", "_drop", "_drop_sized",
        "_dtype", "_hold", "_hold_sized", "_last_facts", "_pool", "_raw", "_sized_cell", "_sized_held",
        "_stream_check", "held", "reads_call_facts", "rule",
    )  # fmt: skip

    def __init__(
        self,
        bind: Callable[[], WorkspacePool],
        rule: str,
        *,
        call_facts: Iterable[str] = (),
        dtype: torch.dtype | None = None,
        facts: Mapping[str, object] | None = None,
    ) -> None:
        self._bind = bind
        self._bound_facts: Mapping[str, object] = dict(facts or {})
        self.rule = rule
        self._call_facts = frozenset(call_facts)
        self._dtype = None if dtype in (None, torch.uint8) else dtype
        self._bound = -1  # the epoch of the binding
        self._buffer: torch.Tensor | None = None
        self._raw: torch.Tensor | None = None
        self._pool: WorkspacePool | None = None
        self._stream_check: _StreamCheck = (None, 0, None)
        self._last_facts: object = None
        self._cell: HitCount | None = None  # the bound pool's counts of get() and sized() steady calls
        self._sized_cell: HitCount | None = None
        #: Whether the rule reads any fact the call site passes (decided at binding).
        self.reads_call_facts = False
        #: The steady state, one allocation-free call for the handle's life (a call site may keep it):
        #: what :meth:`get` returns, counted, while the epoch stands since the handle served, else ``None``.
        self.held: Callable[[], torch.Tensor | None]
        self.held, self._hold, self._drop = _steady_state()
        # The same for sized() calls with the mapping of the previous one.
        self._sized_held, self._hold_sized, self._drop_sized = _steady_state()
        self._rebind()

    def get(self) -> torch.Tensor:
        """Return the buffer for a call with no facts of its own; raises as :meth:`WorkspacePool.workspace`."""
        buffer = self.held()
        if buffer is not None:
            return buffer
        return self._serve(self._bound_facts, plain=True)

    __call__ = get

    def fetch(self, facts_of: Callable[[], Mapping[str, object]]) -> torch.Tensor:
        """Return the buffer, calling ``facts_of()`` only where the rule reads call facts; raises as :meth:`sized`."""
        buffer = self.held()
        if buffer is not None:
            return buffer
        if self.current_reads_call_facts():
            return self.sized(facts_of())
        return self._serve(self._bound_facts, plain=True)

    def sized(self, facts: Mapping[str, object]) -> torch.Tensor:
        """Return the buffer for ``facts`` (the previous call's very mapping reuses its size); raises as :meth:`get`."""
        if facts is self._last_facts:
            buffer = self._sized_held()
            if buffer is not None:
                return buffer
        if not self.current_reads_call_facts():
            return self.get()
        buffer = self._serve(facts, plain=False)
        self._last_facts = facts
        return buffer

    def forget_buffer(self) -> None:
        """Let go of the buffer held (its pool replaced or dropped it, and moved the epoch): the next call serves."""
        self._drop()
        self._drop_sized()
        self._buffer = self._raw = None

    def current_reads_call_facts(self) -> bool:
        """Whether the rule reads a call fact under the configuration in force now (binding again if it moved)."""
        if self._bound != _EPOCH[0]:
            self._rebind()
        return self.reads_call_facts

    def _serve(self, facts: Mapping[str, object], *, plain: bool) -> torch.Tensor:
        """The full path: bind again if the epoch moved, then ask the pool (which counts, grows and checks)."""
        epoch = _EPOCH[0]
        if self._bound != epoch:
            self._rebind()
        pool = self._pool
        assert pool is not None
        buffer = pool.workspace(self.rule, facts)
        if buffer is self._raw and self._buffer is not None:  # the same buffer: the same view, to compare tensors
            view = self._buffer
        else:
            view = buffer if self._dtype is None else _view(pool, buffer, self._dtype)
            self._raw = buffer
        self._buffer = view
        self._last_facts = None
        self._drop()
        self._drop_sized()
        # Held only if nothing moved the epoch meanwhile (this call's own growth did: serve again next time).
        if _EPOCH[0] == epoch and not pool.watches_streams and (not plain or not self.reads_call_facts):
            if plain:
                self._hold(epoch, view, self._cell, self._stream_check)  # type: ignore[arg-type]
            else:
                self._hold_sized(epoch, view, self._sized_cell, self._stream_check)  # type: ignore[arg-type]
        return view

    def _rebind(self) -> None:
        epoch = _EPOCH[0]
        old = self._pool
        pool = self._bind()
        if pool is not old:
            # Counts made on the old pool stay in its cell; this handle counts in a new cell of the new one.
            if old is not None:
                old.detach(self)
            self._cell, self._sized_cell = pool.attach(self), pool.attach(self)
            self._stream_check = _capture_check(pool.capture_probe, pool)
        compiled = pool.spec.rules.get(self.rule)
        unbound = self._call_facts.difference(self._bound_facts)
        self.reads_call_facts = compiled is not None and bool(unbound.intersection(compiled.names))
        self._pool = pool
        self._drop()
        self._drop_sized()
        self._bound = epoch

    @property
    def pool(self) -> WorkspacePool:
        """The pool instance bound now."""
        assert self._pool is not None
        return self._pool

    def __repr__(self) -> str:
        return f"WorkspaceHandle({self.pool.spec.name!r}, rule={self.rule!r}, device={self.pool.device})"


class RegionsView(Protocol):
    """What accounting reads of a registry's wrapper regions, its state under this key (``WrapperRegions``)."""

    def binding(self, wrapper: Any) -> Any: ...
    def stats(self) -> list[dict[str, Any]]: ...


class PoolSource(Protocol):
    """What accounting and agreement read from a registry (:class:`~wspool.PoolRegistry` is one); thread-safe."""

    def existing_wrapper_regions(self) -> RegionsView | None: ...
    def state(self, kind: type[_T], make: Callable[[], _T] | None = None) -> _T: ...
    def peek_state(self, kind: type[_T]) -> _T | None: ...
    @property
    def is_frozen(self) -> bool: ...
    def resolve(self, pool: str, rule: str = "default", *, device: DeviceLike = None, **facts: object) -> int: ...
    def pool_names(self) -> list[str]: ...
    def buffer_pool(self, name: str) -> str: ...
    def spec(self, pool: str, device: DeviceLike = None) -> PoolSpec: ...
    def pool(self, name: str, device: DeviceLike = None, *, lane: str | None = None) -> WorkspacePool: ...
    def pools(self) -> Iterator[WorkspacePool]: ...
