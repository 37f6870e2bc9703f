"""Why a pool may not grow, and what went wrong when it could not: the errors and their log lines.

Built here, raised by :class:`~wspool.pool.WorkspacePool`: each error names
the pool, device, lane, the bytes needed and the setting to change. Nothing
here allocates, locks or logs; the pool logs the returned line after
releasing its lock. Pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from wspool.errors import RuleError, WorkspaceFrozenError, WorkspaceLimitError
from wspool.pool_spec import PoolSpec
from wspool.units import MAX_SIZE_BYTES, format_size

__all__ = ["Refusal", "allocation_failure", "growth_refusal", "unknown_rule"]

#: A refused growth: the error to raise, and the log line (format and arguments) to write first.
Refusal = tuple[Exception, str, tuple[object, ...]]


def growth_refusal(
    spec: PoolSpec,
    device: torch.device,
    lane: str,
    *,
    nbytes: int,
    old: int,
    reason: str,
    setting: str,
    frozen: bool,
    capturing: bool,
) -> Refusal | None:
    """Return the error and log line for a growth to ``nbytes`` that must be refused, or ``None`` to grow.

    Refused: above ``max_bytes`` or wspool's size limit, or while ``frozen`` or ``capturing``.
    """
    limit = spec.max_bytes
    if (limit is not None and nbytes > limit) or nbytes > MAX_SIZE_BYTES:
        shown = limit if limit is not None and nbytes > limit else MAX_SIZE_BYTES
        what = "max_bytes" if shown == limit else "wspool's size limit"
        hint = f"raise {spec.setting('max_bytes')}" if shown == limit else f"lower {setting}"
        return (
            WorkspaceLimitError(
                f"pool {spec.name!r} on {device} (lane {lane}) needs {nbytes} bytes "
                f"({format_size(nbytes)}) for {reason}, above {what} = {shown} bytes "
                f"({format_size(shown)}); {hint}"
            ),
            "wspool: refused %s on %s lane %s: %s (%s) needs %d bytes, above %s %d",
            (spec.name, device, lane, reason, format_size(nbytes), nbytes, what, shown),
        )
    if frozen or capturing:
        why = "during CUDA-graph capture" if capturing else "while the registry is frozen"
        return (
            WorkspaceFrozenError(
                f"pool {spec.name!r} on {device} (lane {lane}) would have to grow {why}: "
                f"{reason} needs {nbytes} bytes ({format_size(nbytes)}), {old} bytes available. "
                f"Reserve or warm up that size before capturing/freezing, or raise {setting}"
            ),
            "wspool: refused growth of %s on %s lane %s %s: %s needs %d bytes, %d available",
            (spec.name, device, lane, why, reason, nbytes, old),
        )
    return None


def allocation_failure(
    spec: PoolSpec,
    device: torch.device,
    lane: str,
    exc: BaseException,
    *,
    old: int,
    capacity: int,
    reason: str,
    setting: str,
) -> WorkspaceLimitError:
    """The error for an allocator that failed to grow the buffer from ``old`` to ``capacity`` bytes."""
    if isinstance(exc, torch.OutOfMemoryError):
        cause = "the device is out of memory"
    else:
        first = (str(exc).splitlines() or [""])[0][:120]
        cause = f"the allocation failed ({type(exc).__name__}: {first})"
    return WorkspaceLimitError(
        f"pool {spec.name!r} on {device} (lane {lane}) could not grow from {old} to "
        f"{capacity} bytes ({format_size(capacity)}) for {reason}: {cause}; "
        f"the pool keeps its {format_size(old) if old else 'empty'} buffer. "
        f"Lower {setting} or free device memory"
    )


def unknown_rule(spec: PoolSpec, rule: str, known: Iterable[str]) -> RuleError:
    """The error for a rule the pool does not have, naming its rules and the setting to add."""
    listed = ", ".join(sorted(known)) or "none"
    return RuleError(
        f"pool {spec.name!r} has no rule {rule!r} (rules: {listed}); set {spec.setting('rules', rule)}",
        path=("pools", spec.name, "rules", rule),
    )
