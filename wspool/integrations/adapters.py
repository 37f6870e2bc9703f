"""Drop-in replacements for the workspace functions that engines keep as module globals.

vLLM's FlashInfer MLA backend (after PR #47074) keeps one module-level buffer,
128 MiB, or 256 MiB once a call returns the LSE, grown lazily and reused.
:func:`get_workspace_buffer` has that function's exact signature and
semantics, backed by the process-wide registry; it is also importable under
vLLM's own name, so the backend switches with one import::

    from wspool.integrations.adapters import _get_workspace_buffer

What stays the same: the rules (``default`` and ``lse`` of pool
``flashinfer_mla``), a zero-filled ``uint8`` buffer, growth only when a
call needs more, the same tensor returned while it suffices, allocation on
first use on the current CUDA device. What wspool adds: the sizes come from the
configuration (YAML, ``WSPOOL_*``, engine knobs) and the device's profile (on an
H200, ``auto`` gives the hopper profile's 17,369,088 bytes for both rules instead
of 128 MiB / 256 MiB), the buffer is shared with
the other backends of that pool (paged attention by default), each CUDA device
(and lane) gets its own buffer instead of the first device's, growth refuses
to happen during CUDA-graph capture or while the registry is frozen, and the
statistics count the calls.

Device semantics: the current CUDA device at each call, like vLLM's
``device="cuda"``. Thread semantics: thread-safe. Capture semantics: a call that
would grow the buffer during capture raises
:class:`~wspool.errors.WorkspaceFrozenError` instead of replacing memory that
a graph uses; warm up both sizes before capturing.

Facts: the call passes none, so every fact a rule reads comes from the pool's
default facts (``pools.flashinfer_mla.facts``: an engine's largest batch, its
heads per rank) or the device (``sm_count``...). :func:`check_workspace_facts`
checks that at load time, naming the key of each fact that is missing.
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
