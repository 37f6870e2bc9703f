"""Finding the smallest workspace a kernel accepts, by probing sizes.

A failure's overflow message (``... with size S ... but only N bytes available``)
bounds the need of a probe of ``n`` bytes below by ``n - N + S``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from wspool.errors import WspoolError
from wspool.units import MiB, TiB, format_size, round_up

__all__ = ["CalibrationError", "Probe", "SearchResult", "search_min_bytes"]

#: Probe a size: ``None`` when the kernel accepts it, else a lower bound on the
#: size it needs (from its overflow message; 0 when the failure says nothing).
Probe = Callable[[int], "int | None"]


class CalibrationError(WspoolError):
    """Calibration cannot run here, or a measurement failed."""


@dataclass(frozen=True)
class SearchResult:
    """The smallest accepted size and every probe that led to it."""

    min_bytes: int
    probes: tuple[tuple[int, bool], ...]

    @property
    def probe_count(self) -> int:
        """How many sizes were tried."""
        return len(self.probes)


def search_min_bytes(
    probe: Probe, *, start_bytes: int = 64 * MiB, limit_bytes: int = TiB, granularity: int = 1
) -> SearchResult:
    """Find the smallest size ``probe`` accepts (monotone in the size), to within ``granularity`` bytes.

    A bisection that jumps to the size a failure names; ``start_bytes`` doubles
    until accepted. ``CalibrationError`` when nothing up to ``limit_bytes`` is.
    """
    if granularity < 1:
        raise ValueError(f"granularity must be a positive number of bytes, got {granularity}")
    tried: list[tuple[int, bool]] = []

    def attempt(nbytes: int) -> int | None:
        need = probe(nbytes)
        tried.append((nbytes, need is None))
        return need

    lo, hi = 0, round_up(max(start_bytes, granularity), granularity)
    hint = granularity  # the next size worth trying (0: none); the smallest first, for its message
    while (need := attempt(hi)) is not None:
        if hi >= limit_bytes:
            raise CalibrationError(f"the kernel still overflows a {hi}-byte ({format_size(hi)}) workspace")
        hint = round_up(need, granularity) if need > hi else 0
        lo, hi = hi, min(max(2 * hi, hint), round_up(limit_bytes, granularity))
    edge = False  # whether ``hint`` checks just below a size a message named
    while hi - lo > granularity:
        if hint >= hi and not edge:
            hint, edge = hi - granularity, True  # a message named hi (or more): check just below it
        from_hint = lo < hint < hi
        nbytes = hint if from_hint else round_up(lo + (hi - lo) // 2, granularity)
        checked_edge = from_hint and edge
        hint, edge = 0, False
        need = attempt(nbytes)
        if need is None:
            hi = nbytes
            if from_hint and not checked_edge:
                hint, edge = nbytes - granularity, True  # a message's bound is usually exact: check below it
        else:
            lo = nbytes
            if need > nbytes:
                hint = round_up(need, granularity)
    return SearchResult(hi, tuple(tried))
