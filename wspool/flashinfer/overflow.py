"""Recognising FlashInfer's workspace overflow and computing the capacity that was needed.

FlashInfer's ``AlignedAllocator`` fails with a stable message::

    Buffer overflow when allocating memory for <name> with size <S> and
    alignment <A>, but only <N> bytes available in AlignedAllocator.
    Increase the workspace buffer size.

From it and the capacity the kernel was given, the capacity that would have
served that allocation is ``capacity - N + S`` plus up to ``A`` bytes of
alignment padding. Later carves of the same call may still need more, so the
caller retries once and then reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["WorkspaceOverflow", "parse_overflow"]

_OVERFLOW_RE = re.compile(
    r"Buffer overflow when allocating memory for (?P<name>\S+) with size (?P<size>\d+) "
    r"and alignment (?P<alignment>\d+), but only (?P<available>\d+) bytes available"
)


@dataclass(frozen=True)
class WorkspaceOverflow:
    """One failed carve of a FlashInfer workspace.

    Attributes:
        name: The carve's name, e.g. ``"trtllm_gen_softmax_workspace"``.
        size_bytes: Bytes the carve asked for.
        alignment: Its alignment in bytes.
        available_bytes: Bytes that were left in the workspace.
    """

    name: str
    size_bytes: int
    alignment: int
    available_bytes: int

    def needed_capacity(self, capacity_bytes: int) -> int:
        """Return the workspace size that would have served this carve.

        Args:
            capacity_bytes: The size of the workspace the kernel was given.
        """
        used = max(capacity_bytes - self.available_bytes, 0)
        return used + self.size_bytes + self.alignment


def parse_overflow(error: BaseException | str) -> WorkspaceOverflow | None:
    """Return the overflow described by ``error``, or ``None`` if it is another error."""
    match = _OVERFLOW_RE.search(str(error))
    if match is None:
        return None
    return WorkspaceOverflow(
        name=match["name"],
        size_bytes=int(match["size"]),
        alignment=int(match["alignment"]),
        available_bytes=int(match["available"]),
    )
