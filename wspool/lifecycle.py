"""A registry's operations around an engine's steps: reserve and warm up, freeze, release, report.

:class:`RegistryLifecycle` is the base of :class:`wspool.registry.PoolRegistry`:
the cold operations an engine calls before capture (reserve, warm up, freeze),
after its graphs are gone (release) and to look (statistics, memory), all
built on the registry's public :meth:`pool` and :meth:`pools`. Thread
semantics: thread-safe, as the registry is. Device semantics: those of
:meth:`pool`. Capture semantics: reserve and warm up grow pools, so they run
before capture; freezing refuses all growth.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from wspool.freeze import FreezeState
from wspool.pool import PoolStats, WorkspacePool
from wspool.pool_source import PoolSource

if TYPE_CHECKING:
    from wspool.devices import DeviceLike

__all__ = ["RegistryLifecycle"]

_Registry = TypeVar("_Registry", bound="RegistryLifecycle")


class RegistryLifecycle:
    """Reserve, warm up, freeze, release and report, over a registry's pools.

    Attributes:
        freeze_state: Whether growth is refused, shared by every pool of the registry.
    """

    freeze_state: FreezeState

    if TYPE_CHECKING:

        def pool(self, name: str, device: DeviceLike = None, *, lane: str | None = None) -> WorkspacePool:
            """Return (creating, without allocating) the pool for ``name`` on ``device`` and ``lane``."""
            ...

        def pools(self) -> Iterator[WorkspacePool]:
            """Iterate over every pool instance created so far."""
            ...

    def stats(self, pool: str, device: DeviceLike = None, *, lane: str | None = None) -> PoolStats:
        """Return the statistics of one pool on one device and lane (zeros if never used)."""
        return self.pool(pool, device, lane=lane).stats()

    def all_stats(self) -> list[PoolStats]:
        """Return the statistics of every pool instance, sorted by pool, device and lane."""
        return sorted((p.stats() for p in self.pools()), key=lambda s: (s.pool, s.device, s.lane))

    def memory_stats(self) -> dict[str, Any]:
        """Return what every buffer holds, per backend, with PyTorch's figures on CUDA (JSON-able).

        See :func:`wspool.accounting.memory_stats`; reading it has no side effects.
        """
        from wspool.accounting import memory_stats

        return memory_stats(self._source())

    def memory_summary(self) -> str:
        """Return a table: pool, device, lane, capacity, peak request, grows, backends; then totals per device."""
        from wspool.accounting import memory_summary

        return memory_summary(self._source())

    # -- reserve, warm up, freeze --------------------------------------------

    def reserve(
        self,
        pool: str,
        device: DeviceLike = None,
        *,
        nbytes: int | str | None = None,
        rule: str | None = None,
        lane: str | None = None,
        **facts: object,
    ) -> torch.Tensor:
        """Grow a pool ahead of time to ``nbytes`` or to what ``rule`` resolves to.

        Raises:
            ValueError: Neither or both of ``nbytes`` and ``rule`` are given.
        """
        if (nbytes is None) == (rule is None):
            raise ValueError("reserve() takes exactly one of nbytes= or rule=")
        target = self.pool(pool, device, lane=lane)
        if rule is not None:
            return target.workspace(rule, facts)
        from wspool.units import parse_size

        return target.request(parse_size(nbytes), "reserve")

    def warmup(
        self,
        pool: str,
        facts_list: Iterable[Mapping[str, object]],
        device: DeviceLike = None,
        *,
        rule: str = "default",
        lane: str | None = None,
        agree_group: Any = None,
    ) -> int:
        """Resolve ``rule`` over every shape an engine will capture; grow once, to the largest.

        Args:
            agree_group: A ``torch.distributed`` process group, e.g.
                ``torch.distributed.group.WORLD``. Given, the largest size is
                agreed with :func:`wspool.distributed.agree` (a collective: every
                rank of the group calls ``warmup`` for the same pools in the same
                order), so every rank grows once, to the maximum over the ranks,
                and a rank that cannot grow raises on every rank. ``None``: local only.

        Returns:
            The pool's capacity afterwards, in bytes.
        """
        target = self.pool(pool, device, lane=lane)
        largest = max((target.resolve(rule, facts) for facts in facts_list), default=0)
        if agree_group is not None:
            from wspool.distributed import agree

            agree(self._source(), agree_group, device=target.device, reserve={(pool, target.lane): largest})
        if largest:
            target.request(largest, f"warmup of rule {rule}")
        return target.capacity_bytes

    def freeze(self) -> None:
        """Refuse all growth from now on (requests that fit are still served)."""
        self.freeze_state.frozen = True

    def unfreeze(self) -> None:
        """Undo :meth:`freeze`; growth stays refused while a :meth:`frozen` block is open."""
        self.freeze_state.frozen = False

    @property
    def is_frozen(self) -> bool:
        """Whether growth is refused."""
        return self.freeze_state.frozen

    @contextmanager
    def frozen(self: _Registry) -> Iterator[_Registry]:
        """Refuse growth inside the block.

        Blocks are counted: with blocks open in several threads at once, the
        registry stays frozen until the last one closes, and then is frozen
        exactly when :meth:`freeze` was called without :meth:`unfreeze`.
        """
        token = self.freeze_state.enter()
        try:
            yield self
        finally:
            self.freeze_state.leave(token)

    def release_retired(self) -> int:
        """Free buffers kept for captured graphs; call once those graphs are gone.

        Returns:
            Bytes released across all pools.
        """
        return sum(p.release_retired() for p in self.pools())

    def _source(self) -> PoolSource:
        """This registry, as the modules below it read one."""
        source: PoolSource = self  # type: ignore[assignment]  # the registry completes the protocol
        return source
