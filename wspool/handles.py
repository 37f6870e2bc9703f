"""Bound handles: a call site's binding of one pool rule, returning the buffer with no lookup.

A :class:`WorkspaceHandle` is what an engine getter holds instead of calling
:meth:`~wspool.PoolRegistry.workspace` per call: the pool, device, lane and
rule are bound once; the size is resolved once where the rule reads no fact
the call passes (decided once, at binding); and the buffer is returned as
held while the process's workspace epoch is unchanged. The epoch moves when
any pool replaces its buffer and when a registry is reset, reconfigured or
replaced; the next call then binds again through the full path, which keeps
every check (unknown rules, growth refused while frozen or capturing, limits).

Capture semantics: a steady-state call still asks the pool's capture probe
(on CUDA), so a buffer a graph captured is retired, not freed, when the pool
grows. Thread semantics: thread-safe; two threads binding at once both bind
correctly. Device and lane are fixed per handle: a call site that changes
lanes holds a handle per lane.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from wspool.pool import WorkspacePool

__all__ = ["EPOCH", "HitCount", "WorkspaceHandle", "bump_epoch"]

#: The process's workspace epoch, in a one-item list every handle reads per call: a call site may
#: cache what it derived from handles while ``EPOCH[0]`` is unchanged. Read it; only
#: :func:`bump_epoch` writes it.
EPOCH = [0]
_EPOCH = EPOCH
_epoch_lock = threading.Lock()
_UNSTEADY: tuple[int, None, None, int, None] = (-1, None, None, 0, None)


class HitCount:
    """The steady-state calls one handle made on one pool: a cell the pool owns and counts in its statistics.

    A pool hands a handle a fresh cell each time the handle binds to it; the handle adds
    one per steady-state call. A handle that dies or binds elsewhere leaves the cell, and
    its count, with the pool that served those calls. Written without a lock by the
    handle's call sites (a count may miss a call two threads make at the same instant).
    """

    __slots__ = ("count", "handle", "rule")

    def __init__(self, rule: str, handle: WorkspaceHandle) -> None:
        self.count = 0
        self.rule = rule
        self.handle = weakref.ref(handle)  # dead: no call can add to the count any more


def bump_epoch() -> None:
    """Invalidate every :class:`WorkspaceHandle` (each binds again at its next call).

    Pools call it when they replace a buffer; registries when they are reset,
    reconfigured or replaced.
    """
    with _epoch_lock:
        _EPOCH[0] += 1


def _view(pool: WorkspacePool, buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return the one ``dtype`` view of ``buffer`` that every handle of the pool shares while it is current."""
    key = ("view", dtype)
    found = pool.buffer_cache.get(key)
    if found is None or found.data_ptr() != buffer.data_ptr() or found.numel() != buffer.numel():
        found = buffer.view(dtype)
        if pool.buffer is buffer:  # the cache belongs to the buffer installed now
            pool.buffer_cache[key] = found
    return found


