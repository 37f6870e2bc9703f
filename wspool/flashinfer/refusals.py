"""Every way a supported FlashInfer refuses a workspace that is too small, one parser over them, and recovery.

Recovery grows the pool past what the failed carve needed and retries, within
``max_bytes``; anything else is re-raised unchanged. Threads: the pool's.
Recovery grows, so it is refused while frozen or capturing. The forms and
their provenance: docs/flashinfer-versions.md.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Container
from dataclasses import dataclass

import torch

from wspool.errors import WorkspaceOverflowError
from wspool.flashinfer.backends import READ_VERSIONS
from wspool.pool import WorkspacePool
from wspool.units import MAX_SIZE_BYTES, MiB, format_size, round_up

__all__ = ["MAX_RECOVERIES", "REFUSAL_FORMS", "RefusalForm", "WorkspaceRefusal", "grow_after_overflow", "parse_refusal"]


@dataclass(frozen=True)
class RefusalForm:
    """One way FlashInfer refuses a small workspace; ``sized`` is ``"carve"``, ``"total"`` or ``"none"``."""

    name: str
    versions: tuple[str, ...]
    wrappers: tuple[str, ...]
    exception: str
    sized: str
    pattern: re.Pattern[str]
    example: str


#: The refusal texts of every supported FlashInfer version, for every call wspool makes.
REFUSAL_FORMS: tuple[RefusalForm, ...] = (
    RefusalForm(
        name="aligned-allocator",
        versions=READ_VERSIONS,
        wrappers=(
            "BatchMLAPagedAttentionWrapper.plan (fa2/fa3; on 0.7.4 only past its Python preflight)",
            "trtllm_batch_decode_with_kv_cache_mla (trtllm-gen: trtllm_gen_softmax_workspace)",
            "BatchDecodeWithPagedKVCacheWrapper.plan",
            "BatchPrefillWithPagedKVCacheWrapper.plan",
        ),
        exception="RuntimeError",
        sized="carve",
        pattern=re.compile(
            r"Buffer overflow when allocating memory for (?P<name>\S+) with size (?P<size>\d+) "
            r"and alignment (?P<alignment>\d+), but only (?P<available>\d+) bytes available"
        ),
        example=(  # 0.7.2.post1's fa3 plan on an 8 MiB buffer, captured on the H200 test machine
            "Buffer overflow when allocating memory for mla_partial_o with size 17301504 and alignment 16, "
            "but only 8388608 bytes available in AlignedAllocator. Increase the workspace buffer size."
        ),
    ),
    RefusalForm(
        name="fa-preflight",
        versions=("0.7.4",),
        wrappers=("BatchMLAPagedAttentionWrapper.plan (fa2/fa3, alone or inside backend='auto''s list)",),
        exception="ValueError (_BackendPlanUnsupportedError)",
        sized="total",
        pattern=re.compile(r"(?P<name>fa[23]) MLA needs (?P<size>\d+) float workspace bytes for partial outputs"),
        example="fa3 MLA needs 17369088 float workspace bytes for partial outputs and LSE.",  # captured on the H200
    ),
    RefusalForm(
        name="cute-dsl-planned",
        versions=READ_VERSIONS,
        wrappers=("BatchMLAPagedAttentionWrapper.plan (cute-dsl)",),
        exception="ValueError (_BackendPlanUnsupportedError)",
        sized="total",
        pattern=re.compile(
            r"workspace_buffer too small for (?P<name>cute-dsl) backend: have (?P<available>\d+) bytes, "
            r"need (?P<size>\d+) bytes"
        ),
        example="workspace_buffer too small for cute-dsl backend: have 1048576 bytes, need 16809984 bytes.",  # source
    ),
    RefusalForm(
        name="cute-dsl-functional",
        versions=READ_VERSIONS,
        wrappers=("trtllm_batch_decode_with_kv_cache_mla (backend='cute-dsl')",),
        exception="ValueError",
        sized="total",
        pattern=re.compile(r"(?P<name>workspace_buffer) too small: (?P<available>\d+) bytes, need (?P<size>\d+) bytes"),
        example="workspace_buffer too small: 1048576 bytes, need 16809984 bytes",  # from the source
    ),
    RefusalForm(
        name="cute-dsl-split-tactic",
        versions=("0.7.4",),
        wrappers=("trtllm_batch_decode_with_kv_cache_mla (backend='cute-dsl', an explicit split tactic)",),
        exception="ValueError (_BackendPlanUnsupportedError)",
        sized="none",
        pattern=re.compile(r"(?P<name>workspace_buffer) too small for the requested split tactic"),
        example="workspace_buffer too small for the requested split tactic",  # from the source
    ),
)


@dataclass(frozen=True)
class WorkspaceRefusal:
    """One refusal of a FlashInfer workspace: the failed carve, or the backend that refused, and its bytes."""

    form: str
    name: str
    size_bytes: int
    alignment: int = 0
    available_bytes: int | None = None

    @property
    def sized(self) -> bool:
        """Whether the text names a size to grow to."""
        return self.size_bytes > 0

    def needed_capacity(self, capacity_bytes: int, *, padding: bool = True) -> int:
        """Return the workspace size that would have served this refusal (``0``: the text names none).

        ``padding=False`` leaves out the carve's alignment: the lower bound a size search starts from.
        """
        if self.form != "aligned-allocator":
            return self.size_bytes
        used = max(capacity_bytes - (self.available_bytes or 0), 0)
        return used + self.size_bytes + (self.alignment if padding else 0)


def parse_refusal(error: BaseException | str, path: str | None = None) -> WorkspaceRefusal | None:
    """Return the workspace refusal ``error`` (or its text) describes, or ``None`` for another error.

    A number above :data:`~wspool.units.MAX_SIZE_BYTES` makes it another error. A
    text listing several backends' needs is read for ``path``, else the largest.
    """
    text = str(error)
    for form in REFUSAL_FORMS:
        matches = list(form.pattern.finditer(text))
        if not matches:
            continue
        refusals = []
        for match in matches:
            refusal = _read_refusal(form.name, match)
            if refusal is None:
                return None  # an absurd number: nothing in this text is a size to grow to
            refusals.append(refusal)
        chosen = [r for r in refusals if path is not None and r.name == path] or refusals
        return max(chosen, key=lambda r: r.size_bytes)
    return None


#: The most digits a byte count a refusal names can have (MAX_SIZE_BYTES's); longer ones are never converted.
_MAX_DIGITS = len(str(MAX_SIZE_BYTES))


def _read_refusal(form: str, match: re.Match[str]) -> WorkspaceRefusal | None:
    """Return the refusal one match names, or ``None`` when a number in it is beyond any device's memory."""
    numbers: dict[str, int | None] = {}
    for group in ("size", "alignment", "available"):
        digits = match.groupdict().get(group)
        if digits is None:
            numbers[group] = None
            continue
        significant = digits.lstrip("0") or "0"
        value = int(significant) if len(significant) <= _MAX_DIGITS else MAX_SIZE_BYTES + 1
        if value > MAX_SIZE_BYTES:
            return None
        numbers[group] = value
    return WorkspaceRefusal(
        form=form,
        name=match["name"],
        size_bytes=numbers["size"] or 0,
        alignment=numbers["alignment"] or 0,
        available_bytes=numbers["available"],
    )


