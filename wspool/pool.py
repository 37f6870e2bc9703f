"""One workspace pool on one device and lane: a lazily grown, zero-filled ``uint8`` buffer.

Device semantics: a pool lives on exactly one ``torch.device``; nothing is
allocated before the first request, and the buffer is created there with
``torch.zeros`` (so kernels that keep semaphores in it start from zero).

Growth: a request that resolves larger than the capacity replaces the buffer
with a new, larger, zero-filled one (rounded by the pool's growth policy,
capped by ``max_bytes``). The pool never shrinks by itself and never calls
``torch.cuda.empty_cache()``.

Capture semantics: a pool never allocates while the current CUDA stream is
capturing a graph; such a request raises :class:`WorkspaceFrozenError`, and
the buffer is left exactly as it was.

Old buffers: a captured graph holds raw addresses, not references, so when a
pool grows, its previous buffer is *retired* (kept alive, counted in
``retired_bytes``) rather than dropped if a graph may still replay into it:
if it was handed out during a capture, or if the registry was frozen while it
was current (freezing is how an engine says "graphs are being captured now").
Retired buffers live until :meth:`WorkspacePool.release_retired`, which the
engine calls once those graphs are gone. Any other previous buffer is dropped
by the pool and freed by PyTorch when the caller's last reference to it goes
(a kernel wrapper that keeps the tensor keeps its memory). Pools never call
``torch.cuda.empty_cache()``.

Thread semantics: every method is thread-safe; concurrent first requests
allocate once. No lock is held while the pool logs or calls its allocator or
capture probe, so those may read the pool's statistics. Using one buffer from two CUDA streams at once is a data race:
give each stream its own lane; :mod:`wspool.streams` can watch for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Any, NoReturn

import torch

from wspool.errors import SizeError, WspoolError
from wspool.freeze import FreezeState, cuda_capture_probe
from wspool.growth_errors import Refusal, allocation_failure, growth_refusal, unknown_rule
from wspool.pool_spec import Allocator, PoolSpec, PoolStats, zeros_allocator
from wspool.rule_slots import RuleSlot, rule_slots
from wspool.streams import StreamOrderWatch
from wspool.units import format_size

__all__ = ["Allocator", "PoolSpec", "PoolStats", "WorkspacePool", "cuda_capture_probe"]

logger = logging.getLogger("wspool")


class WorkspacePool:
    """A workspace buffer for one (pool, device, lane); create through a registry.

    Args:
        spec: The pool's configuration.
        device: Where the buffer lives (an explicit device, never ``"cuda"``
            without an index).
        lane: The lane name; distinct lanes never share memory.
        freeze: The registry's freeze flag.
        allocator: Makes zero-filled buffers; the default is ``torch.zeros``.
        capture_probe: Says whether the calling thread's current stream is
            capturing a CUDA graph. Default: :func:`cuda_capture_probe` on CUDA
            devices, none (never capturing) elsewhere. Engines that
            track capture themselves, and tests, may pass their own.
        debug_streams: On CUDA devices, watch for the buffer being handed to
            two streams without ordering (see :mod:`wspool.streams`).
        device_facts: The device's facts (:mod:`wspool.device_facts`); each rule
            reads a fact its call lacks from its pool's default facts, then from these.
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
        # (buffer, capacity) replaced as one object, so unlocked readers never see a
        # new capacity with the old, smaller buffer.
        self._state: tuple[torch.Tensor | None, int] = (None, 0)
        self._peak = 0
        self._grows = 0
        self._refused = 0
        self._last_reason: str | None = None
        self._captured = False
        self._buffer_epoch = 0  # the freeze epoch when the current buffer was allocated
        self._retired: list[torch.Tensor] = []
        self._slots: dict[str, RuleSlot] = rule_slots(spec, device_facts)
        self.generation = 0
        """Increments each time the buffer is replaced; caches keyed on it go stale."""
        self.buffer_cache: dict[Hashable, Any] = {}
        """Objects built on the current buffer (kernel wrappers); replaced by an empty dict
        whenever the buffer is, so nothing cached here outlives the buffer it was built on."""

    # -- the per-call path -------------------------------------------------

    def workspace(self, rule: str, facts: Mapping[str, object]) -> torch.Tensor:
        """Return the buffer, grown first if ``rule`` resolves larger than it.

        Args:
            rule: The rule's name (``"default"``, ``"lse"``...).
            facts: The call's facts that the rule may read.

        Returns:
            The whole ``uint8`` buffer; ``numel()`` is at least the resolved size.

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
        return self._serve_growing(slot, nbytes)

    def ensure(self, rule: str, facts: Mapping[str, object]) -> torch.Tensor:
        """Grow to what ``rule`` resolves to, without counting a request (for planning ahead).

        Raises:
            The same errors as :meth:`workspace`.
        """
        slot = self._slots.get(rule)
        if slot is None or slot.rule is None:
            raise self._unknown_rule(rule)
        return self.grow_to(slot.rule.resolve(facts, slot.defaults), slot.label, slot.setting)

    def resolve(self, rule: str, facts: Mapping[str, object]) -> int:
        """Return the bytes ``rule`` resolves to for ``facts`` on this pool's device; allocates nothing.

        Facts the call lacks are read from the pool's default facts, then the device's.

        Raises:
            RuleError: The rule is unknown or cannot be resolved.
        """
        slot = self._slots.get(rule)
        if slot is None or slot.rule is None:
            raise self._unknown_rule(rule)
        return slot.rule.resolve(facts, slot.defaults)

    def default_facts(self, rule: str) -> Mapping[str, int]:
        """Return the facts ``rule`` reads where a call gives none: the pool's defaults over the device's.

        Raises:
            RuleError: The rule is unknown.
        """
        slot = self._slots.get(rule)
        if slot is None or slot.rule is None:
            raise self._unknown_rule(rule)
        return MappingProxyType(slot.defaults)

    def request(self, nbytes: int, reason: str = "request") -> torch.Tensor:
        """Return the buffer for an explicit size in bytes, grown first if needed.

        Raises:
            SizeError: ``nbytes`` is not a positive integer (nothing is counted).
            WorkspaceFrozenError: Growth was needed while frozen or capturing.
            WorkspaceLimitError: Growth was needed beyond ``max_bytes``, wspool's size
                limit or the device's memory.
        """
        if type(nbytes) is not int or nbytes <= 0:
            self._check_request_size(nbytes)
        # The serve steps below repeat workspace()'s on purpose: that one is the
        # per-call path, where a shared helper's call measured about a fifth of its cost.
        slot = self._slots.get(reason)
        if slot is None:
            with self._lock:
                slot = self._slots.setdefault(reason, RuleSlot(None, reason, self.spec.setting("rules", "<rule>")))
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

    def _check_request_size(self, nbytes: object) -> None:
        """Refuse a request size that is not a positive integer (``int`` subclasses other than bool pass)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise SizeError(
                f"pool {self.spec.name!r}: a request needs a positive integer number of bytes, got {nbytes!r}"
            )

    def _note_peak(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self._peak:
                self._peak = nbytes

    def _serve_growing(self, slot: RuleSlot, nbytes: int) -> torch.Tensor:
        buffer = self._grow(nbytes, slot.label, slot.setting)
        next(slot.counter)
        if nbytes > self._peak:
            self._note_peak(nbytes)
        return buffer

    # -- growth ------------------------------------------------------------

    def grow_to(self, nbytes: int, reason: str, setting: str | None = None) -> torch.Tensor:
        """Grow to hold at least ``nbytes`` (used by overflow recovery and reserve).

        Args:
            nbytes: The capacity needed.
            reason: Why, for the statistics and the log.
            setting: The key to raise, named in errors (default: the pool's rules).

        Returns:
            The (possibly new) buffer.

        Raises:
            WorkspaceFrozenError: While frozen or capturing.
            WorkspaceLimitError: Beyond ``max_bytes`` or the device's memory.
        """
        return self._grow(nbytes, reason, setting)

    def _grow(self, nbytes: int, reason: str, setting: str | None) -> torch.Tensor:
        """Grow to ``nbytes`` unless it fits; one thread allocates, the others wait for it.

        The lock guards the state only: the allocator runs, and every log line is
        written, with it released, so a handler or an allocator that reads the
        pool's statistics cannot deadlock.
        """
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

    def _refusal_locked(self, nbytes: int, reason: str, setting: str, capturing: bool) -> Refusal | None:
        """Return the error and log line for a refused growth (counted), or ``None`` to grow."""
        refusal = growth_refusal(
            self.spec, self.device, self.lane, nbytes=nbytes, old=self._state[1], reason=reason, setting=setting,
            frozen=self._freeze.frozen, capturing=capturing,
        )  # fmt: skip
        if refusal is not None:
            self._refused += 1
        return refusal

    @staticmethod
    def _report_refusal(error: Exception, message: str, args: tuple[object, ...]) -> NoReturn:
        logger.warning(message, *args)
        raise error

    def _allocate_and_install(self, nbytes: int, capacity: int, old: int, reason: str, setting: str) -> torch.Tensor:
        """Allocate outside the lock (this thread is the pool's one grower), then install under it."""
        spec = self.spec
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
                "wspool: out of memory growing %s on %s lane %s from %d to %d bytes for %s",
                spec.name,
                self.device,
                self.lane,
                old,
                capacity,
                reason,
            )
            raise allocation_failure(
                spec, self.device, self.lane, exc, old=old, capacity=capacity, reason=reason, setting=setting
            ) from exc
        with self._lock:
            refusal = self._refusal_locked(nbytes, reason, setting, False) if self._freeze.frozen else None
            if refusal is None:
                previous = self._state[0]
                if previous is not None and (self._captured or self._buffer_epoch != self._freeze.epoch):
                    self._retired.append(previous)  # a graph may replay into it: keep it until release_retired()
                self.buffer_cache = {}  # before the new state: a reader that sees the new buffer sees the new cache
                self._state = (buffer, capacity)
                self._captured = False
                self._buffer_epoch = self._freeze.epoch
                self._grows += 1
                self.generation += 1
                self._last_reason = f"{reason}: {format_size(nbytes)}"
        if refusal is not None:  # frozen while allocating: the new buffer is dropped
            self._report_refusal(*refusal)
        logger.info(
            "wspool: pool %s on %s lane %s grew %s -> %s for %s (requested %d bytes)",
            spec.name,
            self.device,
            self.lane,
            format_size(old),
            format_size(capacity),
            reason,
            nbytes,
        )
        return buffer

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
            by_rule = {name: slot.count for name, slot in self._slots.items() if slot.count}
            return PoolStats(
                pool=self.spec.name,
                device=str(self.device),
                lane=self.lane,
                capacity_bytes=self._state[1],
                peak_request_bytes=self._peak,
                request_count=sum(by_rule.values()),
                grow_count=self._grows,
                last_grow_reason=self._last_reason,
                refused_count=self._refused,
                retired_bytes=sum(t.numel() for t in self._retired),
                requests_by_rule=MappingProxyType(by_rule),
            )

    def release_retired(self) -> int:
        """Drop retired buffers; call once no captured graph can replay them.

        Returns:
            The number of bytes released to PyTorch's allocator.
        """
        with self._lock:
            released = sum(t.numel() for t in self._retired)
            self._retired.clear()
            return released

    def _unknown_rule(self, rule: str) -> Exception:
        return unknown_rule(self.spec, rule, (n for n, s in self._slots.items() if s.rule is not None))

    def __repr__(self) -> str:
        return (
            f"WorkspacePool({self.spec.name!r}, device={self.device}, lane={self.lane!r}, "
            f"capacity={format_size(self._state[1])})"
        )
