"""wspool in vLLM 0.33 and 0.34: the ``vllm.general_plugins`` entry point and what it patches.

:func:`register` is the entry point (:mod:`wspool.integrations.vllm.plugin`
declares the targets); the replacements live in
:mod:`~wspool.integrations.vllm.getters`, the engine's facts in
:mod:`~wspool.integrations.vllm.facts`, the FlashInfer wrappers' int
workspaces in :mod:`~wspool.integrations.vllm.wrappers`. docs/vllm.md is the
user's guide.
"""

from __future__ import annotations

from wspool.integrations import VLLM
from wspool.integrations.vllm.getters import DEVICE_ENV_VAR
from wspool.integrations.vllm.plugin import GROUPS, INTEGRATION, TARGETS

__all__ = ["DEVICE_ENV_VAR", "ENABLE_ENV_VAR", "GROUPS", "INTEGRATION", "TARGETS", "patched", "register", "unregister"]

#: ``0`` (or ``false``, ``off``, ``no``) leaves vLLM untouched although the plugin loads; other values are refused.
ENABLE_ENV_VAR = VLLM.switch_var


def register() -> None:
    """Install wspool's workspaces into vLLM (the ``vllm.general_plugins`` entry point); never raises.

    Idempotent. Reads the switch, checks vLLM's version and wspool's
    configuration, then patches each group all or none; logs one line.
    """
    INTEGRATION.load()


def unregister() -> list[str]:
    """Put vLLM's originals back (for tests); return the names restored."""
    return INTEGRATION.unload()


def patched() -> list[str]:
    """Return the names of the vLLM attributes wspool replaced in this process."""
    return INTEGRATION.patched()