logger = logging.getLogger(__name__)

#: Growths tried for one call before an overflow is reported (each grows past the last need).
MAX_RECOVERIES = 3


def grow_after_overflow(
    exc: Exception,
    *,
    pool: WorkspacePool,
    capacity: int,
    attempt: int,
    op: str,
    rule: str,
    setting: str,
    float_carves: Container[str] | None = None,
    path: str | None = None,
    int_setting: str | None = None,
) -> torch.Tensor:
    """Grow ``pool`` past what the overflow in ``exc`` needed and return the buffer; re-raise anything else.

    Args:
        attempt: Growths this call already made (0 first).
        float_carves: The carves in the pool's buffer (``None``: all); others are re-raised.
        int_setting: The key of the rule that sized a wspool int region, named
            when an int carve overflows it (the pool does not grow).

    Raises:
        WorkspaceOverflowError: An int carve overflowed, or still after :data:`MAX_RECOVERIES` growths.
        WorkspaceFrozenError: Growth is refused (frozen or capturing).
        WorkspaceLimitError: Growth would pass ``max_bytes`` or the device's memory.
    """
    overflow = parse_refusal(exc, path)
    if overflow is None or not overflow.sized:
        raise exc
    if float_carves is not None and overflow.form == "aligned-allocator" and overflow.name not in float_carves:
        if int_setting is None:
            raise exc
        raise WorkspaceOverflowError(
            f"FlashInfer {op} overflowed its int workspace (a region of pool flashinfer_int): {overflow.name} "
            f"needs {overflow.size_bytes} bytes with {overflow.available_bytes} left; raise {int_setting}"
        ) from exc
    needed = overflow.needed_capacity(capacity)
    # A carve names what was left; a whole-need refusal had the entire buffer to work with.
    available = overflow.available_bytes if overflow.form == "aligned-allocator" else capacity
    name, device = pool.spec.name, pool.device
    if attempt >= MAX_RECOVERIES:
        raise WorkspaceOverflowError(
            f"FlashInfer {op} still overflowed pool {name!r} on {device} after {attempt} growth(s): "
            f"{overflow.name} needs {overflow.size_bytes} bytes with {available} of "
            f"{capacity} available; raise {setting}"
        ) from exc
    # Headroom for the carves after the one that failed, so one retry normally suffices;
    # never past max_bytes when the need itself fits under it.
    target = round_up(needed + max(needed // 8, MiB), MiB)
    limit = pool.spec.max_bytes
    if limit is not None and needed <= limit < target:
        target = limit
    if attempt == 0:
        _warn_growth(
            op, pool, rule, setting, overflow, available=available, capacity=capacity, target=target, needed=needed
        )
    return pool.grow_to(target, f"overflow recovery ({overflow.name})", setting)


def _warn_growth(
    op: str,
    pool: WorkspacePool,
    rule: str,
    setting: str,
    overflow: WorkspaceRefusal,
    *,
    available: int | None,
    capacity: int,
    target: int,
    needed: int,
) -> None:
    """Say once per call, before growing, what overflowed and which setting to raise."""
    logger.warning(
        "wspool: FlashInfer %s overflowed pool %s on %s (rule %s): %s needed %d bytes, %d available of %s; "
        "growing to %s and retrying. Raise %s to at least %s to avoid this",
        op,
        pool.spec.name,
        pool.device,
        rule,
        overflow.name,
        overflow.size_bytes,
        available,
        format_size(capacity),
        format_size(target),
        setting,
        format_size(needed),
    )
