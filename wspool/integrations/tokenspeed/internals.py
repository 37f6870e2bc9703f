"""TokenSpeed's private names that the integration reads or sets, each through one accessor that names its source.

TokenSpeed offers no public way to reach these; each accessor says which
release its name was read from, and ``tests/integrations/test_tokenspeed.py``
fails with the accessor's name when TokenSpeed lacks it. Nothing here imports
TokenSpeed at import time; the accessors import its modules when called.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ACCESSORS",
    "READ_FROM",
    "dsa_workspace_bytes",
    "flashmla_module",
    "flashmla_workspace",
    "set_flashmla_workspace",
]

#: The TokenSpeed release every name below was read from.
READ_FROM = "TokenSpeed 0.1.1 (tokenspeed-kernel 0.1.4)"

_FLASHMLA = "tokenspeed.runtime.layers.attention.backends.paged.flashmla"
_DSA = "tokenspeed_kernel.ops.attention.dsa.flashinfer"
_FLASHMLA_GLOBAL = "_global_workspace_buffer"
_DSA_BYTES = "_DSA_SPARSE_WORKSPACE_BYTES"


def flashmla_module() -> Any:
    """Return TokenSpeed's FlashMLA backend module (imports it)."""
    return importlib.import_module(_FLASHMLA)


def flashmla_workspace(module: Any) -> Any:
    """Return ``flashmla._global_workspace_buffer``, the buffer a FlashMLA backend takes when built (TokenSpeed 0.1.1).

    ``None`` until a backend allocated it: ``FlashMLABackend.__init__`` allocates
    ``get_flashinfer_workspace_size()`` bytes there when it finds ``None``.
    """
    return getattr(module, _FLASHMLA_GLOBAL, None)


def set_flashmla_workspace(module: Any, buffer: Any) -> None:
    """Set ``flashmla._global_workspace_buffer``, which ``FlashMLABackend.__init__`` reads (TokenSpeed 0.1.1)."""
    setattr(module, _FLASHMLA_GLOBAL, buffer)


def dsa_workspace_bytes() -> int:
    """Return ``_DSA_SPARSE_WORKSPACE_BYTES``, DSA sparse MLA's fixed size (tokenspeed-kernel 0.1.4: 384 MiB)."""
    return int(getattr(importlib.import_module(_DSA), _DSA_BYTES))


#: Every accessor with the module and name it reads (for the test that they still exist).
ACCESSORS: dict[str, tuple[str, str]] = {
    "flashmla_workspace": (_FLASHMLA, _FLASHMLA_GLOBAL),
    "dsa_workspace_bytes": (_DSA, _DSA_BYTES),
}
