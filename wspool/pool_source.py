"""The view of a registry that the modules below it need: :class:`PoolSource`.

Accounting, the cross-rank agreement and the kernel-buffer tracking read a
registry's pools and settings; they take this protocol instead of importing
:mod:`wspool.registry`, so imports only go down (the registry calls them, they
never import it). :class:`~wspool.registry.PoolRegistry` satisfies it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from wspool.devices import DeviceLike
    from wspool.pool import PoolSpec, WorkspacePool
    from wspool.settings.config import WspoolSettings

__all__ = ["PoolSource"]


class PoolSource(Protocol):
    """What accounting, agreement and kernel-buffer tracking read from a registry.

    Thread semantics: those of the implementation (the registry's methods are thread-safe).
    """

    settings: WspoolSettings
    op_state: dict[str, Any]

    @property
    def is_frozen(self) -> bool:
        """Whether growth is refused."""
        ...

    def resolve(self, pool: str, rule: str = "default", *, device: DeviceLike = None, **facts: object) -> int:
        """Return the bytes a call on ``device`` would get from ``rule``; allocates nothing."""
        ...

    def spec(self, pool: str, device: DeviceLike = None) -> PoolSpec:
        """Return a pool's configuration under ``device``'s profile."""
        ...

    def pool(self, name: str, device: DeviceLike = None, *, lane: str | None = None) -> WorkspacePool:
        """Return (creating, without allocating) the pool for ``name`` on ``device`` and ``lane``."""
        ...

    def pools(self) -> Iterator[WorkspacePool]:
        """Iterate over every pool instance created so far."""
        ...
