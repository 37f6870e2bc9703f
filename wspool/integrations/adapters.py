"""Drop-in replacements for the workspace functions that engines keep as module globals.

:func:`get_workspace_buffer` has the exact signature and semantics of vLLM's
FlashInfer MLA ``_get_workspace_buffer(return_lse)`` (128 MiB, or 256 MiB once a
call returns the LSE, grown lazily and reused), backed by the process-wide
registry's pool ``flashinfer_mla`` (rules ``default`` and ``lse``); it is also
importable under vLLM's own name, so a backend switches with one import::

    from wspool.integrations.adapters import _get_workspace_buffer

What wspool adds: sizes from the configuration and the device's profile, one
buffer shared with the pool's other backends, a buffer per device and lane,
growth refused during capture or while frozen, and statistics. The call passes
no facts: a rule reads the pool's default facts or the device's, which
:func:`check_workspace_facts` checks at load time.

Device semantics: the current CUDA device at each call. Thread semantics:
thread-safe. Capture semantics: growth during capture raises
:class:`~wspool.errors.WorkspaceFrozenError`; warm up both sizes first.
"""

from __future__ import annotations

import torch

from wspool.devices import DeviceLike
from wspool.registry import PoolRegistry, get_registry
from wspool.settings.schema import VLLM_FIXED_MLA_WORKSPACE_BYTES

__all__ = [
    "FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE",
    "FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE",
    "check_workspace_facts",
    "get_workspace_buffer",
]

#: vLLM's fixed sizes, for code that imports them; the sizes served come from the configuration.
FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE = VLLM_FIXED_MLA_WORKSPACE_BYTES["default"]
FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE = VLLM_FIXED_MLA_WORKSPACE_BYTES["lse"]

_POOL = "flashinfer_mla"
_DEVICE = "cuda"  # the current CUDA device at each call (tests point it at the CPU)


def get_workspace_buffer(return_lse: bool) -> torch.Tensor:
    """Return FlashInfer MLA's workspace: the ``flashinfer_mla`` pool's buffer, grown to rule ``lse`` or ``default``.

    Args:
        return_lse: Whether the call also returns the LSE (the larger rule).

    Returns:
        A zero-filled ``uint8`` buffer of at least the rule's size (128 MiB /
        256 MiB by default); the same tensor on later calls while it suffices.

    Raises:
        WorkspaceFrozenError: It would have to grow while frozen or capturing.
        WorkspaceLimitError: It would have to grow beyond ``max_bytes`` or memory.
    """
    return get_registry().workspace(_POOL, _DEVICE, rule="lse" if return_lse else "default")


def check_workspace_facts(registry: PoolRegistry | None = None, device: DeviceLike = _DEVICE) -> None:
    """Check at load time that :func:`get_workspace_buffer` can size both rules without facts.

    An engine calls it once while it loads (before its first decode step):
    a rule of ``flashinfer_mla`` that reads a fact neither the pool's default
    facts nor the device supply fails here, naming the key to set.

    Args:
        registry: The registry; default :func:`wspool.get_registry`.
        device: The device the calls will run on; default the current CUDA device.

    Raises:
        ConfigError: A fact is missing; the message names ``pools.flashinfer_mla.facts.<name>``
            and ``WSPOOL_POOLS__FLASHINFER_MLA__FACTS__<NAME>``.
    """
    (registry or get_registry()).check_facts(_POOL, ("default", "lse"), device=device)


#: vLLM's name for the function, so a backend switches by changing one import.
_get_workspace_buffer = get_workspace_buffer