class WorkspaceHandle:
    """One pool rule bound on one device and lane; create through :meth:`wspool.PoolRegistry.handle`.

    Its steady-state calls count as requests of the rule in the statistics of
    the pool that served them, in a :class:`HitCount` that pool owns: the counts
    stay when the handle dies or binds elsewhere (a count may miss a call two
    threads make at the same instant).

    Args:
        bind: Returns the pool instance that serves the rule now (the registry's).
        rule: The pool's rule that sizes every call.
        call_facts: The facts the call site may pass to :meth:`sized`; a rule
            that reads none of them is resolved once per binding.
        dtype: The dtype of the view returned (``None``: the pool's ``uint8``).
        facts: Facts bound to the handle (fixed for its call site, e.g. a size the
            engine passes every call), which the rule reads where a call gives none.
    """

    __slots__ = (
        "__weakref__",
        "_bind",
        "_bound",
        "_bound_facts",
        "_buffer",
        "_call_facts",
        "_capturing",
        "_cell",
        "_dtype",
        "_last_facts",
        "_pool",
        "_probe",
        "_raw",
        "_raw_stream",
        "_stream_index",
        "_valid",
        "_valid_facts",
        "reads_call_facts",
        "rule",
        "steady",
    )

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
        # The epoch the held buffer is valid in for calls without facts / with _last_facts (-1: none).
        self._valid = -1
        self._valid_facts = -1
        self._bound = -1  # the epoch of the binding
        self._buffer: torch.Tensor | None = None
        self._raw: torch.Tensor | None = None
        self._pool: WorkspacePool | None = None
        self._probe: Callable[[], bool] | None = None
        # The CUDA probe's parts, called inline per call (None: no probe, or one of another kind).
        self._raw_stream: Callable[[int], int] | None = None
        self._stream_index = 0
        self._capturing: Callable[[], bool] = bool
        self._last_facts: object = None
        self._cell: HitCount | None = None  # the count, owned by the pool bound now, of this handle's calls there
        #: Whether the rule reads any fact the call site passes (decided at binding).
        self.reads_call_facts = False
        #: ``(epoch, buffer, raw_stream, stream_index, hits)``: the steady state of :meth:`get` for a
        #: call site that writes it out. While ``epoch == EPOCH[0]`` and ``raw_stream`` is ``None`` or
        #: ``raw_stream(stream_index) == 0`` (CUDA's legacy default stream, which cannot capture),
        #: ``buffer`` is what :meth:`get` returns, and the call site adds one to ``hits.count`` (a
        #: :class:`HitCount` of the pool serving it); otherwise it calls :meth:`get`.
        self.steady: tuple[int, torch.Tensor | None, Callable[[int], int] | None, int, HitCount | None] = _UNSTEADY
        self._rebind()

    def get(self) -> torch.Tensor:
        """Return the buffer for a call that passes no facts (the rule's size with its default facts).

        Raises:
            RuleError: The rule reads a fact no default supplies.
            WorkspaceFrozenError: Growth was needed while frozen or capturing.
            WorkspaceLimitError: Growth was needed beyond ``max_bytes`` or memory.
        """
        # The steady state is written out in get(), fetch() and sized() alike: a shared helper's
        # call would cost about what the whole check costs.
        buffer = self._buffer  # read first: a pool that replaces it clears it after moving the epoch
        if self._valid == _EPOCH[0] and buffer is not None:
            raw_stream = self._raw_stream
            if raw_stream is not None:
                if raw_stream(self._stream_index) != 0 and self._capturing():
                    self._pool.note_captured()  # type: ignore[union-attr]
            elif self._probe is not None and self._probe():
                self._pool.note_captured()  # type: ignore[union-attr]
            self._cell.count += 1  # type: ignore[union-attr]
            return buffer
        return self._serve(self._bound_facts, plain=True)

    __call__ = get

    def fetch(self, facts_of: Callable[[], Mapping[str, object]]) -> torch.Tensor:
        """Return the buffer, asking ``facts_of()`` for the call's facts only where the rule reads them.

        For an engine getter that knows its facts only at some call sites; in
        the steady state of a rule that reads none, this is :meth:`__call__`.

        Raises:
            The errors of :meth:`sized`.
        """
        buffer = self._buffer  # read first: a pool that replaces it clears it after moving the epoch
        if self._valid == _EPOCH[0] and buffer is not None:
            raw_stream = self._raw_stream
            if raw_stream is not None:
                if raw_stream(self._stream_index) != 0 and self._capturing():
                    self._pool.note_captured()  # type: ignore[union-attr]
            elif self._probe is not None and self._probe():
                self._pool.note_captured()  # type: ignore[union-attr]
            self._cell.count += 1  # type: ignore[union-attr]
            return buffer
        if self.current_reads_call_facts():
            return self.sized(facts_of())
        return self._serve(self._bound_facts, plain=True)

    def sized(self, facts: Mapping[str, object]) -> torch.Tensor:
        """Return the buffer for a call with ``facts`` (pass the same mapping for a step's calls).

        Where the rule reads none of the call's facts this is :meth:`__call__`;
        otherwise a call with the very mapping of the previous call reuses its
        size, and any other resolves the rule once.

        Raises:
            The errors of :meth:`__call__`, and ``RuleError`` for facts the rule cannot use.
        """
        buffer = self._buffer
        if facts is self._last_facts and self._valid_facts == _EPOCH[0] and buffer is not None:
            raw_stream = self._raw_stream
            if raw_stream is not None:
                if raw_stream(self._stream_index) != 0 and self._capturing():
                    self._pool.note_captured()  # type: ignore[union-attr]
            elif self._probe is not None and self._probe():
                self._pool.note_captured()  # type: ignore[union-attr]
            self._cell.count += 1  # type: ignore[union-attr]
            return buffer
        if not self.current_reads_call_facts():
            return self.get()
        buffer = self._serve(facts, plain=False)
        self._last_facts = facts
        return buffer

    def forget_buffer(self) -> None:
        """Let go of the buffer held (its pool replaced or dropped it, and moved the epoch): the next call serves."""
        self._valid = self._valid_facts = -1
        self.steady = _UNSTEADY
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
        self._valid = self._valid_facts = -1
        self.steady = _UNSTEADY
        # Held only if nothing moved the epoch meanwhile (this call's own growth did: serve again next time).
        if _EPOCH[0] == epoch and not pool.watches_streams:
            if plain and not self.reads_call_facts:
                self._valid = epoch
                if self._probe is None or self._raw_stream is not None:
                    self.steady = (epoch, view, self._raw_stream, self._stream_index, self._cell)
            elif not plain:
                self._valid_facts = epoch
        return view

    def _rebind(self) -> None:
        epoch = _EPOCH[0]
        old = self._pool
        pool = self._bind()
        if pool is not old:
            # Counts made on the old pool stay in its cell; this handle counts in a new cell of the new one.
            if old is not None:
                old.detach(self)
            self._cell = pool.attach(self)
        compiled = pool.spec.rules.get(self.rule)
        self._probe = pool.capture_probe
        parts = getattr(self._probe, "cuda_parts", None)
        self._raw_stream, self._stream_index, self._capturing = parts if parts is not None else (None, 0, bool)
        unbound = self._call_facts.difference(self._bound_facts)
        self.reads_call_facts = compiled is not None and bool(unbound.intersection(compiled.names))
        self._pool = pool
        self._valid = self._valid_facts = -1
        self.steady = _UNSTEADY
        self._bound = epoch

    @property
    def pool(self) -> WorkspacePool:
        """The pool instance bound now."""
        assert self._pool is not None
        return self._pool

    def __repr__(self) -> str:
        return f"WorkspaceHandle({self.pool.spec.name!r}, rule={self.rule!r}, device={self.pool.device})"
